#!/usr/bin/env bash
# Installs everything tiercache needs to run and be tested, on a fresh Debian/Ubuntu machine:
# a virtual environment with the package and its dev extras, the generated protobuf stubs, and redis-server.
# Idempotent: re-running skips what is already there. Usage: scripts/install.sh [extras]   (default: dev,hf)
# The container image (Dockerfile) runs this same script with INSTALL_REDIS=0, VENV=/opt/tiercache/venv and the
# extras it needs (proto, or proto,gpu), so CI exercises the image's install steps too.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
EXTRAS=${1:-dev,hf}
INSTALL_REDIS=${INSTALL_REDIS:-1}

if [ "$INSTALL_REDIS" = 1 ] && ! command -v redis-server >/dev/null 2>&1; then
    echo "installing redis-server (the tests start their own on free ports)"
    if [ "$(id -u)" = 0 ]; then SUDO=""; elif command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
        echo "redis-server is missing and this user cannot install it: apt-get install redis-server" >&2; exit 1
    fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
fi

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
stamp="$VENV/.installed-$EXTRAS-$(sha1sum pyproject.toml | cut -c1-12)"
if [ ! -e "$stamp" ]; then
    # (the filter hides pip's notes about this machine's optional local package mirrors)
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[$EXTRAS]" 2>&1 \
        | { grep -v 'is ignored: it is neither a file nor a directory' || true; }
    touch "$stamp"
fi

# The one command that generates the protobuf stubs (never edit them by hand).
"$VENV/bin/python" -m grpc_tools.protoc -Itiercache/_proto=proto --python_out=. --grpc_python_out=. \
    proto/tiercache.proto
