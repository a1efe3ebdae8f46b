#!/usr/bin/env bash
# SGLang's real engine on the CPU, for tests/sglang_engine (issue 25): .venv-sglang (scripts/install_sglang.sh) plus
# what SGLang's engine and HTTP server import beyond its storage interface, pinned in
# requirements/sglang-engine-0.5.23.txt and installed with --no-deps (pip's resolver would swap the CPU torch for
# a CUDA build: SGLang asks for torch 2.14, sgl-kernel and flashinfer). SGLang's CUDA kernels are not installed: the
# tests put a pure-torch stand-in and the CPU patches in place at interpreter start (testkit/sglang_site).
# Idempotent. Usage: scripts/install_sglang_engine.sh
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${SGLANG_VENV:-.venv-sglang}
say() { echo "sglang engine install: $*"; }

SGLANG_VENV=$VENV scripts/install_sglang.sh
stamp="$VENV/.installed-engine-$(cat requirements/sglang-engine-0.5.23.txt | sha1sum | cut -c1-12)"
if [ ! -e "$stamp" ]; then
    say "installing SGLang's engine packages into $VENV with --no-deps" \
        "(requirements/sglang-engine-0.5.23.txt: uvloop, fastapi, xgrammar, ...; about 60 MB)"
    "${PYTHON:-python3}" scripts/seed_venv.py "$VENV" -r requirements/sglang-engine-0.5.23.txt \
        || echo "seed_venv failed: pip installs every package"  # (as in install_sglang.sh)
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps \
        -r requirements/sglang-engine-0.5.23.txt 2>&1 | { grep -v 'is ignored: it is neither a file nor a directory' || true; }
    say "checking that SGLang's engine and HTTP server import with the CPU harness (testkit/sglang_site)"
    SGLANG_USE_CPU_ENGINE=1 PYTHONPATH=testkit/sglang_site "$VENV/bin/python" -W ignore -c \
        "import sglang.srt.entrypoints.engine, sglang.srt.entrypoints.http_server" >/dev/null 2>&1 \
        || { echo "SGLang's engine does not import in $VENV; remove it and re-run" >&2; exit 1; }
    touch "$stamp"
else
    say "$VENV already has SGLang's engine packages ($stamp)"
fi
"$VENV/bin/python" -c "import torch; assert torch.version.cuda is None, 'a CUDA torch: remove $VENV and re-run'"
if "$VENV/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('sgl_kernel') is None)"; then
    echo "$VENV has SGLang's CUDA kernel package (sgl_kernel; installing it with its dependencies replaces the" \
        "CPU torch): remove $VENV and re-run" >&2
    exit 1
fi
