"""The CUDA launches of the copy kernels: each family's source (`native/*.cu`) compiled once per process with CuPy
on first use, and launched on torch's current stream of the data's device with arguments the boundary checked
(tiercache.kernels.copy). CuPy is imported only when a launch or an upload runs: importing this module needs neither
CUDA nor CuPy."""

from __future__ import annotations

import functools
from importlib import resources
from typing import Sequence

import torch

from tiercache.kernels.geometry import PagedGeometry, StatePools

_WIDTHS = (16, 8, 4, 2, 1)


@functools.cache
def _module(family: str):
    import cupy

    source = resources.files("tiercache.kernels.native").joinpath(f"{family}.cu").read_text()
    return cupy.RawModule(code=source, options=("--std=c++17",))


def copy_unit(*values: int) -> int:
    """The widest copy unit dividing every address, stride and size: 16-byte vector loads when alignment allows."""
    return next(w for w in _WIDTHS if all(v % w == 0 for v in values))


def _launch(family: str, kernel: str, grid: tuple[int, int], threads: int, make_args, device: torch.device) -> None:
    """Launch on torch's current stream of `device`. Arguments are built inside the stream context, so the small
    index arrays CuPy allocates for them are ordered with the kernel that reads them."""
    import cupy

    with cupy.cuda.Device(device.index or 0):
        stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream)
        with stream:
            _module(family).get_function(kernel)(grid, (threads,), make_args())


def _slots_on(slots: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Slots where the kernel reads them: host slots are copied through pinned memory on the current stream, without
    waiting (torch's host allocator keeps the pinned copy until the copy has run; the device copy is stream-ordered)."""
    if slots.device == device:
        return slots
    return slots.pin_memory().to(device, non_blocking=True)


def _addresses(tensors: Sequence[torch.Tensor]):
    import cupy

    return cupy.asarray([t.data_ptr() for t in tensors], dtype=cupy.int64)


def _pointer(tensor: torch.Tensor):
    """A raw address as a kernel argument: works for device memory and for pinned host memory alike (UVA)."""
    import numpy as np

    return np.uint64(tensor.data_ptr())


def launch_paged(name, layers, slots, chunk, token_offset, g: PagedGeometry) -> None:
    import numpy as np

    head_bytes = g.head_dim * chunk.element_size()
    slots = _slots_on(slots, layers[0].device)
    width = copy_unit(head_bytes, *g.strides_bytes, chunk.data_ptr(), *(t.data_ptr() for t in layers))
    units = 2 * g.heads * head_bytes // width

    def make_args() -> tuple:
        return (_addresses(layers), _pointer(chunk), _pointer(slots), np.int32(g.heads), np.int32(head_bytes),
                *(np.int64(s) for s in g.strides_bytes), np.int32(g.block_size), np.int32(chunk.shape[2]),
                np.int32(token_offset))

    if len(slots):
        _launch("paged_kv", f"{name}_w{width}", (len(slots), len(layers)), min(256, max(32, units)), make_args,
                layers[0].device)


def upload_pool_args(pools, strides, sizes, offsets, wait: bool) -> tuple:
    """The state kernel's pool arrays on the pools' device, uploaded on the current stream; `wait`: which is then
    waited for, so that copies on any stream may read them."""
    import cupy

    device = pools[0].device
    with cupy.cuda.Device(device.index if device.index is not None else torch.cuda.current_device()):
        stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream)
        with stream:
            args = (_addresses(pools), cupy.asarray(strides, dtype=cupy.int64), cupy.asarray(sizes, dtype=cupy.int64),
                    cupy.asarray(offsets, dtype=cupy.int64))
        if wait:
            stream.synchronize()
    return args


def launch_states(name: str, prepared: StatePools, slots, buffer) -> None:
    import numpy as np

    pitch = buffer.stride(0) if len(buffer) > 1 else buffer.shape[1]  # bytes from one record to the next
    width = copy_unit(pitch, buffer.data_ptr(), prepared.width)
    slots = _slots_on(slots, prepared.device)

    def make_args() -> tuple:
        return (*prepared.device_args, _pointer(buffer), _pointer(slots), np.int64(pitch))

    if len(slots):
        _launch("state_copy", f"{name}_w{width}", (len(slots), len(prepared.pools)), 256, make_args, prepared.device)
