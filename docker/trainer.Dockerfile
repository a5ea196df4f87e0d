# syntax=docker/dockerfile:1
# trainer-svc image: the actor (megatron-core), its gRPC control plane and HTTP health/metrics.
#
#   docker build -f docker/trainer.Dockerfile -t weightsync-trainer:0.1.0 .
#   docker build -f docker/trainer.Dockerfile --build-arg INSTALL_TE=true -t weightsync-trainer:0.1.0-te .
#
# The base is pinned by tag. To pin by digest as well (recommended for releases), resolve it once
#   docker buildx imagetools inspect pytorch/pytorch:2.11.0-cuda12.8-cudnn9-devel
# and pass --build-arg BASE_IMAGE=pytorch/pytorch:2.11.0-cuda12.8-cudnn9-devel@sha256:<digest>.
# The devel flavour is used because Transformer Engine (optional) compiles against nvcc/cuDNN headers.
ARG BASE_IMAGE=pytorch/pytorch:2.11.0-cuda12.8-cudnn9-devel
FROM ${BASE_IMAGE}

# Optional Transformer Engine (megatron-core's TE layer specs). Off by default: the local
# layer spec runs without it, and TE's build adds ~20 minutes and several GB.
ARG INSTALL_TE=false
ARG TE_VERSION=2.9.0

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

WORKDIR /opt/weightsync
# Only what the package build needs (see .dockerignore): metadata first for layer caching.
COPY pyproject.toml README.md ./
COPY weightsync ./weightsync
COPY trainer_svc ./trainer_svc
COPY rollout_svc ./rollout_svc

# torch comes from the base image; `.[train]` adds megatron-core and the control-plane deps.
# The import check fails the build if a dependency is missing, not the first pod start.
# DL3013: "." is this repo; its dependency ranges live in pyproject.toml.
# hadolint ignore=DL3013
RUN python -m pip install --no-cache-dir ".[train]" \
 && if [ "${INSTALL_TE}" = "true" ]; then \
        python -m pip install --no-cache-dir --no-build-isolation "transformer-engine[pytorch]==${TE_VERSION}"; \
    fi \
 && python -c "import trainer_svc.cli, megatron.core, weightsync.v1.trainer_pb2" \
 && trainer-svc serve --help >/dev/null

# Non-root; the UID is what the Helm chart's securityContext expects (runAsUser 10001).
RUN groupadd --gid 10001 ws \
 && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/ws --shell /usr/sbin/nologin ws
USER 10001:10001
WORKDIR /home/ws
ENV HOME=/home/ws

# gRPC (control plane + admin), HTTP (/healthz /readyz /metrics), torchrun rendezvous.
EXPOSE 50051 8081 29500

# For plain `docker run` only (Kubernetes ignores HEALTHCHECK and uses the chart's probes).
# Only global rank 0 serves HTTP; the port follows --http-address via WS_HEALTHCHECK_PORT.
ENV WS_HEALTHCHECK_PORT=8081
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import os, sys, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('WS_HEALTHCHECK_PORT', '8081'), timeout=4); sys.exit(0)"]

ENTRYPOINT ["trainer-svc"]
CMD ["serve", "--grpc-address", "0.0.0.0:50051", "--http-address", "0.0.0.0:8081"]
