"""Hugging Face `DynamicCache` <-> tiercache objects: the layout of a model's cache, and the bytes of each object.

Works for any model whose cache is made of transformers' layer types (checked with transformers 5.23):
- `DynamicLayer` (full attention): `.keys` / `.values` [batch, kv_heads, tokens, head_dim];
- `DynamicSlidingWindowLayer`: the same for the last `sliding_window - 1` tokens, plus `cumulative_length`;
- `LinearAttentionLayer` (Mamba, Gated DeltaNet, short conv): `.conv_states[s]`, `.recurrent_states[s]`;
- `LinearAttentionAndFullAttentionLayer` (both at once, e.g. Falcon-H1); `DummyLayer` (nothing).
The layout is read off a 2-token forward pass into a fresh cache, so shapes and dtypes are the model's own (recurrent
states stay float32 in bf16 models), with no per-family config parsing.

Payloads: a kv or tail object of an attention group is [layers, 2 (K, V), tokens, kv_heads * head_dim] in the KV
dtype (the layout the CUDA gather/scatter kernels produce); a state object is, layer after layer, each state tensor
of that layer (conv then recurrent, per state index) in its own dtype. Batch size 1.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch

from tiercache.errors import InvalidArgument
from tiercache.prefix.layout import GroupKind, LayerGroup, ModelLayout, StateTensor, dtype_name
from tiercache.prefix.objects import CacheSpec, ObjectKind, ObjectRef


def _is_attention(layer) -> bool:
    return getattr(layer, "keys", None) is not None and getattr(layer, "is_initialized", False)


def _is_recurrent(layer) -> bool:
    return hasattr(layer, "conv_states")


def _state_tensors(layer) -> list[tuple[str, int, torch.Tensor]]:
    """(kind, state index, tensor) of one recurrent layer, in payload order."""
    tensors = []
    for s in sorted(layer.conv_states):
        if layer.conv_states[s] is not None:
            tensors.append(("conv", s, layer.conv_states[s]))
        if layer.recurrent_states[s] is not None:
            tensors.append(("recurrent", s, layer.recurrent_states[s]))
    return tensors


def derive_layout(model, model_name: str, revision: str) -> ModelLayout:
    """The ModelLayout of `model`, read off the cache of a 2-token forward pass."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.zeros((1, 2), dtype=torch.long, device=model.device), past_key_values=cache, use_cache=True)
    attention: dict[tuple, list[int]] = {}
    recurrent: list[int] = []
    state_spec = None
    for index, layer in enumerate(cache.layers):
        if _is_attention(layer):
            window = getattr(layer, "sliding_window", None) if getattr(layer, "is_sliding", False) else None
            _, heads, _, head_dim = layer.keys.shape
            attention.setdefault((window, heads, head_dim, dtype_name(layer.keys.dtype)), []).append(index)
        if _is_recurrent(layer):
            spec = tuple(StateTensor(f"{kind}{s}", tuple(t.shape[1:]), dtype_name(t.dtype))
                         for kind, s, t in _state_tensors(layer))
            if state_spec is not None and spec != state_spec:
                raise InvalidArgument("recurrent layers with different state shapes are not supported yet")
            state_spec = spec
            recurrent.append(index)
    groups = [LayerGroup(GroupKind.SLIDING_WINDOW if window else GroupKind.FULL_ATTENTION, tuple(layers),
                         kv_heads=heads, head_dim=head_dim, kv_dtype=dtype, window=window)
              for (window, heads, head_dim, dtype), layers in attention.items()]
    if recurrent:
        groups.append(LayerGroup(GroupKind.RECURRENT, tuple(recurrent), state=state_spec))
    if not any(g.is_attention for g in groups):
        raise InvalidArgument("models without any attention layer are not supported (no position in the cache)")
    return ModelLayout(model_name, tuple(groups), revision=revision, num_layers=len(cache.layers))


# -- cache -> bytes ------------------------------------------------------------------------------------------------

def holds(cache, spec: CacheSpec, ref: ObjectRef) -> bool:
    """Whether every layer of the object's group still holds the tokens a kv or tail object names (a restored
    sliding-window layer keeps only its window)."""
    for index in spec.layout.groups[ref.group].layers:
        layer = cache.layers[index]
        first = _first_held(layer)
        if ref.start < first or ref.position > first + layer.keys.shape[-2]:
            return False
    return True


def _first_held(layer) -> int:
    return getattr(layer, "cumulative_length", layer.keys.shape[-2]) - layer.keys.shape[-2]


def attention_payload(cache, group: LayerGroup, start: int, end: int) -> np.ndarray:
    """KV of tokens [start, end) of every layer of an attention group, as [layers, 2, tokens, heads*dim] bytes."""
    parts = []
    for index in group.layers:
        layer = cache.layers[index]
        first = _first_held(layer)
        a, b = start - first, end - first
        if a < 0 or b > layer.keys.shape[-2]:
            raise InvalidArgument(f"layer {index} no longer holds tokens [{start}, {end}) (it holds from {first})")
        for tensor in (layer.keys, layer.values):
            parts.append(tensor[0, :, a:b, :].transpose(0, 1).reshape(-1))
    return _to_bytes(torch.cat(parts))


def state_payload(cache, group: LayerGroup) -> np.ndarray:
    """The current state of every recurrent layer, in payload order."""
    parts = [t[0].reshape(-1).view(torch.uint8) for index in group.layers
             for _, _, t in _state_tensors(cache.layers[index])]
    return _to_bytes(torch.cat(parts))


def _to_bytes(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().contiguous().view(torch.uint8).cpu().numpy()


# -- bytes -> cache ------------------------------------------------------------------------------------------------

def build_cache(model, spec: CacheSpec, position: int, objects: Mapping[ObjectRef, bytes]):
    """A DynamicCache that has consumed tokens [0, position), from the loaded objects of a hit at `position`."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    device = model.device
    for group_index, group in enumerate(spec.layout.groups):
        refs = sorted((r for r in objects if r.group == group_index), key=lambda r: r.position)
        if group.kind is GroupKind.RECURRENT:
            _restore_states(cache, group, objects[refs[-1]], device)
        else:
            _restore_attention(cache, group, [(r, objects[r]) for r in refs], position, device)
    return cache


def _restore_attention(cache, group: LayerGroup, parts: list[tuple[ObjectRef, bytes]], position: int, device) -> None:
    dtype = getattr(torch, group.kv_dtype)
    width = group.kv_heads * group.head_dim
    per_layer: list[list[torch.Tensor]] = [[] for _ in group.layers]
    for ref, data in parts:
        block = torch.frombuffer(bytearray(data), dtype=dtype).view(len(group.layers), 2, ref.tokens, width)
        for j in range(len(group.layers)):
            per_layer[j].append(block[j])
    start = parts[0][0].start if parts else position
    for j, index in enumerate(group.layers):
        kv = torch.cat(per_layer[j], dim=1) if per_layer[j] else torch.empty(2, 0, width, dtype=dtype)
        if kv.shape[1] != position - start:
            raise InvalidArgument(f"loaded KV covers {kv.shape[1]} tokens, expected {position - start}")
        if group.window is not None:
            kv = kv[:, -(group.window - 1):] if group.window > 1 else kv[:, :0]
        keys, values = (t.view(-1, group.kv_heads, group.head_dim).transpose(0, 1)[None].contiguous().to(device)
                        for t in (kv[0], kv[1]))
        layer = cache.layers[index]
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
        if group.window is not None:
            layer.cumulative_length = position


def _restore_states(cache, group: LayerGroup, data: bytes, device) -> None:
    buffer = bytearray(data)
    offset = 0
    for index in group.layers:
        layer = cache.layers[index]
        for tensor_spec in group.state:
            size = tensor_spec.size_bytes
            tensor = torch.frombuffer(buffer, dtype=getattr(torch, tensor_spec.dtype), count=size // _itemsize(
                tensor_spec.dtype), offset=offset).view(1, *tensor_spec.shape).to(device)
            offset += size
            state_idx = int(tensor_spec.name.removeprefix("conv").removeprefix("recurrent"))
            # One kwarg set per call: LinearAttentionAndFullAttentionLayer dispatches on the number of kwargs.
            if tensor_spec.name.startswith("conv"):
                layer.lazy_initialization(conv_states=tensor, state_idx=state_idx, conv_kernel_size=tensor.shape[-1])
                layer.conv_states[state_idx].copy_(tensor)
            else:
                layer.lazy_initialization(recurrent_states=tensor, state_idx=state_idx)
                layer.recurrent_states[state_idx].copy_(tensor)
            layer.has_previous_state[state_idx] = True
    if offset != len(buffer):
        raise InvalidArgument(f"state object is {len(buffer)} bytes, the layout says {offset}")


def _itemsize(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def object_payload(cache, spec: CacheSpec, ref: ObjectRef) -> np.ndarray:
    """The bytes of one attention object (kv or tail) from a cache that holds its tokens."""
    if ref.kind is ObjectKind.STATE:
        raise InvalidArgument("states are captured while the forward pass is split, not read afterwards")
    return attention_payload(cache, spec.layout.groups[ref.group], ref.start, ref.position)
