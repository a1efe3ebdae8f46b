"""The GPU tier: an ArenaTier over one preallocated device buffer, at the top of the hierarchy when --gpu-mem is set.

Host <-> device copies run on a dedicated CUDA stream (never the engine's compute stream) through page-locked
staging buffers, and are ordered with events: a put returns once its bytes are on the device, a get once they are
back in host memory. Staging buffers come from a small pool: taking one is bookkeeping, the copy runs without a lock.
Needs torch with CUDA (the `gpu` extra); importing this module does not.
"""

from __future__ import annotations

import queue
from typing import Sequence

from tiercache.config import GpuTierConfig
from tiercache.errors import ConfigError
from tiercache.tiers.arena import ArenaTier

STAGING_BYTES = 16 << 20
STAGING_BUFFERS = 4


class DeviceMemory:
    def __init__(self, size: int, device: str) -> None:
        import torch

        self._torch = torch
        self.device = torch.device(device)
        self.pool = torch.empty(max(size, 1), dtype=torch.uint8, device=self.device)
        self.stream = torch.cuda.Stream(self.device)
        self._staging: queue.Queue = queue.Queue()
        for _ in range(STAGING_BUFFERS):
            self._staging.put(torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=True))

    def write(self, ranges: Sequence[tuple[int, int]], record: memoryview) -> None:
        import numpy as np

        source = np.frombuffer(record, dtype=np.uint8)
        self._transfer(ranges, len(source), lambda staging, at, n: staging[:n].numpy().__setitem__(
            slice(None), source[at:at + n]), to_device=True)

    def read(self, ranges: Sequence[tuple[int, int]], size: int) -> bytearray:
        out = bytearray(size)
        view = memoryview(out)

        def take(staging, at: int, n: int) -> None:
            view[at:at + n] = staging[:n].numpy().data

        self._transfer(ranges, size, take, to_device=False)
        return out

    def _transfer(self, ranges, size: int, host_side, to_device: bool) -> None:
        """Move `size` bytes between host and the device `ranges`, one staging buffer's worth at a time."""
        torch = self._torch
        staging = self._staging.get()
        try:
            pieces = list(_pieces(ranges, STAGING_BYTES))
            for at, parts, n in pieces:
                if to_device:
                    host_side(staging, at, n)
                with torch.cuda.stream(self.stream):
                    done = 0
                    for offset, length in parts:
                        device_part = self.pool[offset:offset + length]
                        if to_device:
                            device_part.copy_(staging[done:done + length], non_blocking=True)
                        else:
                            staging[done:done + length].copy_(device_part, non_blocking=True)
                        done += length
                    event = torch.cuda.Event()
                    event.record(self.stream)
                event.synchronize()  # the staging buffer is reused by the next piece
                if not to_device:
                    host_side(staging, at, n)
        finally:
            self._staging.put(staging)

    def views(self, ranges: Sequence[tuple[int, int]]) -> list[memoryview]:
        raise NotImplementedError("device memory has no host views; the same-host path uses the host tier")

    def close(self) -> None:
        self.stream.synchronize()
        self.pool = None


def _pieces(ranges: Sequence[tuple[int, int]], limit: int):
    """Split device ranges into groups of at most `limit` bytes: (record offset, [(device offset, n)], bytes)."""
    group, group_bytes, at = [], 0, 0
    for offset, length in ranges:
        while length:
            n = min(length, limit - group_bytes)
            group.append((offset, n))
            group_bytes += n
            offset += n
            length -= n
            if group_bytes == limit:
                yield at, group, group_bytes
                at += group_bytes
                group, group_bytes = [], 0
    if group:
        yield at, group, group_bytes


# What to do about a missing or CPU-only torch: the gpu extra brings torch with CUDA (PyPI's Linux build), the -gpu
# image is built with it. (The hf extra, which this once named, brings whatever torch the index serves: a CPU build
# where a CPU index is configured, and it pins the version.)
_GET_CUDA_TORCH = ("install tiercache-llm's gpu extra, which brings torch with CUDA (from a checkout: pip install "
                   "'.[gpu]'), or use the -gpu image (docker build --build-arg EXTRAS=gpu)")


def gpu_tier(config: GpuTierConfig) -> ArenaTier:
    try:
        import torch
    except ImportError:
        raise ConfigError(f"the GPU tier (--gpu-mem) needs torch with CUDA, and torch is not installed: "
                          f"{_GET_CUDA_TORCH}") from None
    if torch.version.cuda is None:
        raise ConfigError(f"the GPU tier (--gpu-mem) needs torch with CUDA, and this torch ({torch.__version__}) is "
                          f"built without it: {_GET_CUDA_TORCH}")
    if not torch.cuda.is_available():
        raise ConfigError("the GPU tier (--gpu-mem) needs a CUDA device, and torch sees none (is the NVIDIA driver "
                          "loaded and the device visible to this process: CUDA_VISIBLE_DEVICES, the container "
                          "runtime's --gpus?)")
    memory = DeviceMemory(config.capacity_bytes // config.page_bytes * config.page_bytes, config.device)
    return ArenaTier("gpu", memory, config.capacity_bytes, config.page_bytes, config.state_budget_bytes,
                     config.state_value_weight)
