"""vLLM's KV offloading worker (`CPUOffloadingWorker`, the copies between the engine's KV cache and its CPU pool) run
on vLLM's CPU platform, where vLLM refuses it. Everything else of vLLM's offloading is CPU code and runs as shipped:
the scheduler side, the tiering manager, the shared pool (an mmap in /dev/shm), the secondary tiers, the worker's
layout code and its copy plans. Only the four CUDA-only points are stood in:

1. `CPUOffloadingSpec.get_worker` refuses any platform but CUDA and XPU: here it makes the worker as it would there;
2. `SingleDirectionOffloadingHandler.__init__` asserts the engine's KV tensors are on a CUDA or XPU device: the
   assertion sees the CPU tensors as a device's (a view whose `is_cuda` is true, for that call only);
3. `ops.swap_blocks_batch`, a CUDA kernel that copies `sizes[i]` bytes from `src[i]` to `dst[i]` (raw addresses in
   vLLM's own descriptor arrays): a memmove per descriptor;
4. the stream's events (`torch.Event`): synchronous, done when recorded (the copy above is done by then), or with
   `complete_after` > 0 done only after that many polls, so a job completes some engine steps after it was issued.

`install()` before the engine starts (in the engine's process). tests/vllm_engine/test_offload_tier.py runs vLLM's
`TieringOffloadingSpec` with this; the copies are exact (memmove), so every byte the engine reads back is the byte it
wrote, as with the CUDA kernel. A served engine (the lab's offloading arms) gets it from testkit/site
(`TIERCACHE_OFFLOAD_WORKER=1`), and its log then shows STOOD_IN_LINE.
"""

from __future__ import annotations

import ctypes
import functools

STOOD_IN_LINE = "testkit: vLLM's CPU offloading worker stood in (testkit.offload_worker)"  # what such a process logs
_installed: list[int] = []


class _Event:
    """torch.Event as the worker uses it: record, query, synchronize, elapsed_time (ms), wait."""

    complete_after = 0

    def __init__(self, *args, **kwargs) -> None:
        self._polls = 0
        self._done = self.complete_after <= 0

    def record(self, stream=None) -> None:
        self._polls = 0
        self._done = self.complete_after <= 0

    def query(self) -> bool:
        self._polls += 1
        self._done = self._done or self._polls > self.complete_after
        return self._done

    def synchronize(self) -> None:
        self._done = True

    def wait(self, stream=None) -> None:
        pass

    def elapsed_time(self, other) -> float:
        return 0.0


def _memmove_batch(src_ptrs, dst_ptrs, sizes, is_src_access_order_any: bool = False) -> None:
    for src, dst, size in zip(src_ptrs.tolist(), dst_ptrs.tolist(), sizes.tolist()):
        ctypes.memmove(dst, src, size)


def install(complete_after: int = 0) -> None:
    """Stand the four points in (once per process). `complete_after`: polls before a transfer reports done."""
    _Event.complete_after = complete_after
    if _installed:
        return
    _installed.append(1)
    import torch

    import vllm._custom_ops as ops
    import vllm.v1.kv_offload.cpu.gpu_worker as gpu_worker
    import vllm.v1.worker.cpu.shm  # noqa: F401 - it sets its own torch.Event placeholder when imported: go after it
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    def get_worker(self, kv_caches):  # 1
        if not self._worker:
            self._worker = self.create_worker(kv_caches)
        return self._worker

    CPUOffloadingSpec.get_worker = get_worker

    handler = gpu_worker.SingleDirectionOffloadingHandler
    original_init = handler.__init__
    device_view = _device_view_class()

    @functools.wraps(original_init)
    def init(self, gpu_tensors, cpu_tensors, *args, **kwargs):  # 2
        original_init(self, [t.as_subclass(device_view) for t in gpu_tensors], cpu_tensors, *args, **kwargs)
        if self.gpu_to_cpu:  # the handler keeps the engine's tensors themselves, as on a device
            self.src_tensors = list(gpu_tensors)
        else:
            self.dst_tensors = list(gpu_tensors)

    handler.__init__ = init
    ops.swap_blocks_batch = _memmove_batch  # 3
    gpu_worker.ops.swap_blocks_batch = _memmove_batch
    torch.Event = _Event  # 4
    torch.cuda.Event = _Event


def _device_view_class():
    import torch

    class DeviceView(torch.Tensor):
        """A CPU tensor that answers is_cuda: only while the handler's constructor checks it."""

        @property
        def is_cuda(self) -> bool:
            return True

    return DeviceView

