# The farm's image: worker, producer commands and Flower (ENTRYPOINT `renderfarm`).
#
#   docker build -f infra/worker.Dockerfile -t renderfarm-worker:cpu .                      JAX on CPU
#   docker build -f infra/worker.Dockerfile --build-arg EXTRA=tpu -t renderfarm-worker:tpu .  jax[tpu]
#
# On a TPU VM the container needs the host's TPU devices and network. worker.env (written by
# infra/tpu/startup.sh) points the caches at /var/cache/renderfarm, which belongs to the host's
# `renderfarm` user (mode 700): mount it at the same path and run as that user:
#   docker run --rm --privileged --net=host --env-file /etc/renderfarm/worker.env \
#     --user "$(id -u renderfarm):$(id -g renderfarm)" -v /var/cache/renderfarm:/var/cache/renderfarm \
#     renderfarm-worker:tpu worker --model REF --out gs://BUCKET/PREFIX
# (infra/tpu/ runs the worker without a container; see docs/operations.md.)
# Python 3.12: requirements.lock is resolved on it.
FROM python:3.12-slim
# The pyproject extra to install: worker (JAX on CPU; GPU needs its own jax wheels) or tpu.
ARG EXTRA=worker
# Flower for `renderfarm flower`; requirements.lock wins once it pins flower.
ARG FLOWER_SPEC="flower>=2.2,<3"
ENV PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
COPY pyproject.toml requirements.lock README.md ./
COPY renderfarm renderfarm
COPY renderfarm_cli renderfarm_cli
COPY producer producer
COPY diffusion diffusion
COPY worker worker
RUN pip install --no-cache-dir -c requirements.lock ".[${EXTRA}]" "${FLOWER_SPEC}"
# Every process runs as this user, never root; its uid is fixed (10001) so that a volume or
# a host folder can be handed to it. It owns /cache, mode 700: the JAX compilation cache
# holds code the worker runs, and the worker refuses a cache folder that is not its own or
# that others may write. A named volume mounted on /cache (compose) takes this ownership
# and mode when it is first used; a bind mount keeps the host folder's (chown it to 10001).
RUN groupadd --gid 10001 renderfarm \
 && useradd --uid 10001 --gid renderfarm --no-log-init --create-home --home-dir /home/renderfarm \
      --shell /usr/sbin/nologin renderfarm \
 && install -d -o renderfarm -g renderfarm -m 700 /cache /cache/jax /cache/models /cache/hf
ENV RENDERFARM_COMPILE_CACHE=/cache/jax RENDERFARM_MODEL_CACHE=/cache/models HF_HOME=/cache/hf
# Numeric, so that a runtime can tell it is not root (Kubernetes runAsNonRoot).
USER 10001:10001
ENTRYPOINT ["renderfarm"]
