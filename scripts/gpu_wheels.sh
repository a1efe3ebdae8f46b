#!/usr/bin/env bash
# The wheels `make bench-gpu` needs beyond a GPU machine's own Python (python3 3.12 with a CUDA torch, transformers,
# numpy, grpcio, ...; nothing can be fetched there): tiercache's runtime dependencies that image lacks or holds in an
# older version than the generated stubs need, and the transformers the connector is tested with (Qwen3.5's classes).
# Downloaded here into .whl/ (ignored by git), then carried to the machine beside the working tree (~25 MB).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
    -d .whl grpcio==1.85.1 grpcio-health-checking==1.85.1 "protobuf==$(.venv/bin/python -c \
    'import google.protobuf as p; print(p.__version__)')" redis==5.2.1 lz4==4.4.4 pyzmq==27.1.0 transformers==5.23.0
ls -la .whl
