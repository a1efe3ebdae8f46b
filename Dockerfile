# The tiercache server image. Build: docker build -t tiercache:0.1 .        (CPU nodes)
#                                    docker build --build-arg EXTRAS=proto,gpu -t tiercache:0.1-gpu .   (GPU nodes)
# The install steps are scripts/install.sh, the script the README's `make test` runs, so CI exercises them; the image
# build itself is not run in CI (no container engine there). See docs/deploy.md.
FROM python:3.12-slim-bookworm

ARG EXTRAS=proto
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    VENV=/opt/tiercache/venv \
    INSTALL_REDIS=0 \
    PATH=/opt/tiercache/venv/bin:$PATH

WORKDIR /opt/tiercache/src
COPY pyproject.toml README.md ./
COPY proto ./proto
COPY scripts ./scripts
COPY tiercache ./tiercache
RUN PIP_NO_CACHE_DIR=1 scripts/install.sh "$EXTRAS" \
    && groupadd --system --gid 10001 tiercache \
    && useradd --system --uid 10001 --gid tiercache --home-dir /var/lib/tiercache --create-home tiercache

USER 10001:10001
# gRPC, plaintext health (probes), Prometheus metrics: the ports deploy/base uses.
EXPOSE 50051 50052 50053 9400
ENTRYPOINT ["tiercache", "serve"]
CMD ["--config", "/etc/tiercache/tiercache.yaml"]
