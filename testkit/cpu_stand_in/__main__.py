"""One line for CI's log: the CPU vLLM's CPU build will see here (this machine's, or the stand-in the suite runs
under) and the N tiercache predicts for each engine-test model on it; `.ci/run` prints it before the suites, and the
Ns the engines chose after them (tests/vllm_engine/test_block_size.py)."""

from __future__ import annotations

from testkit.cpu_stand_in import engine_cpu
from testkit.vllm_models import FOUR_LAYER, SIX_LAYER
from tiercache.prefix.cpu_features import cpuinfo_flags

_FLAGS = ("avx2", "avx512f", "avx512vl", "avx512bw", "avx512dq", "avx512_bf16", "amx_tile")


def machine_flags() -> str:
    held = cpuinfo_flags()
    if not held:
        return "no /proc/cpuinfo flags"
    return " ".join(f if f in held else f"-{f}" for f in _FLAGS)


if __name__ == "__main__":
    cpu = engine_cpu()
    ns = ", ".join(f"{m.name} N={m.sizing().block_tokens}" for m in (FOUR_LAYER, SIX_LAYER))
    print(f"engine CPU: {cpu.rule()} | this machine's flags: {machine_flags()} | predicted: {ns}")
