#!/usr/bin/env bash
# make test-wheel: what a user installs is what CI tests.
#  1. the checkout's files (tracked, or untracked and not ignored: never generated stubs) are copied aside and built:
#     the sdist, then the wheel from the sdist (python -m build), so both must be complete on their own;
#  2. the wheel goes, not editable, into a fresh venv with its declared dependencies only (tests/install: its
#     contents, `tiercache serve` from its console script with a client, and `make serve` from a fresh venv);
#  3. the wheel goes, --no-deps, into vLLM's CPU engine environment: a venv of the same interpreter whose
#     site-packages holds the wheel and then reaches the engine venv's site-packages through a .pth path line (so its
#     editable tiercache is never activated, and the engine venv is not changed), where a real-engine test runs from
#     a copy of tests/ outside the checkout (tests/vllm_engine/test_installed_wheel.py and the first of test_hits.py;
#     every engine reports where it loaded tiercache from, and the harness checks it is the wheel).
# Usage: scripts/test_wheel.sh   (VENV: the dev venv, with `build` and pytest; VLLM_CPU_VENV: vLLM's CPU engine venv)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=$(cd "${VENV:-.venv}" && pwd)
VLLM_CPU_VENV=$(cd "${VLLM_CPU_VENV:-.venv-vllm-cpu}" && pwd)
KEEP=${KEEP:-0}  # 1: leave the work directory for a look afterwards
say() { echo "test-wheel ($((SECONDS / 60))m$((SECONDS % 60))s): $*"; }
quiet() { { grep -v 'is ignored: it is neither a file nor a directory' || true; }; }

work=$(mktemp -d "${TMPDIR:-/tmp}/tiercache-wheel-XXXXXX")
if [ "$KEEP" = 1 ]; then trap 'echo "left $work"' EXIT; else trap 'rm -rf "$work"' EXIT; fi

say "copying the checkout's files (no generated stubs) to $work/src"
mkdir "$work/src"
git ls-files -z --cached --others --exclude-standard \
    | tar --null --ignore-failed-read -T - -cf - 2>/dev/null | tar -xf - -C "$work/src"

say "building the sdist, then the wheel from the sdist"
"$VENV/bin/python" -m build --outdir "$work/dist" "$work/src" >"$work/build.log" 2>&1 \
    || { tail -40 "$work/build.log"; exit 1; }
wheel=$(echo "$work"/dist/*.whl)
say "built $(cd "$work/dist" && echo *)"

say "installing the wheel into a fresh venv, with its declared dependencies only"
"$PYTHON" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q --disable-pip-version-check "$wheel" 2>&1 | quiet

say "installing the wheel (--no-deps) into vLLM's CPU engine environment ($VLLM_CPU_VENV)"
base=$("$VLLM_CPU_VENV/bin/python" -c 'import sys; print(sys._base_executable)')
engine_site=$("$VLLM_CPU_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
"$base" -m venv --without-pip "$work/vllm-env"
site=$("$work/vllm-env/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
echo "$engine_site" >"$site/engine-environment.pth"
# pip comes from the engine environment; --ignore-installed: a tiercache-llm there (editable) is not this one
"$work/vllm-env/bin/python" -m pip install -q --disable-pip-version-check --no-deps --ignore-installed "$wheel" \
    2>&1 | quiet

say "tests of the wheel, the fresh venv, and make serve"
TIERCACHE_WHEEL_DIR="$work" "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/install

say "a real-engine test with the installed wheel, from a copy of tests/ outside the checkout"
cp -r tests testkit pyproject.toml "$work/"
(cd "$work" && VLLM_TARGET_DEVICE=cpu TIERCACHE_WHEEL_SITE="$site" "$work/vllm-env/bin/python" -m pytest -q \
    -p no:cacheprovider tests/vllm_engine/test_installed_wheel.py \
    "tests/vllm_engine/test_hits.py::test_repeated_prompts_below_and_above_n_hit_like_vllm_in_a_fresh_engine[FOUR_LAYER]")
say "done"
