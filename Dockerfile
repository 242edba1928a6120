# syntax=docker/dockerfile:1.7
# Two images from one file. The flavour is the repository and the tag is the version, so one version pins
# both (kustomize `images:` newTag, compose, Helm-less installs alike):
#   docker build --target cpu -t onnxforge:0.1.0 .       API and CPU workers: onnxruntime
#   docker build --target gpu -t onnxforge-gpu:0.1.0 .   CUDA workers (target cuda): onnxruntime-gpu on the
#                                                        CUDA 13 + cuDNN 9 runtime; no TensorRT libraries,
#                                                        so the tensorrt target is not served by this image
# Both run Ubuntu's Python (one version, PYTHON_VERSION), install deploy/requirements/<flavour>.lock (exact
# pins with hashes, `make lock`) and then the project's wheel without dependencies; the locks carry the
# prepost extra, which GET /v1/passes advertises, and the otel extra, so ONNXFORGE_TRACING__ENABLED works
# without a derived image. Both run the same CLI: `onnxforge serve` or
# `onnxforge worker --queues cpu|gpu`.

ARG UBUNTU_VERSION=24.04
ARG PYTHON_VERSION=3.12
ARG CPU_IMAGE=ubuntu:${UBUNTU_VERSION}
# onnxruntime-gpu from PyPI is built for CUDA 13 and cuDNN 9 (see the nvidia-*-cu13 wheels its extras name).
ARG CUDA_IMAGE=nvidia/cuda:13.1.1-cudnn-runtime-ubuntu${UBUNTU_VERSION}

# ---- build: the project's own wheel (pure Python), with the images' Python ----
FROM ${CPU_IMAGE} AS build
ARG PYTHON_VERSION
RUN apt-get update \
    && apt-get install -y --no-install-recommends "python${PYTHON_VERSION}" "python${PYTHON_VERSION}-venv" \
    && rm -rf /var/lib/apt/lists/* \
    && "python${PYTHON_VERSION}" -m venv /opt/build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY onnxforge ./onnxforge
COPY app ./app
COPY workers ./workers
COPY passes ./passes
COPY core ./core
RUN /opt/build/bin/python -m pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# ---- cpu: API and CPU workers ----
FROM ${CPU_IMAGE} AS cpu
ARG PYTHON_VERSION
LABEL org.opencontainers.image.title="onnxforge" \
      io.onnxforge.targets="cpu"
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/venv/bin:$PATH \
    ONNXFORGE_STORAGE__DATA_DIR=/data \
    ONNXFORGE_API__HOST=0.0.0.0
RUN apt-get update \
    && apt-get install -y --no-install-recommends "python${PYTHON_VERSION}" "python${PYTHON_VERSION}-venv" \
    && rm -rf /var/lib/apt/lists/* \
    && "python${PYTHON_VERSION}" -m venv /opt/venv \
    && groupadd --system --gid 10001 onnxforge \
    && useradd --system --uid 10001 --gid 10001 --home-dir /data --shell /usr/sbin/nologin onnxforge \
    && mkdir -p /data /scratch && chown 10001:10001 /data /scratch
COPY deploy/requirements/cpu.lock /tmp/requirements.lock
COPY --from=build /wheels /wheels
RUN python -m pip install --no-cache-dir --require-hashes -r /tmp/requirements.lock \
    && python -m pip install --no-cache-dir --no-deps /wheels/*.whl \
    && python -m pip check \
    && rm -rf /wheels /tmp/requirements.lock
USER 10001:10001
WORKDIR /data
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-m", "onnxforge.healthcheck", "http://127.0.0.1:8000/healthz"]
ENTRYPOINT ["onnxforge"]
CMD ["serve"]

# ---- gpu: CUDA workers ----
FROM ${CUDA_IMAGE} AS gpu
ARG PYTHON_VERSION
LABEL org.opencontainers.image.title="onnxforge-gpu" \
      io.onnxforge.targets="cuda"
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/venv/bin:$PATH \
    ONNXFORGE_STORAGE__DATA_DIR=/data \
    ONNXFORGE_WORKER__QUEUES='["gpu"]'
RUN apt-get update \
    && apt-get install -y --no-install-recommends "python${PYTHON_VERSION}" "python${PYTHON_VERSION}-venv" \
    && rm -rf /var/lib/apt/lists/* \
    && "python${PYTHON_VERSION}" -m venv /opt/venv \
    && groupadd --system --gid 10001 onnxforge \
    && useradd --system --uid 10001 --gid 10001 --home-dir /data --shell /usr/sbin/nologin onnxforge \
    && mkdir -p /data /scratch && chown 10001:10001 /data /scratch
# The gpu lock pins onnxruntime-gpu and not onnxruntime: the CPU build never enters this image.
COPY deploy/requirements/gpu.lock /tmp/requirements.lock
COPY --from=build /wheels /wheels
RUN python -m pip install --no-cache-dir --require-hashes -r /tmp/requirements.lock \
    && python -m pip install --no-cache-dir --no-deps /wheels/*.whl \
    && python -m pip check \
    && rm -rf /wheels /tmp/requirements.lock
USER 10001:10001
WORKDIR /data
HEALTHCHECK --interval=30s --timeout=10s --start-period=30s --retries=3 \
    CMD ["python", "-m", "onnxforge.healthcheck", "--worker"]
ENTRYPOINT ["onnxforge"]
CMD ["worker", "--queues", "gpu"]
