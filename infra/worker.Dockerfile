# Worker image: JAX on the CPU by default; build with --build-arg EXTRA=tpu on a TPU VM.
FROM python:3.11-slim
ARG EXTRA=worker
WORKDIR /app
COPY pyproject.toml requirements.lock README.md ./
COPY renderfarm renderfarm
COPY producer producer
COPY worker worker
RUN pip install --no-cache-dir -c requirements.lock ".[${EXTRA}]"
ENV RENDERFARM_COMPILE_CACHE=/cache/jax RENDERFARM_MODEL_CACHE=/cache/models
ENTRYPOINT ["renderfarm"]
