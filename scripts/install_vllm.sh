#!/usr/bin/env bash
# A second virtual environment, .venv-vllm, with vLLM 0.33.0 (CPU: VLLM_TARGET_DEVICE=cpu, no compiled ops needed for
# the scheduler, the KV cache manager and the connector API) beside torch 2.13.0 and tiercache itself. Separate from
# .venv because vLLM pins transformers < 5.21 while the hf extra pins 5.23. Every package is pinned in
# requirements/vllm-0.33.txt and installed with --no-deps, so pip's resolver never swaps torch for a CUDA build.
# Idempotent. Usage: scripts/install_vllm.sh   (building tiercache generates its protobuf stubs)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VLLM_VENV:-.venv-vllm}

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
stamp="$VENV/.installed-$(cat requirements/vllm-0.33.txt pyproject.toml | sha1sum | cut -c1-12)"
if [ ! -e "$stamp" ]; then
    quiet() { { grep -v 'is ignored: it is neither a file nor a directory' || true; }; }
    # what another of this checkout's venvs already holds at a pinned version (torch, triton, ...) is linked from
    # there, unpacked and compiled, not installed again (scripts/seed_venv.py); pip installs the rest
    "$PYTHON" scripts/seed_venv.py "$VENV" -r requirements/vllm-0.33.txt "torch==2.13.0" \
        || echo "seed_venv failed: pip installs every package"
    # pip's notice of missing dependencies of what was linked is transient here: they come with the pinned list next
    # (--no-deps), and the import check below is the gate
    transient() { { grep -vE "^ERROR: pip's dependency resolver|which is (not installed|incompatible)\.$" || true; }; }
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check "torch==2.13.0" 2>&1 | quiet | transient
    VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps \
        -r requirements/vllm-0.33.txt 2>&1 | quiet
    # (checkouts before issue 24 installed this package as "tiercache", PyPI's name for an unrelated project)
    "$VENV/bin/python" -m pip uninstall -q -y tiercache 2>/dev/null || true
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e . 2>&1 | quiet
    touch "$stamp"
fi
VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -c "import vllm.v1.core.sched.scheduler, tiercache.client" 2>/dev/null \
    || { echo "the vLLM environment in $VENV does not import; remove it and re-run" >&2; exit 1; }
