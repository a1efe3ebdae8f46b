# The tiercache server image. Tags are the package version (tiercache/__init__.py), with -gpu for the GPU build:
#   docker build -t tiercache:0.1.0 .                                   (CPU nodes)
#   docker build --build-arg EXTRAS=gpu -t tiercache:0.1.0-gpu .        (GPU nodes: torch with CUDA for --gpu-mem)
#   docker run --rm --shm-size 2g -p 50051:50051 -p 50053:50053 tiercache:0.1.0
# The host tier lives in /dev/shm: Docker's default of 64 MB cannot hold it (--shm-size above the host tier, or
# --ipc=host). The install step is scripts/install.sh, the script the README's `make test` and `make serve` run, so
# CI exercises it; the image build itself is not run in CI (no container engine there). See docs/deploy.md.
FROM python:3.12-slim-bookworm

ARG EXTRAS=""
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    VENV=/opt/tiercache/venv \
    INSTALL_REDIS=0 \
    PATH=/opt/tiercache/venv/bin:$PATH

WORKDIR /opt/tiercache/src
COPY pyproject.toml setup.py README.md ./
COPY proto ./proto
COPY scripts ./scripts
COPY tiercache ./tiercache
RUN PIP_NO_CACHE_DIR=1 scripts/install.sh "$EXTRAS" \
    && groupadd --system --gid 10001 tiercache \
    && useradd --system --uid 10001 --gid tiercache --home-dir /var/lib/tiercache --create-home tiercache

USER 10001:10001
# gRPC, plaintext health (probes), the data channel, Prometheus metrics: the ports deploy/base uses.
EXPOSE 50051 50052 50053 9400
ENTRYPOINT ["tiercache", "serve"]
# The embedded defaults (1 GiB host tier, 4 GiB disk tier), reachable from outside the container, on the ports above.
# Kubernetes replaces these with `--config /etc/tiercache/tiercache.yaml` (deploy/base).
CMD ["--host", "0.0.0.0", "--data-port", "50053", "--health-port", "50052", "--metrics-port", "9400", \
     "--metrics-host", "0.0.0.0", "--disk-dir", "/var/lib/tiercache/chunks"]
