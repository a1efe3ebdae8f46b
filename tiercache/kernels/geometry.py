"""What the copy kernels' boundary checks (tiercache.kernels.copy) learn about the tensors of a copy: the geometry of
a list of paged layer caches, and a set of state pools prepared once. The CUDA launches (tiercache.kernels.launch)
and the torch references both read them. Importing this module needs neither CUDA nor CuPy."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PagedGeometry:
    """What the checks learned about a list of paged layer caches."""

    num_blocks: int
    block_size: int
    heads: int
    head_dim: int
    strides_bytes: tuple[int, int, int, int]  # kv, block, position, head


@dataclass(frozen=True, eq=False)
class StatePools:
    """A set of state pools, checked once, with what every copy of them needs: their geometry and, on a GPU, the
    kernel's argument arrays. An engine's pools never move, so a connector prepares them at registration
    (`state_pools`) and each step's copy skips the per-pool checks and uploads (~0.3 ms of Python and four small
    host-to-device copies per launch for a 36-layer model: time vLLM's thread would spend in every step's save)."""

    pools: tuple[torch.Tensor, ...]
    sizes: tuple[int, ...]  # each pool's bytes per slot
    offsets: tuple[int, ...]  # where each pool's bytes start in a record
    strides: tuple[int, ...]  # bytes from one slot to the next, per pool
    record_bytes: int
    width: int  # the widest copy unit dividing every pool's address, stride, size and offset
    device_args: tuple | None  # on a GPU: the kernel's pool arrays (addresses, strides, sizes, offsets), uploaded

    @property
    def device(self) -> torch.device:
        return self.pools[0].device

    @property
    def num_slots(self) -> int:
        return self.pools[0].shape[0]
