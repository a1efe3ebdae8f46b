"""`tiercache demo`: a tiny random-weight Qwen3.5-architecture model on the CPU, cold vs warm, through a real server.

Needs the `hf` extra (torch, transformers). Nothing is downloaded: the model is built from a config.
"""

from __future__ import annotations

import sys
import time

from tqdm import tqdm

from tiercache.client import Client


def qwen35_model(hidden: int = 256, layers: int = 8, vocab: int = 4096, seed: int = 0):
    """A Qwen3_5ForCausalLM with Qwen3.5's layer pattern (3 Gated DeltaNet layers, then full attention) and random
    weights, in float32 on the CPU."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    heads = max(hidden // 64, 2)
    config = transformers.Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=max(heads // 4, 1), head_dim=64, linear_num_key_heads=heads // 2,
        linear_num_value_heads=heads, linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
        full_attention_interval=4, max_position_embeddings=16384)
    torch.manual_seed(seed)
    return transformers.Qwen3_5ForCausalLM(config).eval()


def run_demo(server_url: str | None, turns: int, show_progress: bool) -> int:
    from tiercache.client.probe import require_server

    if server_url is not None:
        require_server(server_url)  # before torch and the model: a dead server is one line at once
    import numpy as np

    from tiercache.connector.hf.prefill import CachedPrefill
    from tiercache.process import ServerProcess

    server = None
    if server_url is None:
        server = ServerProcess("--host-mem", "512MiB", "--disk-size", "2GiB").start()  # a scratch disk dir
        server_url = server.url
    try:
        model = qwen35_model()
        with Client.from_url(server_url) as client:
            cached = CachedPrefill(model, client, model_name="demo/qwen3.5-tiny")
            n = cached.spec.chunk_tokens
            rng = np.random.default_rng(0)
            vocab = model.config.vocab_size
            rows = []
            prompts = [("below N", rng.integers(0, vocab, n // 2)), ("above N", rng.integers(0, vocab, 3 * n + 37))]
            with tqdm(total=2 * len(prompts) + turns, desc="demo", unit="req", disable=not show_progress,
                      file=sys.stderr) as progress:
                for label, prompt in prompts:
                    for kind in ("cold", "warm"):
                        started = time.perf_counter()
                        result = cached.prefill(prompt)
                        rows.append((f"{label} ({len(prompt)} tokens)", kind, result.hit_tokens,
                                     _ttft_ms(cached, started)))
                        progress.update()
                conversation = rng.integers(0, vocab, 2 * n)
                for turn in range(1, turns + 1):
                    prompt = np.concatenate([conversation, rng.integers(0, vocab, 24)])
                    started = time.perf_counter()
                    generation = cached.generate(prompt, 16)
                    rows.append((f"chat turn {turn} ({len(prompt)} tokens)", "cold" if turn == 1 else "warm",
                                 generation.hit_tokens, _ttft_ms(cached, started)))
                    conversation = np.concatenate([prompt, generation.tokens])
                    progress.update()
        attention, recurrent = len(cached.layout.groups[0].layers), len(cached.layout.recurrent_group.layers)
        print(f"model: random-weight Qwen3.5 architecture, {attention} attention + {recurrent} Gated DeltaNet layers; "
              f"N = {n}, u = {cached.spec.match_unit}; server {server_url}")
        print(f"{'request':<28}{'cache':>6}{'hit tokens':>12}{'TTFT ms':>10}")
        for name, kind, hit, ttft in rows:
            print(f"{name:<28}{kind:>6}{hit:>12}{ttft:>10.1f}")
    finally:
        if server is not None:
            server.kill()
    return 0


def _ttft_ms(cached, started: float) -> float:
    """Time to the first token's logits: lookup + load + compute (the save that follows is not on that path)."""
    t = cached.last_timings
    return 1000 * (t["lookup"] + t["load"] + t["compute"]) if t else 1000 * (time.perf_counter() - started)
