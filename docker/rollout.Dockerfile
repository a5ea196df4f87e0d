# syntax=docker/dockerfile:1
# rollout-svc image: an SGLang engine behind weightsync's rollout service.
#
#   docker build -f docker/rollout.Dockerfile -t weightsync-rollout:0.1.0 .
#
# SGLang pins its own torch, CUDA kernels and most of our runtime deps, so this repo is installed
# with --no-deps and only the packages SGLang does not ship are added. megatron-core is NOT
# installed: a rollout pod never imports it (docs/architecture.md, lazy heavy imports).
# The base is pinned by tag (inside pyproject's sglang>=0.5.4,<0.6). To pin by digest as well:
#   docker buildx imagetools inspect lmsysorg/sglang:v0.5.18
# and pass --build-arg BASE_IMAGE=lmsysorg/sglang:v0.5.18@sha256:<digest>.
ARG BASE_IMAGE=lmsysorg/sglang:v0.5.18
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

WORKDIR /opt/weightsync
COPY pyproject.toml README.md ./
COPY weightsync ./weightsync
COPY trainer_svc ./trainer_svc
COPY rollout_svc ./rollout_svc

# grpcio / health checking / protobuf are the control plane's, fastapi / uvicorn its HTTP side
# (pinned as in pyproject.toml; SGLang's server uses them too); everything else (torch,
# transformers, safetensors, numpy, prometheus-client, tqdm, pyyaml) comes with SGLang.
# The import check fails the build if SGLang's environment lacks something we need.
RUN python -m pip install --no-cache-dir --no-deps . \
 && python -m pip install --no-cache-dir \
        "grpcio>=1.85.1" "grpcio-health-checking>=1.85.1" "protobuf>=7.35.1" \
        "prometheus-client>=0.20" "safetensors>=0.4" "pyyaml>=6" "fastapi==0.165.0" "uvicorn==0.54.0" \
 && python -c "import rollout_svc.cli, rollout_svc.app, sglang, uvicorn, weightsync.v1.rollout_pb2" \
 && rollout-svc serve --help >/dev/null

RUN groupadd --gid 10001 ws \
 && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/ws --shell /usr/sbin/nologin ws
USER 10001:10001
WORKDIR /home/ws
ENV HOME=/home/ws

# gRPC (control plane + generation), HTTP (/healthz /readyz /metrics), TCP weight bus.
EXPOSE 50061 8091 50071

# For plain `docker run` only (Kubernetes ignores HEALTHCHECK and uses the chart's probes).
ENV WS_HEALTHCHECK_PORT=8091
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import os, sys, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('WS_HEALTHCHECK_PORT', '8091'), timeout=4); sys.exit(0)"]

ENTRYPOINT ["rollout-svc"]
CMD ["serve", "--grpc-address", "0.0.0.0:50061", "--http-address", "0.0.0.0:8091", "--data-address", "0.0.0.0:50071", "--engine", "sglang"]
