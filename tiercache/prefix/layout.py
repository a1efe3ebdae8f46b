"""Model layouts: which layers a model has, how many bytes each caches, and the unified block size N.

A hybrid model caches two kinds of things. Attention layers (full or sliding-window) leave KV per token; recurrent
layers (Mamba, Gated DeltaNet, short conv) leave one fixed-size state per sequence. Engines give both the same page
size, so the attention block N is raised until one attention page (N tokens of one layer) holds one recurrent
layer's state: that N is `unified_block_size`, and tiercache's KV chunks are N tokens long.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

import xxhash

from tiercache.errors import InvalidArgument

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1}
KERNEL_ALIGNMENT = 16  # attention kernels want block sizes in multiples of 16 tokens (vLLM does the same)


class GroupKind(enum.Enum):
    FULL_ATTENTION = "full_attention"
    SLIDING_WINDOW = "sliding_window"
    RECURRENT = "recurrent"


def dtype_name(dtype) -> str:
    """The name a layout gives an engine's tensor dtype (a torch.dtype: "torch.bfloat16" -> "bfloat16"), the same in
    every connector: it is part of what keys a layout's bytes."""
    return str(dtype).removeprefix("torch.")


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise InvalidArgument(f"unknown dtype {dtype!r} (known: {', '.join(DTYPE_BYTES)})") from None


@dataclass(frozen=True)
class StateTensor:
    """One tensor of a recurrent layer's state, per sequence (e.g. the SSM state, or the conv window)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def size_bytes(self) -> int:
        return math.prod(self.shape) * dtype_bytes(self.dtype)


@dataclass(frozen=True)
class LayerGroup:
    """Layers that cache the same way. Attention groups own `kv` and `tail` objects; the recurrent group owns `state`.

    For attention: kv_heads x head_dim per layer, keys and values in `kv_dtype`. For sliding window: `window` tokens.
    For recurrent: the tensors of one layer's state.
    """

    kind: GroupKind
    layers: tuple[int, ...]
    kv_heads: int = 0
    head_dim: int = 0
    kv_dtype: str = "bfloat16"
    window: int | None = None
    state: tuple[StateTensor, ...] = ()

    def __post_init__(self) -> None:
        if not self.layers:
            raise InvalidArgument(f"{self.kind.value} group has no layers")
        if self.kind is GroupKind.RECURRENT:
            if not self.state:
                raise InvalidArgument("a recurrent group needs its state tensors")
        elif self.kv_heads <= 0 or self.head_dim <= 0:
            raise InvalidArgument(f"{self.kind.value} group needs kv_heads and head_dim")
        if (self.kind is GroupKind.SLIDING_WINDOW) != (self.window is not None):
            raise InvalidArgument("window is set exactly for sliding-window groups")
        if self.window is not None and self.window <= 0:
            raise InvalidArgument("window must be positive")
        dtype_bytes(self.kv_dtype)

    @property
    def is_attention(self) -> bool:
        return self.kind is not GroupKind.RECURRENT

    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        return 2 * self.kv_heads * self.head_dim * dtype_bytes(self.kv_dtype) if self.is_attention else 0

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv_bytes_per_token_per_layer * len(self.layers)

    @property
    def state_bytes_per_layer(self) -> int:
        return sum(t.size_bytes for t in self.state)

    @property
    def state_bytes(self) -> int:
        return self.state_bytes_per_layer * len(self.layers)

    def describe(self) -> str:
        """Canonical text of everything that changes the bytes this group caches (for fingerprints)."""
        if self.kind is GroupKind.RECURRENT:
            tensors = ",".join(f"{t.name}:{'x'.join(map(str, t.shape))}:{t.dtype}" for t in self.state)
            return f"recurrent[{_ranges(self.layers)}]({tensors})"
        window = f",w{self.window}" if self.window is not None else ""
        return f"{self.kind.value}[{_ranges(self.layers)}]({self.kv_heads}x{self.head_dim}:{self.kv_dtype}{window})"


@dataclass(frozen=True)
class ModelLayout:
    """What one engine rank caches for one model. Tensor parallelism: shapes are this rank's share."""

    model: str
    groups: tuple[LayerGroup, ...]
    revision: str = "main"
    tp_rank: int = 0
    tp_size: int = 1
    num_layers: int = field(default=0)
    # What else decides the bytes and is not a shape: the weights' identity, quantization, the engine's page layout
    # (an engine connector fills it in; see tiercache.connector.vllm.identity). Part of the fingerprint.
    identity: str = ""

    def __post_init__(self) -> None:
        if not self.groups:
            raise InvalidArgument("a layout needs at least one layer group")
        if not 0 <= self.tp_rank < self.tp_size:
            raise InvalidArgument(f"tp_rank {self.tp_rank} is outside tp_size {self.tp_size}")
        if sum(g.kind is GroupKind.RECURRENT for g in self.groups) > 1:
            raise InvalidArgument("at most one recurrent group (its state is saved as one object)")
        # A layer may be both attention and recurrent (Falcon-H1 runs both side by side), but not in two groups of
        # the same side.
        attention = [layer for g in self.groups if g.is_attention for layer in g.layers]
        if len(attention) != len(set(attention)):
            raise InvalidArgument("a layer belongs to more than one attention group")
        if not self.num_layers:
            object.__setattr__(self, "num_layers", max(layer for g in self.groups for layer in g.layers) + 1)

    @property
    def attention_groups(self) -> tuple[LayerGroup, ...]:
        return tuple(g for g in self.groups if g.is_attention)

    @property
    def recurrent_group(self) -> LayerGroup | None:
        return next((g for g in self.groups if g.kind is GroupKind.RECURRENT), None)

    @property
    def is_hybrid(self) -> bool:
        return self.recurrent_group is not None

    @property
    def kv_bytes_per_token(self) -> int:
        return sum(g.kv_bytes_per_token for g in self.attention_groups)

    @property
    def state_bytes(self) -> int:
        group = self.recurrent_group
        return group.state_bytes if group else 0

    def fingerprint(self, n: int, u: int) -> str:
        """16 hex characters that change whenever the cached bytes' meaning would: dtypes, shapes, N, u, TP, groups."""
        parts = [f"N{n}", f"u{u}", f"tp{self.tp_rank}/{self.tp_size}", *(g.describe() for g in self.groups)]
        if self.identity:
            parts.append(self.identity)
        text = ";".join(parts)
        return xxhash.xxh3_64_hexdigest(text.encode())


def unified_block_size(layout: ModelLayout, alignment: int = KERNEL_ALIGNMENT) -> int:
    """N: the smallest multiple of `alignment` such that N tokens of one attention layer's KV hold one recurrent
    layer's state. Pure attention models get `alignment` itself. Matches vLLM's hybrid block sizing.
    """
    group = layout.recurrent_group
    attention = layout.attention_groups
    if group is None or not attention:
        return alignment
    per_token = max(g.kv_bytes_per_token_per_layer for g in attention)
    tokens = -(-group.state_bytes_per_layer // per_token)
    return -(-tokens // alignment) * alignment


def _ranges(layers: tuple[int, ...]) -> str:
    """'0-2,5' for (0, 1, 2, 5): short, canonical layer lists in fingerprints."""
    out, start, prev = [], None, None
    for layer in sorted(layers):
        if start is None:
            start = prev = layer
        elif layer == prev + 1:
            prev = layer
        else:
            out.append(f"{start}-{prev}" if prev != start else str(start))
            start = prev = layer
    out.append(f"{start}-{prev}" if prev != start else str(start))
    return ",".join(out)
