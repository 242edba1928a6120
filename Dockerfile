# syntax=docker/dockerfile:1.7
# Two images from one file:
#   docker build --target cpu -t onnxforge:cpu .   (python slim, onnxruntime)
#   docker build --target gpu -t onnxforge:gpu .   (CUDA runtime, onnxruntime-gpu)
# Both run the same CLI: `onnxforge serve` (API) or `onnxforge worker --queues cpu|gpu`.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

# ---- build: the project's own wheel; each image installs it with dependencies for its own Python ----
FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY onnxforge ./onnxforge
COPY app ./app
COPY workers ./workers
COPY passes ./passes
RUN python -m pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# ---- cpu: API and CPU workers ----
FROM ${PYTHON_IMAGE} AS cpu
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    ONNXFORGE_STORAGE__DATA_DIR=/data \
    ONNXFORGE_API__HOST=0.0.0.0
RUN useradd --system --uid 10001 --home-dir /data --shell /usr/sbin/nologin onnxforge \
    && mkdir -p /data && chown onnxforge /data
COPY --from=build /wheels /wheels
RUN python -m pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
USER onnxforge
WORKDIR /data
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-m", "onnxforge.healthcheck", "http://127.0.0.1:8000/healthz"]
ENTRYPOINT ["onnxforge"]
CMD ["serve"]

# ---- gpu: CUDA workers (targets cuda and tensorrt) ----
FROM ${CUDA_IMAGE} AS gpu
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    ONNXFORGE_STORAGE__DATA_DIR=/data \
    ONNXFORGE_WORKER__QUEUES='["gpu"]'
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN useradd --system --uid 10001 --home-dir /data --shell /usr/sbin/nologin onnxforge \
    && mkdir -p /data && chown onnxforge /data
COPY --from=build /wheels /wheels
# The CPU wheel of onnxruntime comes in as a dependency; the GPU build replaces it (same import name).
RUN python -m pip install --no-cache-dir /wheels/*.whl \
    && python -m pip uninstall -y onnxruntime \
    && python -m pip install --no-cache-dir "onnxruntime-gpu>=1.22" \
    && rm -rf /wheels
USER onnxforge
WORKDIR /data
HEALTHCHECK --interval=30s --timeout=10s --start-period=30s --retries=3 \
    CMD ["python", "-m", "onnxforge.healthcheck", "--worker"]
ENTRYPOINT ["onnxforge"]
CMD ["worker", "--queues", "gpu"]
