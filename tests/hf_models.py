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


class Forwards:
    """Every forward pass a model runs while this records: the positions it computed, its tokens, and which cache it
    extended (one prefill or generate: a run). `reference_logits` replays the passes that computed a restored prefill
    from scratch, in the same shape: a restored cache then gives the same bits, and the gate asks for them."""

    def __init__(self, model) -> None:
        self.model = model
        self.passes: list[tuple[int, torch.Tensor, int]] = []  # (first position, ids [1, n], run)
        self._cache = None
        self._runs = 0
        self._paused = False
        model.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs) -> None:
        if self._paused:
            return
        ids = args[0] if args else kwargs["input_ids"]
        positions = kwargs.get("position_ids")
        cache = kwargs.get("past_key_values")
        if cache is not self._cache:
            self._cache, self._runs = cache, self._runs + 1
        self.passes.append((0 if positions is None else int(positions[0, 0]), ids.detach().clone(), self._runs))

    @classmethod
    def of(cls, model) -> "Forwards":
        """The model's recorder, started on first use: start it before the model's first prefill."""
        recorder = getattr(model, "_forwards", None)
        if recorder is None:
            recorder = model._forwards = cls(model)
        return recorder

    def mark(self) -> int:
        """Where the next run's passes will start (give it to reference_logits)."""
        return len(self.passes)

    @torch.no_grad()
    def reference_logits(self, ids: torch.Tensor, since: int) -> torch.Tensor:
        """Next-token logits after `ids` (the prompt of the run whose passes start at `since`), computed from a fresh
        cache in the shape the restored run met them: the earlier passes that computed its prefix [0, p), cut at p
        where one went further (only attention can be cut), then its own passes."""
        from transformers import DynamicCache

        own = self.passes[since:]
        assert own, "no forward pass since the mark"
        chain: list[tuple[int, torch.Tensor, int]] = []
        position = own[0][0]
        while position > 0:
            chain.insert(0, self._piece(ids, position, self.passes[:since]))
            position = chain[0][0]
        cache = DynamicCache(config=self.model.config)
        _record_sliding_windows(cache)
        self._paused = True
        try:
            run, end = None, 0
            for start, piece_ids, piece_run in [*chain, *own]:
                if run is not None and piece_run != run:  # a restore between runs
                    assert end == start or not any(hasattr(layer, "conv_states") for layer in cache.layers), \
                        f"a recurrent state computed past {start} cannot be cut back to it"
                    _as_restored(cache, start)
                run = piece_run
                end = start + piece_ids.shape[1]
                logits = self.model(piece_ids, past_key_values=cache, use_cache=True,
                                    position_ids=torch.arange(start, end)[None]).logits[:, -1]
        finally:
            self._paused = False
        return logits

    @staticmethod
    def _piece(ids: torch.Tensor, position: int, passes) -> tuple[int, torch.Tensor, int]:
        """The earlier pass that computed the prefix's tokens up to `position`: the first that ended there (a state
        is saved where a pass ends), else the first that went through it (its KV was cut there)."""
        through = [p for p in passes if p[0] < position <= p[0] + p[1].shape[1]
                   and torch.equal(p[1][0, :position - p[0]], ids[0, p[0]:position])]
        ended = [p for p in through if p[0] + p[1].shape[1] == position]
        assert through, f"no earlier forward pass computed the prefix up to {position}"
        return (ended or through)[0]


def _record_sliding_windows(cache) -> None:
    """Sliding-window layers keep every token while a prefill runs (as tiercache.connector.hf.prefill has them)."""
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False):
            layer.record_past = True


def _as_restored(cache, position: int) -> None:
    """What a restore at `position` builds (tiercache.connector.hf.cache.build_cache): attention KV of tokens
    [0, position), contiguous, of which a sliding-window layer keeps its last window - 1 (recurrent states stay)."""
    for layer in cache.layers:
        if getattr(layer, "keys", None) is None or not getattr(layer, "is_initialized", False):
            continue
        sliding = getattr(layer, "is_sliding", False)
        held = layer.keys.shape[-2]
        first = (layer.cumulative_length if sliding else held) - held  # the first token the layer holds
        keep = slice(0, position - first)
        if sliding:
            keep = slice(max(0, position - first - (layer.sliding_window - 1)), position - first)
            layer.cumulative_length = position
        layer.keys = layer.keys[:, :, keep, :].contiguous()
        layer.values = layer.values[:, :, keep, :].contiguous()
