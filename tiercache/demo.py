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


def run_demo(server_url: str | None, turns: int, show_progress: bool, repeats: int = 3) -> int:
    """Cold vs warm, each measured `repeats` times on prompts of its own (medians printed: one sample on a busy
    machine says little), and every warm answer checked against a cold computation of the same prompt: the greedy
    tokens must be equal, and the logits are compared (float32: a hit changes only how the prompt is split into
    passes, which moves logits by float rounding). Exit 1 if a warm answer differs."""
    from tiercache.client.probe import require_server

    if server_url is not None:
        require_server(server_url)  # before torch and the model: a dead server is one line at once
    from tiercache.process import ServerProcess

    server = None
    if server_url is None:
        server = ServerProcess("--host-mem", "512MiB", "--disk-size", "2GiB").start()  # a scratch disk dir
        server_url = server.url
    try:
        return _run(server_url, turns, show_progress, repeats)
    finally:
        if server is not None:
            server.stop()  # SIGTERM: the server unlinks its /dev/shm arena (tests/test_demo.py checks)


def _run(server_url: str, turns: int, show_progress: bool, repeats: int) -> int:
    import numpy as np

    from tiercache.connector.hf.prefill import CachedPrefill

    model = qwen35_model()
    with Client.from_url(server_url) as client:
        # A salt per demo run: a server given with --server may hold an earlier run's prompts, which would be hits
        # where the demo promises a cold start.
        cached = CachedPrefill(model, client, model_name="demo/qwen3.5-tiny", salt=f"demo-{time.time_ns()}")
        n = cached.spec.chunk_tokens
        vocab = model.config.vocab_size
        samples: dict[tuple[str, str], list[tuple[int, float]]] = {}
        checks = Checks()
        lengths = [("below N", n // 2), ("above N", 3 * n + 37)]
        total = repeats * (2 * len(lengths) + turns)
        with tqdm(total=total, desc="demo", unit="req", disable=not show_progress, file=sys.stderr) as progress:
            for repeat in range(repeats):
                rng = np.random.default_rng(repeat)
                for label, length in lengths:
                    prompt = rng.integers(0, vocab, length)
                    answers = {}
                    for kind in ("cold", "warm"):
                        started = time.perf_counter()
                        result = cached.prefill(prompt)
                        samples.setdefault((f"{label} ({length} tokens)", kind), []).append(
                            (result.hit_tokens, _ttft_ms(cached, started)))
                        answers[kind] = result.logits
                        progress.update()
                    checks.logits(answers["warm"], answers["cold"])
                conversation = rng.integers(0, vocab, 2 * n)
                for turn in range(1, turns + 1):
                    prompt = np.concatenate([conversation, rng.integers(0, vocab, 24)])
                    started = time.perf_counter()
                    generation = cached.generate(prompt, 16)
                    samples.setdefault((f"chat turn {turn} ({len(prompt)} tokens)", "cold" if turn == 1 else "warm"),
                                       []).append((generation.hit_tokens, _ttft_ms(cached, started)))
                    if turn > 1:
                        checks.tokens(generation.tokens, _cold_greedy(model, prompt, 16))
                    conversation = np.concatenate([prompt, generation.tokens])
                    progress.update()
    attention, recurrent = len(cached.layout.groups[0].layers), len(cached.layout.recurrent_group.layers)
    print(f"model: random-weight Qwen3.5 architecture, {attention} attention + {recurrent} Gated DeltaNet layers, "
          f"float32; N = {n}, u = {cached.spec.match_unit}; server {server_url}")
    print(f"{'request':<28}{'cache':>6}{'hit tokens':>12}{'TTFT ms':>10}   (median of {repeats}: min .. max)")
    for (name, kind), runs in samples.items():
        times = sorted(ms for _, ms in runs)
        print(f"{name:<28}{kind:>6}{runs[0][0]:>12}{float(np.median(times)):>10.1f}   ({times[0]:.1f} .. "
              f"{times[-1]:.1f})")
    print(checks.summary())
    return 0 if checks.equal else 1


class Checks:
    """Warm answers against cold ones: the greedy tokens must be equal; logits are reported by their largest
    difference (a float32 prompt split into passes differently rounds differently: tests/connector/hf/test_gate.py
    compares them exactly where both sides are split alike)."""

    def __init__(self) -> None:
        self.prompts = self.compared_tokens = self.differing_tokens = 0
        self.worst_logit = 0.0
        self.first_tokens_differ = 0

    def logits(self, warm, cold) -> None:
        self.prompts += 1
        self.worst_logit = max(self.worst_logit, float((warm.float() - cold.float()).abs().max()))
        self.first_tokens_differ += int(warm.argmax()) != int(cold.argmax())

    def tokens(self, warm: list[int], cold: list[int]) -> None:
        self.compared_tokens += len(cold)
        self.differing_tokens += sum(a != b for a, b in zip(warm, cold)) + abs(len(warm) - len(cold))

    @property
    def equal(self) -> bool:
        return self.first_tokens_differ == 0 and self.differing_tokens == 0

    def summary(self) -> str:
        verdict = "warm answers equal cold ones" if self.equal else "WARM ANSWERS DIFFER FROM COLD ONES"
        return (f"{verdict}: next token after {self.prompts} prompts ({self.first_tokens_differ} differ; logits "
                f"at most {self.worst_logit:.1e} apart), {self.compared_tokens} chat tokens generated warm against a "
                f"cold recompute ({self.differing_tokens} differ)")


def _cold_greedy(model, prompt, steps: int) -> list[int]:
    """Greedy decoding with no cache at all: one forward pass over the prompt, then one token at a time."""
    import torch
    from transformers import DynamicCache

    with torch.no_grad():
        past = DynamicCache(config=model.config)
        ids = torch.as_tensor(prompt)[None]
        logits = model(ids, past_key_values=past, use_cache=True).logits[:, -1]
        tokens = [int(logits[0].argmax())]
        while len(tokens) < steps:
            position = ids.shape[1] + len(tokens) - 1
            logits = model(torch.tensor([[tokens[-1]]]), past_key_values=past, use_cache=True,
                           position_ids=torch.tensor([[position]])).logits[:, -1]
            tokens.append(int(logits[0].argmax()))
    return tokens


def _ttft_ms(cached, started: float) -> float:
    """Time to the first token's logits (CachedPrefill.last_ttft_s), or since `started` before any prefill."""
    return 1000 * (cached.last_ttft_s if cached.last_timings else time.perf_counter() - started)
