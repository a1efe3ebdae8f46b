#!/usr/bin/env bash
# make bench-gpu: the GPU evidence in one call of under ~8 minutes, on a machine with an NVIDIA GPU whose python3
# holds a CUDA torch (used as it is, its version recorded: a CUDA torch is far too large to carry). In order, each
# step bounded so the next one runs: the GPU tests (`pytest -m gpu`: the kernels, the vLLM worker's transfers on CUDA
# paged caches, the GPU tier in a real server), python -m benchmarks.kernels --json, then benchmarks.hf_gpu (its largest
# case last, its JSON rewritten after every case). Everything lands in $OUT (default gpu-run/): environment.json,
# steps.json (each step's exit status), pytest-gpu.log, kernels.json, hf_gpu.json, hf_gpu.log.
# Wheels in .whl/ (scripts/gpu_wheels.sh, run where pip reaches PyPI) are installed into a temp folder first; the
# generated stubs (tiercache/_proto) travel with the tree.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-run}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "bench-gpu: $PY's torch sees no CUDA device; this target runs on a GPU machine (CI has none)" >&2
    exit 1
fi
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/tiercache-site \
        .whl/*.whl || { echo "bench-gpu: the carried wheels did not install" >&2; exit 1; }
    export PYTHONPATH="/tmp/tiercache-site:$PYTHONPATH"  # before the image's own site-packages
fi
ls tiercache/_proto/*_pb2.py >/dev/null 2>&1 || { echo "bench-gpu: no generated stubs in tiercache/_proto" >&2; exit 1; }
"$PY" - >"$OUT/environment.json" <<'PYEOF'
import json, platform, subprocess, time
import torch
info = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "python": platform.python_version(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "device": torch.cuda.get_device_name(),
        "commit": subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True).stdout.strip()}
for name in ("transformers", "cupy", "grpc", "google.protobuf"):
    try:
        info[name] = __import__(name, fromlist=["__version__"]).__version__
    except Exception as error:  # noqa: BLE001 - recorded, not fatal: the step that needs it says so
        info[name] = f"missing: {error}"
info["nvidia-smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True).stdout.strip()
print(json.dumps(info, indent=1))
PYEOF
declare -A steps
timeout 150 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/kernels tests/connector/vllm/test_loads_and_saves.py \
    tests/tiers tests/server/test_gpu_server.py >"$OUT/pytest-gpu.log" 2>&1
steps[pytest_gpu]=$?
tail -3 "$OUT/pytest-gpu.log"
timeout 90 "$PY" -m benchmarks.kernels --json >"$OUT/kernels.json" 2>"$OUT/kernels.err"
steps[kernels]=$?
timeout "${HF_GPU_TIMEOUT:-220}" "$PY" -m benchmarks.hf_gpu --json "$OUT/hf_gpu.json" 2>&1 | tee "$OUT/hf_gpu.log"
steps[hf_gpu]=${PIPESTATUS[0]}
printf '{"pytest_gpu": %s, "kernels": %s, "hf_gpu": %s}\n' "${steps[pytest_gpu]}" "${steps[kernels]}" \
    "${steps[hf_gpu]}" | tee "$OUT/steps.json"
