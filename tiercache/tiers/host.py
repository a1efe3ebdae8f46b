"""The host-memory tier: an ArenaTier over one anonymous mmap (page-locked for fast DMA when CUDA is present)."""

from __future__ import annotations

import logging
import mmap
from typing import Sequence

from tiercache.config import HostTierConfig
from tiercache.tiers.arena import ArenaTier

log = logging.getLogger(__name__)


class HostMemory:
    def __init__(self, size: int) -> None:
        self._arena = mmap.mmap(-1, max(size, mmap.PAGESIZE))
        self._view = memoryview(self._arena)
        self._pinned = _pin(self._arena)

    def write(self, ranges: Sequence[tuple[int, int]], record: memoryview) -> None:
        done = 0
        for offset, n in ranges:
            self._view[offset:offset + n] = record[done:done + n]
            done += n

    def read(self, ranges: Sequence[tuple[int, int]], size: int) -> bytearray:
        out = bytearray(size)
        done = 0
        for offset, n in ranges:
            out[done:done + n] = self._view[offset:offset + n]
            done += n
        return out

    def close(self) -> None:
        if self._pinned is not None:
            self._pinned()
        self._view.release()
        self._arena.close()


def _pin(arena: mmap.mmap):
    """Page-lock the arena with cudaHostRegister when torch sees a GPU, so device<->host copies are DMA at full
    speed; returns the matching unregister, or None. Skipped silently without CUDA (the usual case on CPU nodes)."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    import numpy as np

    pointer = np.frombuffer(arena, dtype=np.uint8).ctypes.data  # the temporary view is gone by the next line
    cudart = torch.cuda.cudart()
    if cudart.cudaHostRegister(pointer, len(arena), 0) != 0:
        log.warning("could not page-lock the host arena; device copies will go through bounce buffers")
        return None
    return lambda: cudart.cudaHostUnregister(pointer)


def host_tier(config: HostTierConfig) -> ArenaTier:
    memory = HostMemory(config.capacity_bytes // config.page_bytes * config.page_bytes)
    return ArenaTier("host", memory, config.capacity_bytes, config.page_bytes, config.state_budget_bytes,
                     config.state_value_weight)
