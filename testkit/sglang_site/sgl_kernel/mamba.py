"""`sgl_kernel.mamba` for SGLang's CPU Gated-DeltaNet path (layers/attention/linear/gdn_backend.py and
kernels/gdn_triton.py, SGLang 0.5.23): a reference gated delta rule and causal conv1d in plain torch, token by token
in float32, written from the kernels' documented meaning (SGLang's Triton/FLA versions and their CPU fakes in
model_executor/cpu_graph_runner.py).

Layouts, as SGLang's pools hold them: a recurrent state is [slots, HV, V, K] (the delta rule's S with S @ k a
V-vector); a conv state is [slots, dim, width - 1] (any strides: it is indexed, never viewed). A cache index of -1
(SGLang's PAD_SLOT_ID) is a padded entry: not computed, its output zero.

The two ops SGLang reaches through `torch.ops.sgl_kernel` (fused_gdn_gating_cpu,
fused_sigmoid_gating_delta_rule_update_cpu) are set on that namespace when this module is imported, which SGLang
does (`from sgl_kernel.mamba import ...`) right before it looks them up.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PAD_SLOT_ID = -1


def _act(x: torch.Tensor, activation) -> torch.Tensor:
    if activation in ("silu", "swish", True):
        return F.silu(x)
    return x


def _conv_window(window: torch.Tensor, weight: torch.Tensor, bias, activation) -> torch.Tensor:
    """window [dim, width - 1 + T] -> out [dim, T]: out[:, t] = act(sum_w weight[:, w] * window[:, t + w] + bias)."""
    width = weight.shape[1]
    steps = window.shape[1] - width + 1
    out = torch.zeros(window.shape[0], steps, dtype=torch.float32)
    w = weight.float()
    for tap in range(width):
        out += w[:, tap:tap + 1] * window[:, tap:tap + steps].float()
    if bias is not None:
        out += bias.float()[:, None]
    return _act(out, activation)


def causal_conv1d_fn_cpu(x: torch.Tensor, weight: torch.Tensor, bias, conv_states: torch.Tensor,
                         query_start_loc: torch.Tensor, seq_lens_cpu=None, cache_indices=None,
                         has_initial_state=None, activation="silu", pad_slot_id: int = PAD_SLOT_ID,
                         **kwargs) -> torch.Tensor:
    """Prefill: x [dim, total tokens] (sequences back to back, bounds in query_start_loc); each sequence starts from
    its conv state when has_initial_state, else from zeros; its state becomes its last width - 1 inputs."""
    if kwargs.get("block_table") is not None:
        raise NotImplementedError("the harness's causal_conv1d_fn_cpu has no block-table (paged conv state) path")
    out = torch.zeros_like(x)
    bounds = query_start_loc.tolist()
    state_len = weight.shape[1] - 1
    for seq, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        slot = int(cache_indices[seq]) if cache_indices is not None else seq
        if slot == pad_slot_id or end <= start:
            continue
        initial = bool(has_initial_state[seq]) if has_initial_state is not None else False
        before = conv_states[slot].to(x.dtype) if initial else x.new_zeros(x.shape[0], state_len)
        window = torch.cat([before, x[:, start:end]], dim=1)
        out[:, start:end] = _conv_window(window, weight, bias, activation).to(x.dtype)
        conv_states[slot] = window[:, -state_len:].to(conv_states.dtype)
    return out


def causal_conv1d_update_cpu(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias=None,
                             activation=None, cache_seqlens=None, conv_state_indices=None,
                             pad_slot_id: int = PAD_SLOT_ID, **kwargs) -> torch.Tensor:
    """Decode: x [batch, dim] or [batch, dim, T]; each row continues from conv_state[conv_state_indices[row]], which
    is shifted left by T and takes the new inputs."""
    if cache_seqlens is not None or kwargs.get("intermediate_conv_window") is not None:
        raise NotImplementedError("the harness's causal_conv1d_update_cpu has no circular-buffer or verify path")
    squeeze = x.dim() == 2
    xs = x.unsqueeze(-1) if squeeze else x
    out = torch.zeros_like(xs)
    state_len = conv_state.shape[-1]
    for row in range(xs.shape[0]):
        slot = int(conv_state_indices[row]) if conv_state_indices is not None else row
        if slot == pad_slot_id:
            continue
        window = torch.cat([conv_state[slot].to(xs.dtype), xs[row]], dim=1)
        out[row] = _conv_window(window[:, -(weight.shape[1] - 1 + xs.shape[2]):], weight, bias,
                                activation).to(xs.dtype)
        conv_state[slot] = window[:, -state_len:].to(conv_state.dtype)
    return out.squeeze(-1) if squeeze else out


def _softplus(x: torch.Tensor, beta: float = 1.0, threshold: float = 20.0) -> torch.Tensor:
    return torch.where(beta * x <= threshold, torch.log1p(torch.exp(beta * x)) / beta, x)


def fused_gdn_gating_cpu(A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor, dt_bias: torch.Tensor):
    """g = -exp(A_log) * softplus(a + dt_bias) (float32) and beta = sigmoid(b), each [1, tokens, heads]."""
    g = -torch.exp(A_log.float()) * _softplus(a.float() + dt_bias.float())
    beta = torch.sigmoid(b.float()).to(b.dtype)
    return g.unsqueeze(0), beta.unsqueeze(0)


def _delta_rule(q, k, v, g, beta, state, scale: float, l2norm: bool):
    """One sequence, token by token. q, k [T, H, K]; v [T, HV, V]; g, beta [T, HV]; state [HV, V, K] float32
    (updated in place). Returns o [T, HV, V] float32. Query/key head h serves value heads h * HV/H ... (as FLA)."""
    heads_v = v.shape[1]
    repeat = heads_v // q.shape[1]
    q = q.float().repeat_interleave(repeat, dim=1)
    k = k.float().repeat_interleave(repeat, dim=1)
    if l2norm:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * scale
    v, g, beta = v.float(), g.float(), beta.float()
    out = torch.empty(v.shape, dtype=torch.float32)
    for t in range(v.shape[0]):
        state *= torch.exp(g[t])[:, None, None]
        remembered = torch.einsum("hvk,hk->hv", state, k[t])
        delta = (v[t] - remembered) * beta[t][:, None]
        state += delta[:, :, None] * k[t][:, None, :]
        out[t] = torch.einsum("hvk,hk->hv", state, q[t])
    return out


def chunk_gated_delta_rule_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, initial_state: torch.Tensor, cu_seqlens: torch.Tensor,
                               initial_state_indices: torch.Tensor, head_first: bool = False,
                               use_qk_l2norm_in_kernel: bool = False, scale: float | None = None,
                               output_final_state: bool = True, **kwargs):
    """Prefill: q, k [1, tokens, H, K], v [1, tokens, HV, V], g, beta [1, tokens, HV]; sequence n starts from
    initial_state[initial_state_indices[n]] and its final state is written back there. Returns (o, final states of
    the batch's sequences, None) as SGLang's extend kernels do (no per-chunk states: no_buffer strategy)."""
    assert not head_first
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    o = torch.zeros(v.shape, dtype=v.dtype)
    bounds = cu_seqlens.tolist()
    finals = []
    for seq, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        slot = int(initial_state_indices[seq])
        if slot == PAD_SLOT_ID:
            finals.append(torch.zeros(initial_state.shape[1:], dtype=torch.float32))
            continue
        state = initial_state[slot].float().clone()
        o[0, start:end] = _delta_rule(q[0, start:end], k[0, start:end], v[0, start:end], g[0, start:end],
                                      beta[0, start:end], state, scale, use_qk_l2norm_in_kernel).to(v.dtype)
        initial_state[slot] = state.to(initial_state.dtype)
        finals.append(state)
    return o, torch.stack(finals) if finals else None, None


def fused_sigmoid_gating_delta_rule_update_cpu(A_log, dt_bias, q, k, v, a, b, initial_state_source,
                                               initial_state_indices, cu_seqlens=None,
                                               use_qk_l2norm_in_kernel: bool = False, softplus_beta: float = 1.0,
                                               softplus_threshold: float = 20.0, **kwargs) -> torch.Tensor:
    """Decode: gating (as fused_gdn_gating_cpu) and the delta rule for one token per sequence. q, k [1, B, H, K],
    v [1, B, HV, V], a, b [B, HV]; states read from and written back to initial_state_source by index. Returns
    [B, 1, HV, V] (the CPU kernel's shape)."""
    if kwargs.get("disable_state_update") or kwargs.get("cache_ring"):
        raise NotImplementedError("the harness's delta-rule update has no speculative-verify path")
    seq_len, batch = q.shape[0], q.shape[1]
    assert seq_len == 1, "decode: one token per sequence"
    g = -torch.exp(A_log.float()) * _softplus(a.float() + dt_bias.float(), softplus_beta, softplus_threshold)
    beta = torch.sigmoid(b.float())
    scale = k.shape[-1] ** -0.5
    out = torch.zeros(batch, 1, v.shape[2], v.shape[3], dtype=v.dtype)
    for row in range(batch):
        slot = int(initial_state_indices[row])
        if slot == PAD_SLOT_ID:
            continue
        state = initial_state_source[slot].float().clone()
        out[row] = _delta_rule(q[:, row], k[:, row], v[:, row], g[row:row + 1], beta[row:row + 1], state, scale,
                               use_qk_l2norm_in_kernel).to(v.dtype)
        initial_state_source[slot] = state.to(initial_state_source.dtype)
    return out


# SGLang looks these two up as torch.ops.sgl_kernel.<name> (gdn_backend.py, gdn_triton.py) right after importing
# this module. Attributes on the op namespace, not registered operators: SGLang only calls them eagerly on this path.
for _op in (fused_gdn_gating_cpu, fused_sigmoid_gating_delta_rule_update_cpu):
    setattr(torch.ops.sgl_kernel, _op.__name__, _op)
