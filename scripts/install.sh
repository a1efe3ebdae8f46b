#!/usr/bin/env bash
# Installs what tiercache needs on a fresh Debian/Ubuntu machine: a virtual environment with the package (editable)
# and the extras asked for, and redis-server for the tests. Building the package generates the protobuf stubs from
# proto/tiercache.proto (setup.py), so a change to the proto, setup.py or pyproject.toml re-installs.
# Idempotent: re-running skips what is already there.
# Usage: scripts/install.sh [EXTRAS]
#   default dev,hf (make install, make test): torch (CPU), transformers, the test tools and linters;
#   ''             (make serve): the package alone, all that `tiercache serve` needs; no redis-server either.
# The container image (Dockerfile) runs this same script with INSTALL_REDIS=0, VENV=/opt/tiercache/venv and its
# extras ('' or gpu), so CI exercises the image's install steps too.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
EXTRAS=${1-dev,hf}
INSTALL_REDIS=${INSTALL_REDIS:-1}
say() { echo "tiercache install: $*"; }
# (the filter hides pip's notes about this machine's optional local package mirrors)
pip_quiet() {
    "$VENV/bin/python" -m pip -q --disable-pip-version-check "$@" 2>&1 \
        | { grep -v 'is ignored: it is neither a file nor a directory' || true; }
}

if [ "$INSTALL_REDIS" = 1 ] && ! command -v redis-server >/dev/null 2>&1; then
    say "installing redis-server with apt-get (the tests start their own on free ports)"
    if [ "$(id -u)" = 0 ]; then SUDO=""; elif command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
        echo "redis-server is missing and this user cannot install it: apt-get install redis-server" >&2; exit 1
    fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
fi

if [ ! -x "$VENV/bin/python" ]; then
    say "creating the virtual environment $VENV"
    "$PYTHON" -m venv "$VENV"
fi

sources=$(cat pyproject.toml setup.py proto/tiercache.proto | sha1sum | cut -c1-12)
stamp="$VENV/.installed-${EXTRAS:-none}-$sources"
installed() {
    [ -e tiercache/_proto/tiercache_pb2.py ] && [ -e tiercache/_proto/tiercache_pb2_grpc.py ] || return 1
    [ -e "$stamp" ] && return 0
    # Every set of extras comes with the package and its dependencies: after `make install`, `make serve` has all.
    [ -z "$EXTRAS" ] && compgen -G "$VENV/.installed-*-$sources" >/dev/null
}
if ! installed; then
    # Checkouts before issue 24 installed this package as "tiercache", PyPI's name for an unrelated project.
    if "$VENV/bin/python" -m pip show -q tiercache >/dev/null 2>&1; then
        say "removing the distribution 'tiercache' from $VENV (this package is now named tiercache-llm)"
        pip_quiet uninstall -y tiercache
    fi
    if [ -z "$EXTRAS" ]; then
        say "installing tiercache and what \`tiercache serve\` needs into $VENV" \
            "(grpcio, protobuf, numpy, redis-py, ...: about 140 MB, under a minute)"
    else
        say "installing tiercache with the extras [$EXTRAS] into $VENV" \
            "(dev,hf: torch for the CPU, transformers, test tools and linters: about 1.7 GB, a few minutes)"
    fi
    say "building it generates the protobuf stubs in tiercache/_proto from proto/tiercache.proto"
    pip_quiet install -e ".${EXTRAS:+[$EXTRAS]}"
    touch "$stamp"
fi
