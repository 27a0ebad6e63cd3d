# tokembed server image: the gRPC embedding service with its model baked in.
#
#   docker build -t tokembed:cpu .                       # the built-in default model, no torch
#   docker build -t tokembed:cpu --build-arg MODEL_SOURCE=export \
#       --build-arg MODEL_VOCAB_SIZE=50257 --build-arg MODEL_D_MODEL=768 .   # another, with torch
#   tokembed export --out models/mine ...               # or export on the host ...
#   docker build -t tokembed:cpu --build-arg MODEL_SOURCE=context \
#       --build-arg MODEL_DIR=models/mine .             # ... and bake that in
#
# Stages: `deps` (a venv with the server's dependencies), `builder` (the project's wheel);
# `model-builtin` (the built-in default model, no torch), `model-export` (CPU torch, runs
# `tokembed export`) or `model-context` (copies MODEL_DIR from the build context), chosen
# by MODEL_SOURCE; `runtime` (the last stage, the image)
# copies the venv and the model and holds no compiler, no pip cache and no torch.
# Builders that skip unused stages (BuildKit, buildah/podman) never run the stage that
# MODEL_SOURCE does not select, so a build from a context model never downloads torch.
# The CUDA variant is Dockerfile.cuda.

# python:3.11-slim-bookworm by default; any image with a `python` (>= 3.11) that can
# `python -m venv` works, e.g. the local stand-in in deploy/local-images/.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
# builtin: the built-in default model; export: export one here with torch (the MODEL_*
# arguments); context: take MODEL_DIR from the build context.
ARG MODEL_SOURCE=builtin
# (Older buildah, e.g. podman 4.3's, resolves a stage name in FROM from --build-arg values
# only, not from this default: pass --build-arg MODEL_SOURCE=builtin there. BuildKit and
# newer buildah do not need it; docker-compose.yml always passes it.)

# ---------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS deps
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY deploy/docker/requirements.py /tmp/requirements.py
COPY pyproject.toml ./
# Only the dependencies here (see requirements.py): this layer survives code changes.
RUN python /tmp/requirements.py pyproject.toml server > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt

# ---------------------------------------------------------------------------------------
FROM deps AS builder
# The project's packages, as pyproject.toml maps them (see .dockerignore for the rest).
# README.m[d]: the readme pyproject.toml names, if present (the pattern may match nothing).
COPY pyproject.toml README.m[d] ./
COPY protos/ protos/
COPY cli/ cli/
COPY export/ export/
COPY server/ server/
COPY client/ client/
COPY bench/ bench/
# A wheel, installed into the runtime stage's copy of the deps venv: a code change
# rebuilds this and one small layer there, not the venv layer.
RUN pip wheel --no-deps --wheel-dir /wheels .

# ---------------------------------------------------------------------------------------
# The model, option 0 (the default): the built-in default model, built here exactly as
# `tokembed serve` builds it when given none (the same bytes); the server's own packages
# build it, no torch.
FROM builder AS model-builtin
RUN pip install --no-deps /wheels/*.whl \
    && tokembed export --builtin --out /model

# ---------------------------------------------------------------------------------------
# The model, option 1: export it here. Only this stage ever sees torch.
FROM builder AS model-export
# The CPU build of torch: PyPI's plain `torch` is a multi-GB CUDA build.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG MODEL_VOCAB_SIZE=32000
ARG MODEL_D_MODEL=512
ARG MODEL_SEED=0
ARG MODEL_DTYPE=float32
ARG MODEL_SCALE=sqrt
ARG MODEL_NAME=tokembed-default
ARG MODEL_VERSION=1
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" \
    && python /tmp/requirements.py pyproject.toml export > /tmp/export-requirements.txt \
    && pip install -r /tmp/export-requirements.txt \
    && pip install --no-deps /wheels/*.whl
RUN tokembed export --out /model \
        --vocab-size "${MODEL_VOCAB_SIZE}" --d-model "${MODEL_D_MODEL}" \
        --seed "${MODEL_SEED}" --dtype "${MODEL_DTYPE}" --scale "${MODEL_SCALE}" \
        --name "${MODEL_NAME}" --model-version "${MODEL_VERSION}"

# The model, option 2: a model directory exported elsewhere (`tokembed export --out DIR`),
# inside the build context. The server checks its manifest and hashes at start-up.
FROM scratch AS model-context
ARG MODEL_DIR=models/default
COPY ${MODEL_DIR}/ /model/

FROM model-${MODEL_SOURCE} AS model
# Not an empty stage: podman 4.3 leaves a build container mounted (holding the model's
# layer) after an empty one when the build comes through its Docker API (compose).
LABEL org.tokembed.stage=model

# ---------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime
ARG TOKEMBED_UID=10001
RUN groupadd --system --gid "${TOKEMBED_UID}" tokembed \
    && useradd --system --uid "${TOKEMBED_UID}" --gid tokembed --no-create-home \
        --home-dir /nonexistent --shell /usr/sbin/nologin tokembed
COPY --from=deps /opt/venv /opt/venv
COPY --from=builder /wheels /tmp/wheels
RUN /opt/venv/bin/pip install --no-deps --no-cache-dir /tmp/wheels/*.whl \
    && /opt/venv/bin/pip check \
    && rm -rf /tmp/wheels
COPY --from=model /model /opt/tokembed/model
# Every server flag is also a TOKEMBED_* variable; these are the image's defaults, and
# `docker run -e` or extra arguments after the image name override them.
# GLIBC_TUNABLES: glibc backs its large blocks (answers' response bytes, gRPC's copies)
# with transparent huge pages; docs/deployment.md, "Allocator", has the figures.
# TOKEMBED_TARGET is where `tokembed health` (the HEALTHCHECK) looks: keep it on the
# gRPC port when you change TOKEMBED_PORT.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    TOKEMBED_MODEL_DIR=/opt/tokembed/model \
    TOKEMBED_HOST=0.0.0.0 \
    TOKEMBED_PORT=50051 \
    TOKEMBED_METRICS_HOST=0.0.0.0 \
    TOKEMBED_METRICS_PORT=9464 \
    TOKEMBED_DEVICE=cpu \
    TOKEMBED_GRACE_S=10 \
    TOKEMBED_TARGET=127.0.0.1:50051 \
    GLIBC_TUNABLES=glibc.malloc.hugetlb=1:glibc.malloc.mmap_threshold=4194304
# Numeric, so that Kubernetes can verify runAsNonRoot without reading /etc/passwd.
USER ${TOKEMBED_UID}:${TOKEMBED_UID}
WORKDIR /tmp
# 50051: gRPC (Embed, grpc.health.v1, reflection); 9464: Prometheus /metrics.
EXPOSE 50051 9464
# SIGTERM: the server stops taking new calls and drains within TOKEMBED_GRACE_S;
# give containers a stop timeout longer than that (compose stop_grace_period,
# Kubernetes terminationGracePeriodSeconds).
STOPSIGNAL SIGTERM
# Exec form, no spaces inside an argument: podman's Docker-compatible API splits on them.
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
    CMD ["tokembed","health"]
ENTRYPOINT ["tokembed", "serve"]
