# The farm's image: worker, producer commands and Flower (ENTRYPOINT `renderfarm`).
#
#   docker build -f infra/worker.Dockerfile -t renderfarm-worker:cpu .                      JAX on CPU
#   docker build -f infra/worker.Dockerfile --build-arg EXTRA=tpu -t renderfarm-worker:tpu .  jax[tpu]
#
# On a TPU VM the container needs the host's TPU devices and network:
#   docker run --rm --privileged --net=host --env-file /etc/renderfarm/worker.env \
#     -v /var/cache/renderfarm:/cache renderfarm-worker:tpu worker --model REF --out gs://BUCKET/PREFIX
# (infra/tpu/ runs the worker without a container; see docs/operations.md.)
FROM python:3.11-slim
# The pyproject extra to install: worker (JAX on CPU; GPU needs its own jax wheels) or tpu.
ARG EXTRA=worker
# Flower for `renderfarm flower`; requirements.lock wins once it pins flower.
ARG FLOWER_SPEC="flower>=2.2,<3"
ENV PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
COPY pyproject.toml requirements.lock README.md ./
COPY renderfarm renderfarm
COPY producer producer
COPY worker worker
RUN pip install --no-cache-dir -c requirements.lock ".[${EXTRA}]" "${FLOWER_SPEC}"
# The JAX compilation cache holds code the worker will run: writable by the worker alone.
RUN install -d -m 700 /cache/jax /cache/models
ENV RENDERFARM_COMPILE_CACHE=/cache/jax RENDERFARM_MODEL_CACHE=/cache/models
ENTRYPOINT ["renderfarm"]
