# syntax=docker/dockerfile:1
# kvroute router image: the project wheel and its dependencies on python:3.11-slim, run as a non-root user.
#
#   docker build -t ghcr.io/kvroute/kvroute:0.1.0 .
#   docker run --rm -p 8080:8080 ghcr.io/kvroute/kvroute:0.1.0 serve --replica 'name=r0,url=http://engine:8000'
#
# The Helm chart (helm/kvroute) runs it with a read-only root filesystem; only /tmp (an emptyDir) is writable.

ARG PYTHON_IMAGE=python:3.11-slim

# ---- build: the kvroute wheel plus wheels of every runtime dependency --------------------------------------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# a C compiler for the compiled modules (membership/kv_native.c, index/key_table_native.c,
# index/engine_table_native.c, index/hash_native.c; setup.py); the image has the headers
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY router ./router
COPY index ./index
COPY membership ./membership
COPY policies ./policies
COPY sim ./sim
COPY fakes ./fakes
RUN pip wheel --no-deps --wheel-dir /dist . \
 && python -m zipfile -l /dist/kvroute-*.whl | grep -qE 'membership/kv_native\.[^ ]*\.so' \
 && python -m zipfile -l /dist/kvroute-*.whl | grep -qE 'index/key_table_native\.[^ ]*\.so' \
 && python -m zipfile -l /dist/kvroute-*.whl | grep -qE 'index/engine_table_native\.[^ ]*\.so' \
 && python -m zipfile -l /dist/kvroute-*.whl | grep -qE 'index/hash_native\.[^ ]*\.so' \
 && pip wheel --wheel-dir /wheels /dist/kvroute-*.whl

# ---- runtime ---------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp \
    HF_HOME=/tmp/hf
RUN groupadd --system --gid 10001 kvroute \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin kvroute
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-index --find-links /wheels kvroute
USER 10001:10001
WORKDIR /tmp
EXPOSE 8080
ENTRYPOINT ["kvroute"]
CMD ["serve"]
