"""Tiny random-weight transformers models of several families, built from configs on the CPU (nothing downloaded)."""

from __future__ import annotations

import torch
import transformers

transformers.logging.set_verbosity_error()

VOCAB = 256
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=4096)

CONFIGS = {
    "qwen3_5": ("Qwen3_5ForCausalLM", "Qwen3_5TextConfig", dict(
        num_hidden_layers=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, full_attention_interval=2)),
    "qwen3_next": ("Qwen3NextForCausalLM", "Qwen3NextConfig", dict(
        num_hidden_layers=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, full_attention_interval=2, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32, decoder_sparse_step=1)),
    "falcon_h1": ("FalconH1ForCausalLM", "FalconH1Config", dict(
        num_hidden_layers=2, head_dim=16, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8,
        mamba_n_groups=1, mamba_d_conv=4, mamba_expand=1, mamba_chunk_size=16)),
    "bamba": ("BambaForCausalLM", "BambaConfig", dict(
        num_hidden_layers=4, attn_layer_indices=[1, 3], mamba_d_state=8, mamba_n_heads=4, mamba_d_head=16,
        mamba_n_groups=1, mamba_d_conv=4, mamba_expand=1, mamba_chunk_size=16)),
    "lfm2": ("Lfm2ForCausalLM", "Lfm2Config", dict(num_hidden_layers=4, full_attn_idxs=[1, 3])),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", dict(
        num_hidden_layers=4, head_dim=16, sliding_window=8, sliding_window_pattern=2)),
    "llama": ("LlamaForCausalLM", "LlamaConfig", dict(num_hidden_layers=2)),
    "jamba": ("JambaForCausalLM", "JambaConfig", dict(
        num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=100, num_experts=1,
        mamba_d_state=8, mamba_d_conv=4, mamba_expand=1, use_mamba_kernels=False)),
}


def tiny_model(family: str, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides):
    """A random-weight model of `family` (CONFIGS), with config keys in `overrides` replaced."""
    model_class, config_class, options = CONFIGS[family]
    config = getattr(transformers, config_class)(**_COMMON, **{**options, **overrides})
    torch.manual_seed(seed)
    return getattr(transformers, model_class)(config).to(dtype).eval()


@torch.no_grad()
def reference_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Next-token logits of a full recompute (one forward pass, no cache reuse)."""
    return model(ids).logits[:, -1]


@torch.no_grad()
def reference_greedy(model, ids: torch.Tensor, steps: int) -> list[int]:
    """Greedy decoding from scratch: one forward pass over the prompt, then one token at a time."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    logits = model(ids, past_key_values=cache, use_cache=True).logits[:, -1]
    tokens = [int(logits[0].argmax())]
    position = ids.shape[1]
    while len(tokens) < steps:
        logits = model(torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True,
                       position_ids=torch.tensor([[position]])).logits[:, -1]
        position += 1
        tokens.append(int(logits[0].argmax()))
    return tokens
