"""`sgl_kernel.kvcacheio`'s `direct` io-backend transfers in plain torch indexing, for HiCache on the CPU
(testkit/sglang_site). Written from their call sites in SGLang 0.5.23 (mem_cache/pool_host/mha.py and
mamba.py): every index is a token slot (a Mamba state slot with page_size 1); a page-first host buffer is
[pages, layers, page_size, ...] and slot s lives at [s // page_size, layer, s % page_size]; a device buffer is one
layer, [slots, ...]. Pages are whole runs of page_size slots, so a slot-by-slot copy is the kernels' page copy.
"""

from __future__ import annotations

import torch


def _slots(indices: torch.Tensor) -> torch.Tensor:
    return indices.to(device="cpu", dtype=torch.int64)


def transfer_kv_direct(src_layers, dst_layers, src_indices: torch.Tensor, dst_indices: torch.Tensor,
                       page_size: int) -> None:
    """Layer-first to layer-first: dst_layers[i][dst_indices] = src_layers[i][src_indices]."""
    src, dst = _slots(src_indices), _slots(dst_indices)
    for source, target in zip(src_layers, dst_layers, strict=True):
        target[dst] = source[src].to(target.device)


def transfer_kv_per_layer_direct_pf_lf(src_ptrs, dst_ptrs, src_indices: torch.Tensor, dst_indices: torch.Tensor,
                                       layer_id: int, page_size: int) -> None:
    """Page-first host buffers to one device layer each (a load): dst[d] = src[s // P, layer_id, s % P]."""
    src, dst = _slots(src_indices), _slots(dst_indices)
    for source, target in zip(src_ptrs, dst_ptrs, strict=True):
        target[dst] = source[src // page_size, layer_id, src % page_size].to(target.device)


def transfer_kv_all_layer_direct_lf_pf(src_ptrs, dst_ptrs, src_indices: torch.Tensor, dst_indices: torch.Tensor,
                                       page_size: int) -> None:
    """Device layers to page-first host buffers (a backup): src_ptrs holds each host buffer's layers in order
    (MHA: every K layer, then every V layer), dst[d // P, layer, d % P] = src_layer[s]."""
    src, dst = _slots(src_indices), _slots(dst_indices)
    layers = len(src_ptrs) // len(dst_ptrs)
    assert layers * len(dst_ptrs) == len(src_ptrs)
    for buffer, target in enumerate(dst_ptrs):
        for layer in range(layers):
            target[dst // page_size, layer, dst % page_size] = src_ptrs[buffer * layers + layer][src].to(target.device)
