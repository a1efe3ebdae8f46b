"""What the test kit changes in every Python process that has this folder on PYTHONPATH (vLLM's engine processes
included), each only when its variable asks for it:

`TIERCACHE_TEST_CPU` (avx2, avx512, avx512_bf16 or amx: tiercache.prefix.cpu_features LEVELS): a CPU of another kind
stood in for vLLM's CPU build. vLLM decides by asking torch (`torch.cpu._is_avx512_supported`,
`_is_avx512_bf16_supported`, `_is_amx_tile_supported`, read in vllm/platforms/cpu.py, the CPU attention backend and
the GDN ops): those answer for the level named, so vLLM takes that CPU's branches: its state dtype, N, attention
kernel and kernel library (`vllm._C_AVX2` for avx2). torch's and oneDNN's own kernels are held to the same level
(ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA), set before torch loads. A level can only be stood in below the machine's
own: a kernel the CPU lacks would not run.

`TIERCACHE_FIX_COPY_ON_WRITE=1`: vLLM 0.32's copy of a partially hit hybrid block fixed (testkit.copy_on_write) as soon
as vLLM's model runner module loads, in a served engine (`python -m vllm.entrypoints.openai.api_server`, whose
processes the lab cannot patch otherwise). Each process that applies it says so on stderr (the lab's reports check the
engine logs for that line).

`TIERCACHE_HIT_CAP=1`: a request may hold vLLM's own prefix hit to a length it names (testkit.hit_cap): the reference
engine of the lab's exact replay. Said on stderr as well.

`TIERCACHE_PLANT_FAULT=KIND` with `TIERCACHE_PLANT_ONE_IN=K` and `TIERCACHE_PLANTED_LOG=PATH`: the fault KIND
(testkit.connector_faults) planted in tiercache's connector, in the loads of the requests whose prompt's digest falls
in one in K; each load it went into is written to PATH (the lab's exact replay must flag exactly those).

`TIERCACHE_OFFLOAD_WORKER=1`: vLLM's CPU offloading worker stood in on its CPU build (testkit.offload_worker), once
vLLM's CPU offloading spec has loaded: the lab's arms with vLLM's own offloading. Said on stderr as well.
"""

from __future__ import annotations

import importlib.abc
import os
import sys

LEVEL = os.environ.get("TIERCACHE_TEST_CPU", "")
_LEVELS = ("avx2", "avx512", "avx512_bf16", "amx")
# The level from which torch's checks answer yes (below it: no; at or above it: what the CPU says, which must be yes
# for the level's own features: a level above the machine's is refused), and the kernels torch and oneDNN are held to.
_ANSWERS = {"_is_avx512_supported": 1, "_is_avx512_vnni_supported": 2, "_is_avx512_bf16_supported": 2,
            "_is_amx_tile_supported": 3, "_is_amx_fp16_supported": 3}
_REQUIRED = ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_amx_tile_supported")
_ATEN = {"avx2": "avx2", "avx512": "avx512", "avx512_bf16": "avx512", "amx": "avx512"}
_ONEDNN = {"avx2": "AVX2", "avx512": "AVX512_CORE", "avx512_bf16": "AVX512_CORE_BF16", "amx": "AVX512_CORE_AMX"}


def _stand_in(cpu_module) -> None:
    rank = _LEVELS.index(LEVEL)
    lacking = [name for name, needed in _ANSWERS.items() if name in _REQUIRED and rank >= needed
               and not getattr(cpu_module, name)()]
    if lacking:
        raise SystemExit(f"TIERCACHE_TEST_CPU={LEVEL}: this CPU has no {', '.join(lacking)}; a CPU can only be stood "
                         f"in below the machine's own (its kernels would not run)")
    for name, needed in _ANSWERS.items():
        if hasattr(cpu_module, name) and rank < needed:
            setattr(cpu_module, name, lambda: False)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls `then(module)` right after module `name`'s own code ran (a process that never imports it pays nothing)."""

    def __init__(self, name: str, then) -> None:
        self._name = name
        self._then = then
        self._busy = False

    def find_spec(self, name, path, target=None):
        if name != self._name or self._busy:
            return None
        self._busy = True
        try:
            import importlib.util
            spec = importlib.util.find_spec(name)
        finally:
            self._busy = False
        if spec is None or spec.loader is None:
            return None
        original = spec.loader.exec_module

        def exec_module(module):
            original(module)
            self._then(module)

        spec.loader.exec_module = exec_module
        return spec


def _fix_copy_on_write(runner_module) -> None:
    """vLLM's model runner module has run (it imports the helper the fix replaces, and binds it by name)."""
    from testkit.copy_on_write import FIXED_LINE, fix_hybrid_copy_on_write

    fix_hybrid_copy_on_write()
    print(FIXED_LINE, file=sys.stderr, flush=True)


def _on_path() -> None:
    """The folder that holds testkit on the path, after the installed packages."""
    from pathlib import Path

    folder = str(Path(__file__).resolve().parents[2])
    if folder not in sys.path:
        sys.path.append(folder)


if os.environ.get("TIERCACHE_FIX_COPY_ON_WRITE") == "1":
    _on_path()
    sys.meta_path.insert(0, _AfterImport("vllm.v1.worker.gpu_model_runner", _fix_copy_on_write))

def _cap_hits(manager_module) -> None:
    from testkit.hit_cap import CAPPED_LINE, cap_prefix_hits

    cap_prefix_hits()
    print(CAPPED_LINE, file=sys.stderr, flush=True)


def _plant_faults(connector_module) -> None:
    from testkit.connector_faults import PLANTED_LINE, HashedFaults

    HashedFaults(os.environ["TIERCACHE_PLANT_FAULT"], int(os.environ.get("TIERCACHE_PLANT_ONE_IN", "1")),
                 os.environ["TIERCACHE_PLANTED_LOG"]).install()
    print(PLANTED_LINE, file=sys.stderr, flush=True)


def _stand_in_offload_worker(spec_module) -> None:
    from testkit.offload_worker import STOOD_IN_LINE, install

    install()
    print(STOOD_IN_LINE, file=sys.stderr, flush=True)


if os.environ.get("TIERCACHE_HIT_CAP") == "1":
    _on_path()
    sys.meta_path.insert(0, _AfterImport("vllm.v1.core.kv_cache_manager", _cap_hits))
if os.environ.get("TIERCACHE_PLANT_FAULT"):
    _on_path()
    sys.meta_path.insert(0, _AfterImport("tiercache.connector.vllm.connector", _plant_faults))
if os.environ.get("TIERCACHE_OFFLOAD_WORKER") == "1":
    _on_path()
    sys.meta_path.insert(0, _AfterImport("vllm.v1.kv_offload.cpu.spec", _stand_in_offload_worker))

if LEVEL:
    if LEVEL not in _LEVELS:
        raise SystemExit(f"TIERCACHE_TEST_CPU={LEVEL!r}: one of {', '.join(_LEVELS)}")
    # set, not defaulted: an engine stood in lower than the suite inherits the suite's values
    os.environ["ATEN_CPU_CAPABILITY"] = _ATEN[LEVEL]
    os.environ["ONEDNN_MAX_CPU_ISA"] = _ONEDNN[LEVEL]
    sys.meta_path.insert(0, _AfterImport("torch.cpu", _stand_in))
