# attnzoo serving image: the Open Inference Protocol (KServe v2) REST server, `python -m serving.server`,
# over a published model repository (model_repository/<model>/<version>/) mounted at /mnt/models, where
# KServe's storage initializer (s3://, gs://, ...) or its PVC mount (pvc://) puts an InferenceService's
# storageUri. torch-free: only pyproject.toml's `serve` extra is installed, never the project's main
# dependencies (torch, ray, mlflow, dvc ...). See deploy/README.md.
#
# CPU (default; onnxruntime from PyPI):
#   docker build -t attnzoo-serve:0.1.0 .
# GPU: a CUDA 13 + cuDNN 9 runtime base (what onnxruntime-gpu >= 1.27 on PyPI is built for; deploy/README.md) and
# onnxruntime-gpu instead of onnxruntime. Ubuntu 24.04's python3 is 3.12 (22.04's 3.10 is too old):
#   docker build -t attnzoo-serve:0.1.0-cuda \
#     --build-arg BASE=nvidia/cuda:13.0.0-cudnn-runtime-ubuntu24.04 --build-arg ONNXRUNTIME=onnxruntime-gpu .
# Run (the server picks the CUDA execution provider when a GPU is visible, `--provider auto`):
#   docker run --rm -p 8080:8080 -v "$PWD/model_repository:/mnt/models:ro" attnzoo-serve:0.1.0
ARG BASE=python:3.11-slim
FROM ${BASE}

# onnxruntime (CPU) or onnxruntime-gpu: replaces the `onnxruntime` entry of the serve extra, same version range.
ARG ONNXRUNTIME=onnxruntime

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# nvidia/cuda images come without Python: take the distribution's. Either way the server gets its own venv.
# (Not pinned: python3's version is the chosen base's.)
# hadolint ignore=DL3008
RUN if ! command -v python3 >/dev/null 2>&1; then \
        apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3 -m venv /opt/venv

WORKDIR /app

# What `pip install "attnzoo[serve]"` installs (pyproject.toml's base dependencies and the serve extra), at the
# exact versions of requirements-serve.lock (`make lock`: the training lock's versions, the ones CI tests), hash-
# checked, without building the package: the image holds serving/ only, not models/ or pipeline/. No torch (that
# is the train extra); the build fails if torch got in all the same.
# ONNXRUNTIME=onnxruntime-gpu: the list read from pyproject with onnxruntime-gpu for onnxruntime (same range),
# every other package held to the lock's version as a constraint, without hashes: the lock is resolved for
# CPython 3.11, and the CUDA base's python3 is 3.12, whose resolution (not only its files) may differ.
COPY pyproject.toml requirements-serve.lock ./
RUN python -c 'import os, re, tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; reqs = p["dependencies"] + p["optional-dependencies"]["serve"]; print("\n".join(re.sub(r"^onnxruntime(?=[\s<>=!~;\[]|$)", os.environ["ONNXRUNTIME"], r) for r in reqs))' > requirements-serve.txt \
    && cat requirements-serve.txt \
    && sed -e 's/ *\\$//' -e '/^ *--hash=/d' requirements-serve.lock > requirements-serve.constraints \
    && if [ "$ONNXRUNTIME" = onnxruntime ]; then pip install --require-hashes -r requirements-serve.lock; \
       else pip install -c requirements-serve.constraints -r requirements-serve.txt; fi \
    && python -c 'import importlib.util, sys; sys.exit("torch is installed in the serving image" if importlib.util.find_spec("torch") else 0)'

# The server itself: the serving package, nothing of models/ or pipeline/ (run from /app, no install needed).
COPY serving/ serving/

# Non-root, with a numeric id so that Kubernetes' runAsNonRoot can verify it.
RUN useradd --uid 10001 --user-group --no-create-home --home-dir /app --shell /usr/sbin/nologin attnzoo
USER 10001:10001

# 8080: the Open Inference Protocol over HTTP (REST); 8081: the same protocol over gRPC (KServe's default ports).
EXPOSE 8080 8081
# Docker's own health check (Kubernetes ignores it: deploy/kserve/serving-runtime.yaml has the probes).
# Ready: every version in the repository loaded. Loading all graphs takes a while, hence the start period.
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/v2/health/ready', timeout=4)"]

# `docker run IMAGE --workers 2 ...` or a ServingRuntime's args replace CMD (give the flags below again).
ENTRYPOINT ["python", "-m", "serving.server"]
# A production server answers the protocol only: no playground page at / (docs/security.md).
CMD ["--host", "0.0.0.0", "--port", "8080", "--grpc-port", "8081", "--repository", "/mnt/models", "--no-playground"]
