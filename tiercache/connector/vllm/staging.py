"""Host staging buffers for the vLLM worker's loads and saves, allocated once and reused.

A save's bytes wait in host memory from the step that gathered them until its put is done; a load's bytes wait there
from the fetch until they are copied into vLLM's blocks. For a CUDA cache these buffers are page-locked (the copy
kernels write into and read from them directly, across PCIe), and page-locking is slow (cudaHostAlloc: ~1 ms per
MiB, and it serializes with the GPU's work), so buffers are kept and handed out again rather than made per object.
For a CPU cache they are plain host memory, kept for the same reason at a smaller scale (no page faults per save).
Loads and saves each stage through a `StagingLane` of their own: a pool, the thread that does the direction's
background work, and on CUDA the stream its copies go on (`staging_lane`, made when vLLM registers its caches).

Buffers come in power-of-two size classes from 1 MiB; a request larger than any kept buffer makes a new one. The
pool holds at most `limit_bytes` in buffers handed out: past it, `take` returns None and the caller drops the save
(a cache may forget, an engine must not stall) or fetches into new memory. A buffer in use is cut into objects'
rows (ObjectRows).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, NamedTuple

import torch

MIN_CLASS_BYTES = 1 << 20


class StagingPool:
    def __init__(self, limit_bytes: int, pinned: bool) -> None:
        self.limit_bytes = limit_bytes
        self.pinned = pinned
        self._lock = threading.Lock()
        self._free: dict[int, list[torch.Tensor]] = {}
        self._out_bytes = 0  # capacity of the buffers handed out and not given back

    def take(self, size: int) -> torch.Tensor | None:
        """A uint8 buffer of at least `size` bytes, or None when the buffers out already hold `limit_bytes`."""
        capacity = size_class(size)
        with self._lock:
            if self._out_bytes + capacity > self.limit_bytes:
                return None
            self._out_bytes += capacity
            kept = self._free.get(capacity)
            if kept:
                return kept.pop()
        try:
            return torch.empty(capacity, dtype=torch.uint8, pin_memory=self.pinned)
        except BaseException:
            with self._lock:
                self._out_bytes -= capacity
            raise

    def give_back(self, buffer: torch.Tensor) -> None:
        with self._lock:
            self._out_bytes -= buffer.numel()
            self._free.setdefault(buffer.numel(), []).append(buffer)

    @property
    def kept(self) -> int:
        """Buffers kept for reuse now."""
        with self._lock:
            return sum(len(buffers) for buffers in self._free.values())

    @property
    def out_bytes(self) -> int:
        with self._lock:
            return self._out_bytes


def size_class(size: int) -> int:
    return max(MIN_CLASS_BYTES, 1 << max(size - 1, 0).bit_length())


class StagingLane(NamedTuple):
    """What one direction of the worker's transfers (loads, saves) copies through."""

    pool: StagingPool
    thread: ThreadPoolExecutor  # the direction's background work: fetches (loads), gathers (saves on CPU)
    stream: torch.cuda.Stream | None  # CUDA: the stream its copies go on; None on CPU


def staging_lane(device: torch.device, limit_bytes: int, thread_name: str,
                 on_thread_start: Callable[[], None]) -> StagingLane:
    """A lane for caches on `device`: page-locked buffers and a stream of its own on CUDA, and one thread started by
    `on_thread_start` (off vLLM's compute cores: connector.vllm.cores)."""
    cuda = device.type == "cuda"
    return StagingLane(StagingPool(limit_bytes, pinned=cuda),
                       ThreadPoolExecutor(1, thread_name_prefix=thread_name, initializer=on_thread_start),
                       torch.cuda.Stream(device) if cuda else None)


class ObjectRows:
    """A staging buffer cut into objects' bytes, back to back in the order given. Objects of one kind (same size,
    same pools) that are consecutive form a [count, size] matrix the row copies take in one call."""

    def __init__(self, buffer: torch.Tensor, sizes: list[int]) -> None:
        self.buffer = buffer
        self.sizes = sizes
        self.offsets = [0]
        for size in sizes:
            self.offsets.append(self.offsets[-1] + size)
        self.total = self.offsets[-1]

    def buffers(self) -> list[memoryview]:
        """Each object's bytes as a writable view (what the client fetches into, and puts from)."""
        whole = memoryview(self.buffer.numpy()).cast("B")
        return [whole[self.offsets[i]:self.offsets[i + 1]] for i in range(len(self.sizes))]

    def part(self, indices: list[int]) -> torch.Tensor:
        """The rows of objects `indices` (consecutive, of one size) as one [count, size] tensor."""
        first, size = indices[0], self.sizes[indices[0]]
        return self.buffer[self.offsets[first]:self.offsets[first] + size * len(indices)].view(len(indices), size)


class _CopiedOnHost:
    """What a finished host-side copy looks like beside a CUDA copy's event: an event that has already completed."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


COPIED = _CopiedOnHost()
