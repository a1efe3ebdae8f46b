#!/usr/bin/env bash
# A virtual environment, .venv-dynamo, with Dynamo 1.6.1's runtime wheel (ai-dynamo-runtime: the standalone KV indexer
# `python -m dynamo.indexer`, a Rust binary in a manylinux wheel of ~75 MB) beside tiercache and pytest, for the tests
# of tiercache's KV events against Dynamo's own consumer (tests/dynamo). Dynamo's packages are pinned in
# requirements/dynamo-1.6.1.txt and installed with --no-deps: nothing pulls torch or CUDA. tiercache goes in with its
# own (torch-free) dependencies.
# Idempotent. Usage: scripts/install_dynamo.sh   (building tiercache generates its protobuf stubs)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${DYNAMO_VENV:-.venv-dynamo}

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
stamp="$VENV/.installed-$(cat requirements/dynamo-1.6.1.txt pyproject.toml | sha1sum | cut -c1-12)"
if [ ! -e "$stamp" ]; then
    quiet() { { grep -v 'is ignored: it is neither a file nor a directory' || true; }; }
    # what another of this checkout's venvs already holds at a pinned version (typing-extensions, uvloop, ...) is
    # linked from there, unpacked and compiled, not installed again (scripts/seed_venv.py); pip installs the rest
    "$PYTHON" scripts/seed_venv.py "$VENV" -r requirements/dynamo-1.6.1.txt \
        || echo "seed_venv failed: pip installs every package"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps \
        -r requirements/dynamo-1.6.1.txt 2>&1 | quiet
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e . "pytest>=8" "pytest-timeout>=2.2" 2>&1 \
        | quiet
    touch "$stamp"
fi
"$VENV/bin/python" -c "import importlib.util as u; assert u.find_spec('torch') is None, 'torch in $VENV'"
"$VENV/bin/python" -c "import dynamo.llm, tiercache.client" 2>/dev/null \
    || { echo "the Dynamo environment in $VENV does not import; remove it and re-run" >&2; exit 1; }
