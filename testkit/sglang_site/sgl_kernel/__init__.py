"""A pure-torch stand-in for `sgl_kernel`, SGLang's kernel package, for SGLang's CPU engine on a machine without
SGLang's CPU kernel build (testkit/sglang_site).

No CPU wheel of sgl-kernel exists (`sgl-kernel` / `sglang-kernel` on PyPI are CUDA builds without an sdist, and
installing them with their dependencies swaps the CPU torch for a CUDA one). SGLang's CPU path imports a few of its
functions unconditionally (`mem_cache/allocation.py`, `kernels/ops/kvcache/cache_move.py`); on a CPU without AMX
SGLang uses none of its other CPU kernels (it falls back to torch_native attention and torch sampling). Each function
here is the plain-indexing meaning of the kernel of the same name, written from its call sites in SGLang 0.5.23.
The Gated-DeltaNet ops of hybrid models are in `sgl_kernel.mamba`.
"""

from __future__ import annotations

import ctypes

import torch

__version__ = "0.0.0+tiercache-harness"


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor, out_cache_loc: torch.Tensor,
                                 pool_len: int) -> None:
    """req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]] = the i-th request's run of out_cache_loc
    (the runs follow each other in out_cache_loc)."""
    del pool_len  # the row length of req_to_token: the indexing below knows it
    taken = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        count = end - start
        req_to_token[row, start:end] = out_cache_loc[taken:taken + count].to(req_to_token.dtype)
        taken += count


def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor,
                                src_loc: torch.Tensor) -> None:
    """For every buffer (a raw address and its row size in bytes): rows src_loc copied to rows tgt_loc."""
    if src_loc.numel() == 0:
        return
    src, tgt = src_loc.to(torch.int64), tgt_loc.to(torch.int64)
    rows = int(max(src.max(), tgt.max())) + 1
    for address, stride in zip(data_ptrs.tolist(), strides.tolist()):
        memory = (ctypes.c_uint8 * (rows * stride)).from_address(address)
        buffer = torch.frombuffer(memory, dtype=torch.uint8).view(rows, stride)
        buffer[tgt] = buffer[src].clone()


def init_cpu_threads_env(cpu_ids) -> str:
    """SGLang binds its OpenMP threads with this (only on AMX or arm64 machines); nothing to bind here."""
    return ""


def _speculative_only(name: str):
    """SGLang's speculative-decoding modules import these on the CPU path at start; the harness runs no speculative
    decoding, so calling one is a clear error, never a wrong answer."""
    def kernel(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name}: speculative decoding has no stand-in in the CPU harness")
    kernel.__name__ = name
    return kernel


for _name in ("build_tree_kernel_efficient_cpu", "verify_tree_greedy_cpu", "rotate_input_ids_cpu",
              "fill_accept_out_cache_loc_cpu", "fill_bonus_tokens_cpu", "assign_draft_cache_locs_contiguous_cpu",
              "assign_extend_cache_locs_cpu"):
    globals()[_name] = _speculative_only(_name)
del _name
