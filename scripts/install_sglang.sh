#!/usr/bin/env bash
# A third virtual environment, .venv-sglang, with SGLang 0.5.23 beside torch 2.13.0 (CPU) and tiercache itself, for
# the SGLang HiCache storage backend (tiercache.connector.sglang). Every package is pinned in
# requirements/sglang-0.5.23.txt and installed with --no-deps, so pip's resolver never swaps torch for a CUDA build
# (SGLang's own metadata asks for torch 2.14, sgl-kernel and flashinfer: none of them is needed on this path).
# Idempotent. Usage: scripts/install_sglang.sh   (building tiercache generates its protobuf stubs)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${SGLANG_VENV:-.venv-sglang}

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
stamp="$VENV/.installed-$(cat requirements/sglang-0.5.23.txt pyproject.toml | sha1sum | cut -c1-12)"
if [ ! -e "$stamp" ]; then
    quiet() { { grep -v 'is ignored: it is neither a file nor a directory' || true; }; }
    # what another of this checkout's venvs already holds at a pinned version (torch, triton, ...) is linked from
    # there, unpacked and compiled, not installed again (scripts/seed_venv.py); pip installs the rest
    "$PYTHON" scripts/seed_venv.py "$VENV" -r requirements/sglang-0.5.23.txt "torch==2.13.0" \
        || echo "seed_venv failed: pip installs every package"
    # pip's notice of missing dependencies of what was linked is transient here: they come with the pinned list next
    # (--no-deps), and the import check below is the gate
    transient() { { grep -vE "^ERROR: pip's dependency resolver|which is (not installed|incompatible)\.$" || true; }; }
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check "torch==2.13.0" 2>&1 | quiet | transient
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps \
        -r requirements/sglang-0.5.23.txt 2>&1 | quiet
    # (checkouts before issue 24 installed this package as "tiercache", PyPI's name for an unrelated project)
    "$VENV/bin/python" -m pip uninstall -q -y tiercache 2>/dev/null || true
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e . 2>&1 | quiet
    touch "$stamp"
fi
"$VENV/bin/python" -c "import torch; assert torch.version.cuda is None, 'a CUDA torch: remove $VENV and re-run'"
"$VENV/bin/python" -c "from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory; \
import tiercache.client" 2>/dev/null \
    || { echo "the SGLang environment in $VENV does not import; remove it and re-run" >&2; exit 1; }
