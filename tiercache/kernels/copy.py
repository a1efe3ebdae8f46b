"""Copy kernels between an engine's paged GPU buffers and contiguous chunks, with a torch reference for each.

One Python function per kernel family. CUDA tensors go to the CUDA kernels in `tiercache/kernels/native/*.cu`, compiled
once per process with CuPy (`RawModule` from the source text) on first use and launched by tiercache.kernels.launch;
CPU tensors go to the torch reference, which is also the test oracle. Inputs are checked here, at the boundary
(shapes, dtypes, strides, devices, index bounds), with a clear error: a launch never runs out of bounds. What the
checks learn (tiercache.kernels.geometry) is what a launch reads. Importing this module needs neither CUDA nor CuPy.

Shapes:
- paged KV, one tensor per layer: NHD [2, num_blocks, block_size, heads, head_dim] or HND
  [2, num_blocks, heads, block_size, head_dim] (any strides; all layers alike);
- chunk: [layers, 2, capacity, heads * head_dim], same dtype; tokens go to [token_offset, token_offset + n); on the
  layers' device, or in pinned host memory when the layers are on a GPU (the kernel then writes across PCIe directly,
  through the unified address space: no staging copy);
- slots: int64 [n], slot = block_id * block_size + position in block (`slots_for_blocks` builds them); on the
  data's device, or on the host for GPU data: then checked there and copied with the launch on the current stream,
  so a launch never waits for the GPU (slots on the GPU cost a synchronisation to check);
- state pools: per tensor [num_slots, ...] (any dtype); buffer: uint8 [n, record_bytes], a record being every
  tensor's slot bytes back to back, in order; each record contiguous, records possibly spaced further apart (a
  column of a wider matrix: an object whose bytes span several pool sets).
"""

from __future__ import annotations

from typing import Sequence

import torch

from tiercache.errors import InvalidArgument
from tiercache.kernels.geometry import PagedGeometry, StatePools
from tiercache.kernels.launch import copy_unit, launch_paged, launch_states, upload_pool_args


def slots_for_blocks(block_ids: Sequence[int] | torch.Tensor, block_size: int, start: int, count: int,
                     device=None) -> torch.Tensor:
    """Slots of tokens [start, start + count) of a sequence whose KV lives in `block_ids` (in order)."""
    blocks = torch.as_tensor(block_ids, dtype=torch.int64, device=device)
    positions = torch.arange(start, start + count, dtype=torch.int64, device=blocks.device)
    if count and positions[-1] // block_size >= len(blocks):
        raise InvalidArgument(f"tokens up to {start + count} need more than {len(blocks)} blocks of {block_size}")
    return blocks[positions // block_size] * block_size + positions % block_size


# -- paged KV ----------------------------------------------------------------------------------------------------

def gather_kv(layers: Sequence[torch.Tensor], slots: torch.Tensor, chunk: torch.Tensor, token_offset: int = 0,
              layout: str = "NHD") -> None:
    """chunk[l, kv, token_offset + i] = layers[l][kv] at slots[i], for every layer in one launch."""
    geometry = _check_paged(layers, slots, chunk, token_offset, layout)
    if layers[0].is_cuda:
        launch_paged("gather_kv", layers, slots, chunk, token_offset, geometry)
    else:
        gather_kv_reference(layers, slots, chunk, token_offset, layout)


def scatter_kv(layers: Sequence[torch.Tensor], slots: torch.Tensor, chunk: torch.Tensor, token_offset: int = 0,
               layout: str = "NHD") -> None:
    """The exact inverse of gather_kv: layers[l][kv] at slots[i] = chunk[l, kv, token_offset + i]."""
    geometry = _check_paged(layers, slots, chunk, token_offset, layout)
    if layers[0].is_cuda:
        launch_paged("scatter_kv", layers, slots, chunk, token_offset, geometry)
    else:
        scatter_kv_reference(layers, slots, chunk, token_offset, layout)


def _as_nhd(layer: torch.Tensor, layout: str) -> torch.Tensor:
    return layer if layout == "NHD" else layer.transpose(2, 3)


def gather_kv_reference(layers, slots, chunk, token_offset=0, layout="NHD") -> None:
    n = len(slots)
    for index, layer in enumerate(layers):
        nhd = _as_nhd(layer, layout)
        block_size = nhd.shape[2]
        rows = nhd[:, slots // block_size, slots % block_size]  # [2, n, heads, head_dim]
        chunk[index, :, token_offset:token_offset + n] = rows.reshape(2, n, -1)


def scatter_kv_reference(layers, slots, chunk, token_offset=0, layout="NHD") -> None:
    n = len(slots)
    for index, layer in enumerate(layers):
        nhd = _as_nhd(layer, layout)
        block_size, heads, head_dim = nhd.shape[2:]
        rows = chunk[index, :, token_offset:token_offset + n].reshape(2, n, heads, head_dim)
        nhd[:, slots // block_size, slots % block_size] = rows


def _check_paged(layers, slots, chunk, token_offset, layout) -> PagedGeometry:
    if layout not in ("NHD", "HND"):
        raise InvalidArgument(f"layout must be NHD or HND, got {layout!r}")
    if not layers:
        raise InvalidArgument("no layers given")
    first = layers[0]
    if first.dim() != 5 or first.shape[0] != 2:
        raise InvalidArgument(f"a paged layer must be [2, blocks, ...] with 5 dims, got {tuple(first.shape)}")
    for layer in layers:
        if layer.shape != first.shape or layer.dtype != first.dtype or layer.device != first.device \
                or layer.stride() != first.stride():
            raise InvalidArgument("all layers must share shape, dtype, device and strides")
    nhd = _as_nhd(first, layout)
    _, num_blocks, block_size, heads, head_dim = nhd.shape
    if nhd.stride(4) != 1:
        raise InvalidArgument("head_dim must be the innermost, contiguous dimension")
    if chunk.dim() != 4 or chunk.shape[0] != len(layers) or chunk.shape[1] != 2 \
            or chunk.shape[3] != heads * head_dim:
        raise InvalidArgument(f"chunk must be [{len(layers)}, 2, capacity, {heads * head_dim}], "
                              f"got {tuple(chunk.shape)}")
    if chunk.dtype != first.dtype or not _reachable(chunk, first.device) or not chunk.is_contiguous():
        raise InvalidArgument("chunk must be contiguous, with the layers' dtype, on their device (or pinned host "
                              "memory for GPU layers)")
    _check_slots(slots, num_blocks * block_size, first.device)
    if token_offset < 0 or token_offset + len(slots) > chunk.shape[2]:
        raise InvalidArgument(f"tokens [{token_offset}, {token_offset + len(slots)}) do not fit a chunk of "
                              f"{chunk.shape[2]}")
    size = first.element_size()
    strides = (nhd.stride(0) * size, nhd.stride(1) * size, nhd.stride(2) * size, nhd.stride(3) * size)
    return PagedGeometry(num_blocks, block_size, heads, head_dim, strides)


def _reachable(buffer: torch.Tensor, device: torch.device) -> bool:
    """Same device, or pinned host memory that a GPU kernel can address directly."""
    return buffer.device == device or (device.type == "cuda" and buffer.device.type == "cpu" and buffer.is_pinned())


def _records_contiguous(buffer: torch.Tensor) -> bool:
    """Each row's bytes one run, rows not overlapping (they may be spaced: a column of a wider matrix)."""
    return (buffer.shape[1] <= 1 or buffer.stride(1) == 1) and (len(buffer) <= 1 or buffer.stride(0) >= buffer.shape[1])


def _check_slots(slots: torch.Tensor, limit: int, device) -> None:
    if slots.dtype != torch.int64 or slots.dim() != 1 or slots.device not in (device, torch.device("cpu")):
        raise InvalidArgument("slots must be a 1-D int64 tensor on the data's device or on the host")
    if not len(slots):
        return
    if slots.is_cuda:
        low, high = (int(v) for v in torch.aminmax(slots))  # one reduction, one synchronisation
    else:  # a copy's few slots: one conversion, then plain Python (two tensor reductions cost more than the copy;
        # for GPU data, checking on the host is what spares the synchronisation)
        values = slots.tolist()
        low, high = min(values), max(values)
    if low < 0 or high >= limit:
        raise InvalidArgument(f"slots must lie in [0, {limit})")


# -- recurrent state -----------------------------------------------------------------------------------------------

def state_pools(pools: "Sequence[torch.Tensor] | StatePools") -> StatePools:
    """Check `pools` (same device and slot count, each slot contiguous) and prepare them for copies on any stream
    (on a GPU this waits once for their argument arrays' upload: call it at registration, not per step)."""
    return _prepared(pools, wait=True)


def _prepared(pools: "Sequence[torch.Tensor] | StatePools", wait: bool) -> StatePools:
    """`wait=False`: for one copy on the current stream (the upload is ordered before it on that stream)."""
    if isinstance(pools, StatePools):
        return pools
    if not pools:
        raise InvalidArgument("no state pools given")
    device, num_slots = pools[0].device, pools[0].shape[0]
    for pool in pools:
        if pool.device != device or pool.shape[0] != num_slots:
            raise InvalidArgument("state pools must share device and slot count")
        if not pool[0].is_contiguous():
            raise InvalidArgument("each slot of a state pool must be contiguous")
    _, sizes, offsets = zip(*_runs(pools))
    strides = tuple(pool.stride(0) * pool.element_size() for pool in pools)
    width = copy_unit(*sizes, *strides, *offsets, *(p.data_ptr() for p in pools))
    args = upload_pool_args(pools, strides, sizes, offsets, wait) if device.type == "cuda" else None
    return StatePools(tuple(pools), sizes, offsets, strides, sum(sizes), width, args)


def states_to_buffer(pools: "Sequence[torch.Tensor] | StatePools", slots: torch.Tensor, buffer: torch.Tensor) -> None:
    """buffer[i] = the bytes of every pool at slots[i], back to back."""
    prepared = _prepared(pools, wait=False)
    _check_state_copy(prepared, slots, buffer)
    if prepared.device.type == "cuda":
        launch_states("states_to_buffer", prepared, slots, buffer)
    else:
        _states_to_rows(_runs(prepared), slots.tolist(), buffer)


def states_from_buffer(pools: "Sequence[torch.Tensor] | StatePools", slots: torch.Tensor,
                       buffer: torch.Tensor) -> None:
    """The inverse: every pool at slots[i] = its part of buffer[i]."""
    prepared = _prepared(pools, wait=False)
    _check_state_copy(prepared, slots, buffer)
    if prepared.device.type == "cuda":
        launch_states("states_from_buffer", prepared, slots, buffer)
    else:
        _states_from_rows(_runs(prepared), slots.tolist(), buffer)


def state_record_bytes(pools: "Sequence[torch.Tensor] | StatePools") -> int:
    if isinstance(pools, StatePools):
        return pools.record_bytes
    return sum(pool[0].numel() * pool.element_size() for pool in pools)


def states_to_buffer_reference(pools, slots, buffer) -> None:
    _states_to_rows(_runs(pools), slots.tolist(), buffer)


def states_from_buffer_reference(pools, slots, buffer) -> None:
    _states_from_rows(_runs(pools), slots.tolist(), buffer)


def _runs(pools: "Sequence[torch.Tensor] | StatePools") -> list[tuple[torch.Tensor, int, int]]:
    """(pool, bytes per slot, offset in a record) for each pool."""
    if isinstance(pools, StatePools):
        return list(zip(pools.pools, pools.sizes, pools.offsets))
    runs, offset = [], 0
    for pool in pools:
        size = pool[0].numel() * pool.element_size()
        runs.append((pool, size, offset))
        offset += size
    return runs


def _states_to_rows(runs, rows: list[int], buffer: torch.Tensor) -> None:
    # A copy per row and pool, not `pool[slots]`: advanced indexing of byte pools goes element by element through a
    # temporary (~1 GB/s here), while a slot's bytes are one run that copy_ moves at memcpy speed: 7-15x faster for
    # the 1-4 rows a step saves, still ~5x at 64 rows (2-core x86; benchmarks/kernels.py --connector --device cpu).
    for pool, size, offset in runs:
        for index, slot in enumerate(rows):
            buffer[index, offset:offset + size].copy_(_row_bytes(pool, slot))


def _states_from_rows(runs, rows: list[int], buffer: torch.Tensor) -> None:
    for pool, size, offset in runs:
        for index, slot in enumerate(rows):
            _row_bytes(pool, slot).copy_(buffer[index, offset:offset + size])


def _row_bytes(pool: torch.Tensor, slot: int) -> torch.Tensor:
    """One slot of a state pool as a view of its bytes (a slot is contiguous: state_pools checked it)."""
    return pool[slot].reshape(-1).view(torch.uint8)


def _check_state_copy(prepared: StatePools, slots: torch.Tensor, buffer: torch.Tensor) -> None:
    if buffer.dtype != torch.uint8 or buffer.dim() != 2 or buffer.shape != (len(slots), prepared.record_bytes) \
            or not _reachable(buffer, prepared.device) or not _records_contiguous(buffer):
        raise InvalidArgument(f"buffer must be uint8 [{len(slots)}, {prepared.record_bytes}] with contiguous records "
                              f"on {prepared.device} (or pinned host memory)")
    _check_slots(slots, prepared.num_slots, prepared.device)
