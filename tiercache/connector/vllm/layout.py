"""How vLLM's paged KV cache maps onto tiercache objects (the vLLM connector's geometry; no I/O).

vLLM (0.33) groups layers into KV cache groups, each with its own block table: full-attention groups and, for hybrid
models, Mamba groups (Gated DeltaNet, Mamba2) in "align" mode. All groups share one block size B, which is our chunk
size N: one `kv` object is one attention block of one group, for all its layers. All Mamba groups together make our
one recurrent group, so one `state` object holds every recurrent layer (group by group, layer by layer).

Per-layer tensors (`register_kv_caches`) are views of one backing buffer, each [blocks, heads, B, C]:
- attention: how a block's bytes are ordered inside is the attention backend's business, and backends differ: the
  CPU backend keeps the block's keys tiled across tokens and its values row by row, flash-attention keeps K|V per
  token. So tiercache moves attention KV as whole pages — every layer's bytes of one vLLM block — exactly what vLLM's
  own copy-on-write of a partially filled block does. A `kv` object is the page of a full block; a `tail` at p is the
  page of the block holding p, of which only tokens [N*floor(p/N), p) are meaningful (the engine writes the tokens
  from p on before it reads them, and never reads beyond the sequence). Reading a page per token, as an earlier
  version did, restored the wrong bytes for tails on the CPU backend;
- Mamba: [blocks, 1, 1, state bytes] int8; slot b holds the layer's state tensors (conv, then SSM) back to back.
In align mode the state after p tokens lives in the Mamba block at index (p-1) // B of the request's block table.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from tiercache import kernels
from tiercache.connector.vllm.preflight import SPECULATIVE_REFUSAL, mamba_mode_refusal
from tiercache.errors import InvalidArgument
from tiercache.prefix.layout import GroupKind, LayerGroup, ModelLayout, StateTensor, dtype_name
from tiercache.prefix.objects import ObjectKind

_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")


@dataclass(frozen=True)
class EngineGroups:
    """vLLM's KV cache groups, in the order tiercache's layout uses them."""

    block_size: int
    attention: tuple[int, ...]  # vLLM group ids of full-attention groups; our layout group i is attention[i]
    mamba: tuple[int, ...]  # vLLM group ids of Mamba groups, merged into our recurrent group (last in the layout)
    layer_names: tuple[tuple[str, ...], ...]  # per vLLM group id

    @property
    def recurrent_group(self) -> int | None:
        """Our layout's index of the recurrent group."""
        return len(self.attention) if self.mamba else None

    def state_block(self, block_ids: tuple[list[int], ...], tokens: int) -> tuple[int, ...]:
        """The block of each Mamba group that holds the state after `tokens` tokens (align mode)."""
        index = (tokens - 1) // self.block_size
        return tuple(block_ids[g][index] for g in self.mamba)

    def page_block(self, block_ids: tuple[list[int], ...], layout_group: int, start: int) -> int:
        """The block of one attention group whose page holds token `start` (a kv or tail object's first token)."""
        return block_ids[self.attention[layout_group]][start // self.block_size]


def engine_groups(kv_cache_config) -> EngineGroups:
    """Read vLLM's KVCacheConfig; refuse what the connector cannot restore exactly (a clear error at startup)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    attention, mamba, sizes = [], [], set()
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if isinstance(spec, MambaSpec):
            if spec.mamba_cache_mode != "align":
                raise InvalidArgument(mamba_mode_refusal(spec.mamba_cache_mode, _vllm_version()))
            if spec.num_speculative_blocks:
                raise InvalidArgument(SPECULATIVE_REFUSAL)
            mamba.append(index)
        elif type(spec) is FullAttentionSpec:
            if spec.head_size_v != spec.head_size or spec.num_head_slots is not None \
                    or spec.state_content_bytes is not None or spec.tokens_per_state != 1:
                raise InvalidArgument(f"TierCacheConnector supports plain K/V attention pages, not {spec}")
            attention.append(index)
        else:
            raise InvalidArgument(f"TierCacheConnector supports full-attention and Mamba groups, not "
                                  f"{type(spec).__name__}")
        sizes.add(spec.block_size)
    if len(sizes) != 1 or not attention:
        raise InvalidArgument(f"TierCacheConnector needs attention and one block size for all groups, got "
                              f"{sorted(sizes)}")
    names = tuple(tuple(g.layer_names) for g in kv_cache_config.kv_cache_groups)
    return EngineGroups(sizes.pop(), tuple(attention), tuple(mamba), names)


def _vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


def model_layout(groups: EngineGroups, kv_cache_config, model: str, revision: str, tp_rank: int = 0,
                 tp_size: int = 1, identity: str = "") -> ModelLayout:
    """tiercache's layout of this engine rank: what the namespace fingerprint covers."""
    specs = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]
    layer_groups = []
    for vllm_group in groups.attention:
        spec = specs[vllm_group]
        layer_groups.append(LayerGroup(GroupKind.FULL_ATTENTION, _layer_indices(groups.layer_names[vllm_group]),
                                       kv_heads=spec.num_kv_heads, head_dim=spec.head_size,
                                       kv_dtype=dtype_name(spec.dtype)))
    if groups.mamba:
        spec = specs[groups.mamba[0]]
        if any(specs[g].shapes != spec.shapes or specs[g].dtypes != spec.dtypes for g in groups.mamba):
            raise InvalidArgument("all Mamba groups must share state shapes and dtypes")
        layers = tuple(i for g in groups.mamba for i in _layer_indices(groups.layer_names[g]))
        tensors = tuple(StateTensor(f"vllm{i}", tuple(shape), dtype_name(dtype))
                        for i, (shape, dtype) in enumerate(zip(spec.shapes, spec.dtypes)))
        layer_groups.append(LayerGroup(GroupKind.RECURRENT, layers, state=tensors))
    # The engine's name is part of the model name: vLLM's state layout is not transformers' (same model, other bytes).
    return ModelLayout(f"vllm:{model}", tuple(layer_groups), revision=revision, tp_rank=tp_rank, tp_size=tp_size,
                       identity=identity)


def _layer_indices(names) -> tuple[int, ...]:
    indices = []
    for name in names:
        match = _LAYER_INDEX.search(name)
        if match is None:
            raise InvalidArgument(f"cannot tell the layer index of {name!r}")
        indices.append(int(match.group(1)))
    return tuple(indices)


# -- worker-side views ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PagedViews:
    """The registered caches as byte pools for tiercache.kernels' row copies: [blocks, bytes per block] per layer."""

    attention: tuple[tuple[torch.Tensor, ...], ...]  # per layout attention group: per layer, its pages
    states: tuple[tuple[torch.Tensor, ...], ...]  # per Mamba group: per layer, its state bytes (padding excluded)

    @property
    def device(self) -> torch.device:
        return self.attention[0][0].device


def paged_views(groups: EngineGroups, kv_cache_config, kv_caches: dict) -> PagedViews:
    specs = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]
    blocks = kv_cache_config.num_blocks
    attention = tuple(tuple(_page_pool(kv_caches[name], blocks, specs[g]) for name in groups.layer_names[g])
                      for g in groups.attention)
    states = tuple(tuple(_state_pool(kv_caches[name], specs[g]) for name in groups.layer_names[g])
                   for g in groups.mamba)
    return PagedViews(attention, states)


def _page_pool(layer: torch.Tensor, num_blocks: int, spec) -> torch.Tensor:
    """One attention layer's cache as [blocks, page bytes]. A backend may split vLLM's block into kernel blocks
    (dim 0 is then a multiple of the block count); vLLM lays those out back to back, so a block is still one run of
    bytes. The page's interior must be dense: a page with holes cannot be one row."""
    if layer.dim() != 4 or layer.shape[0] % num_blocks or layer.stride(-1) != 1 or layer.dtype != spec.dtype:
        raise InvalidArgument(f"attention cache {tuple(layer.shape)} {layer.dtype} is not [blocks, heads, tokens, "
                              f"bytes] {spec.dtype} over {num_blocks} blocks")
    raw = layer.view(torch.uint8)
    kernel_page = raw[0].numel()
    kernel_blocks = raw.shape[0] // num_blocks
    if not _dense(raw[0]) or (kernel_blocks > 1 and raw.stride(0) != kernel_page):
        raise InvalidArgument(f"attention cache {tuple(layer.shape)} with strides {layer.stride()} does not keep "
                              f"each block in one run of bytes")
    expected = getattr(spec, "unpadded_page_size_bytes", spec.page_size_bytes)
    if kernel_blocks * kernel_page != expected:
        raise InvalidArgument(f"attention page of {kernel_blocks * kernel_page} bytes, vLLM's spec says {expected}")
    return torch.as_strided(raw, (num_blocks, kernel_blocks * kernel_page), (raw.stride(0) * kernel_blocks, 1),
                            raw.storage_offset())


def _dense(tensor: torch.Tensor) -> bool:
    """Whether the tensor's elements fill one run of memory with no holes, in whatever dimension order."""
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(tensor.stride(), tensor.shape) if n > 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _state_pool(layer: torch.Tensor, spec) -> torch.Tensor:
    size = spec.state_content_size_bytes
    if layer.dim() != 4 or layer.shape[1:3] != (1, 1) or layer.shape[3] != size or layer.element_size() != 1:
        raise InvalidArgument(f"Mamba cache {tuple(layer.shape)} is not [blocks, 1, 1, {size}] bytes")
    return layer[:, 0, 0, :].view(torch.uint8)


class PoolSets:
    """The byte pools each object lives in, and the row copies between them and staging rows (tiercache.kernels).

    A kv or tail object is one attention group's page of one block; a state object is a block of one set of state
    pools per Mamba group. Both move with the same row copies (kernels.states_*): a page is a row. Every pool set is
    checked once, here (and on a GPU its kernel arguments uploaded): a step's copies skip that. `transfers` below are
    the planner's (tiercache.connector.vllm.plan.Transfer: an object's ref and its block in each pool set)."""

    def __init__(self, views: PagedViews) -> None:
        self.views = views
        self._attention = tuple(kernels.state_pools(pools) for pools in views.attention)
        self._states = tuple(kernels.state_pools(pools) for pools in views.states)
        self._object_bytes: dict[tuple, int] = {}  # by pool key: every object of one kind is the same size

    @property
    def device(self) -> torch.device:
        return self.views.device

    def object_bytes(self, transfer) -> int:
        key = pool_key(transfer)
        size = self._object_bytes.get(key)
        if size is None:
            size = self._object_bytes[key] = sum(pools.record_bytes for pools in self._of(transfer))
        return size

    def scatter(self, transfers, rows) -> None:
        """Copy objects from their rows (staging.ObjectRows) into their blocks: one copy per pool set for each run of
        objects that live in the same pools, not one per object (each torch call costs Python time on vLLM's
        thread)."""
        for indices in runs_by_pools(transfers):
            self._copy(kernels.states_from_buffer, [transfers[i] for i in indices], rows.part(indices))

    def gather(self, transfers, rows) -> None:
        """Copy objects from their blocks into their rows, as scatter does the other way."""
        for indices in runs_by_pools(transfers):
            self._copy(kernels.states_to_buffer, [transfers[i] for i in indices], rows.part(indices))

    def _copy(self, kernel, transfers, matrix: torch.Tensor) -> None:
        blocks = list(zip(*(t.blocks for t in transfers)))  # per pool set: the block of every object
        for pools, pool_blocks, part in zip(self._of(transfers[0]), blocks, self._columns(transfers[0], matrix)):
            kernel(pools, _slots(pool_blocks), part)

    def _of(self, transfer) -> tuple[kernels.StatePools, ...]:
        """The pool sets an object's blocks live in: one attention group's pages, or the state pools."""
        if transfer.ref.kind is ObjectKind.STATE:
            return self._states
        return (self._attention[transfer.ref.group],)

    def _columns(self, transfer, matrix: torch.Tensor) -> list[torch.Tensor]:
        """Objects' bytes, one per row, split per pool set: [objects, record bytes] each, a column of the rows when
        the object lives in several pool sets (the kernels take records spaced a row apart: no extra copy)."""
        parts, offset = [], 0
        for pools in self._of(transfer):
            size = pools.record_bytes
            parts.append(matrix[:, offset:offset + size])
            offset += size
        return parts


def _slots(blocks) -> torch.Tensor:
    """Block ids on the host, for CPU and CUDA pools alike: the kernels check them there and copy them with the
    launch, so neither vLLM's thread nor the copies' stream ever waits for the GPU (slots on the GPU would cost a
    synchronisation to check: the whole forward pass, for a save)."""
    return torch.tensor(blocks, dtype=torch.int64)


def pool_key(transfer) -> tuple:
    """Which pools an object lives in: the states (-1), or one attention group's pages (its group)."""
    return (-1,) if transfer.ref.kind is ObjectKind.STATE else (transfer.ref.group,)


def runs_by_pools(transfers) -> list[list[int]]:
    """Runs of consecutive objects that live in the same pools (the states, or one attention group's pages): each
    run is one copy per pool set. The planner lists a job's objects kind by kind, so runs are long."""
    runs: list[list[int]] = []
    previous = None
    for index, transfer in enumerate(transfers):
        key = pool_key(transfer)
        if key != previous:
            runs.append([])
            previous = key
        runs[-1].append(index)
    return runs
