"""Time to first token on a GPU with the transformers connector (CachedPrefill): a random-weight Qwen3.5 of a real
size, cold against a hit from tiercache's host tier and from its disk tier, and the load's GB/s against a plain
pinned host-to-device copy of the same bytes.

For every model shape (the Qwen3.5-0.8B and -4B presets' cache shapes; hidden and MLP sizes from the published
configs, in SHAPES) and prompt length (8K, 32K, 128K tokens), smallest first so a run cut short keeps what it did:
- `model alone`: the model's one-pass prefill of the prompt, no cache (what a user runs instead);
- per tier (`host`: a server with only host memory; `disk`: only a disk tier), the prompt sent cold through
  CachedPrefill (a miss: computed in passes cut where recurrent states are kept, then saved), then the same prompt
  with its last `--suffix` tokens replaced (a hit up to the chunk boundary below the shared part): TTFT = lookup +
  load + compute, the load's bytes and seconds (into the GPU cache), and the hit's next token and logits against
  the model alone on that prompt;
- `pinned H2D`: the same number of bytes copied from pinned host memory to the GPU (the bound a load can approach).
The JSON is rewritten after every case, with torch's version and the device's name.

    python3 -m benchmarks.hf_gpu --json hf_gpu.json                 # on a GPU machine (make bench-gpu runs it)
    .venv/bin/python -m benchmarks.hf_gpu --device cpu --dtype float32 --shapes tiny --lengths 1024 --json x.json
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import statistics
import time

import numpy as np
import torch

from lab.common import write_report
from tiercache.client import Client
from tiercache.connector.hf.prefill import CachedPrefill
from tiercache.process import ServerProcess


@dataclasses.dataclass(frozen=True)
class Shape:
    """A Qwen3.5 text model's sizes. layers / kv_heads / value_heads are the preset's (tiercache.prefix.presets);
    lab/tests/test_hf_gpu.py checks the built model's cache layout against it."""
    preset: str | None
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    value_heads: int
    key_heads: int = 16
    head_dim: int = 256
    linear_dim: int = 128
    vocab: int = 248_320


SHAPES = {
    "qwen3.5-0.8b": Shape("qwen3.5-0.8b", hidden=1024, intermediate=3584, layers=24, heads=8, kv_heads=2,
                          value_heads=16),
    "qwen3.5-4b": Shape("qwen3.5-4b", hidden=2560, intermediate=9216, layers=32, heads=16, kv_heads=4,
                        value_heads=32),
    # The smoke run's (lab/tests/test_hf_gpu.py): the same pattern, small enough for a CPU.
    "tiny": Shape(None, hidden=128, intermediate=256, layers=4, heads=2, kv_heads=1, value_heads=2, key_heads=1,
                  head_dim=64, linear_dim=32, vocab=1024),
}
TIERS = {"host": ("--host-mem", "{mem}", "--disk-size", "0"), "disk": ("--host-mem", "0", "--disk-size", "{mem}")}
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def config_for(shape: Shape, max_tokens: int):
    import transformers

    return transformers.Qwen3_5TextConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim, linear_num_key_heads=shape.key_heads, linear_num_value_heads=shape.value_heads,
        linear_key_head_dim=shape.linear_dim, linear_value_head_dim=shape.linear_dim, linear_conv_kernel_dim=4,
        full_attention_interval=4, max_position_embeddings=max(max_tokens, 4096), tie_word_embeddings=False)


def build_model(shape: Shape, device: str, dtype: torch.dtype, max_tokens: int, seed: int = 0):
    """Random weights, written on the device in its dtype (a 4B model's fp32 copy on the host is never made)."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = transformers.Qwen3_5ForCausalLM(config_for(shape, max_tokens))
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.no_grad()
def model_alone(model, tokens: np.ndarray, device: str) -> tuple[float, torch.Tensor]:
    """Seconds of the model's own one-pass prefill, and its last logits."""
    ids = torch.as_tensor(tokens, device=device)[None]
    sync(device)
    started = time.perf_counter()
    logits = model(ids, use_cache=True, logits_to_keep=1).logits[0, -1]
    sync(device)
    return time.perf_counter() - started, logits.float()


def pinned_copy_s(nbytes: int, device: str, repeats: int = 5) -> float | None:
    """Median seconds of copying `nbytes` from pinned host memory to the device (None on a CPU run)."""
    if not device.startswith("cuda") or nbytes == 0:
        return None
    source = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(repeats + 1):
        sync(device)
        started = time.perf_counter()
        target.copy_(source, non_blocking=True)
        sync(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])  # the first warms the path


def through_tier(model, tier: str, prompt: np.ndarray, other: np.ndarray, reference: torch.Tensor, args) -> dict:
    """The prompt cold through a server with only this tier, then `other` (the same but its suffix) as a hit."""
    flags = [flag.format(mem=args.tier_mem) for flag in TIERS[tier]]
    with ServerProcess(*flags) as server, Client.from_url(server.url, timeout_s=600) as client:
        cached = CachedPrefill(model, client, model_name=f"bench/hf-gpu-{tier}", verify_continuation=False,
                               max_boundary_states=args.max_boundary_states)
        runs = {}
        for name, tokens in (("cold", prompt), ("hit", other)):
            sync(args.device)
            result = cached.prefill(tokens)
            sync(args.device)
            t = cached.last_timings
            runs[name] = {"hit_tokens": result.hit_tokens, "loaded_bytes": cached.last_loaded_bytes,
                          "ttft_s": cached.last_ttft_s, **{f"{k}_s": v for k, v in t.items()}}
        logits = result.logits[0].float()
        hit = runs["hit"]
        hit["next_token_equal"] = int(logits.argmax()) == int(reference.argmax())
        hit["max_logit_difference"] = float((logits - reference).abs().max() / reference.abs().max())
        hit["load_gb_s"] = hit["loaded_bytes"] / hit["load_s"] / 1e9 if hit["load_s"] > 0 else None
        runs["chunk_tokens"] = cached.spec.chunk_tokens
    return runs


def one_case(shape_name: str, length: int, args, model) -> dict:
    rng = np.random.default_rng(length)
    vocab = SHAPES[shape_name].vocab
    prompt = rng.integers(3, vocab, length)
    other = np.concatenate([prompt[:length - args.suffix], rng.integers(3, vocab, args.suffix)])
    model_alone(model, prompt[:256], args.device)  # kernels warmed before anything is timed
    alone_s, _ = model_alone(model, prompt, args.device)
    other_alone_s, reference = model_alone(model, other, args.device)
    case = {"shape": shape_name, "prompt_tokens": length, "suffix_tokens": args.suffix,
            "model_alone_ttft_s": statistics.median([alone_s, other_alone_s]), "tiers": {}}
    for tier in args.tiers.split(","):
        runs = through_tier(model, tier, prompt, other, reference, args)
        copy_s = pinned_copy_s(runs["hit"]["loaded_bytes"], args.device)
        runs["hit"]["pinned_h2d_gb_s"] = runs["hit"]["loaded_bytes"] / copy_s / 1e9 if copy_s else None
        runs["hit_over_alone"] = runs["hit"]["ttft_s"] / case["model_alone_ttft_s"]
        case["tiers"][tier] = runs
    return case


def environment(args) -> dict:
    import transformers

    cuda = args.device.startswith("cuda")
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__,
            "transformers": transformers.__version__, "cuda": torch.version.cuda if cuda else None,
            "device": torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine(),
            "python": platform.python_version(), "dtype": args.dtype, "tier_mem": args.tier_mem,
            "max_boundary_states": args.max_boundary_states}


def cases(args) -> list[tuple[str, int]]:
    """Smallest first (by tokens, then model): the largest case runs last."""
    shapes = args.shapes.split(",")
    return [(s, n) for n in sorted(int(x) for x in args.lengths.split(",")) for s in shapes]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="qwen3.5-0.8b,qwen3.5-4b", help=f"from {', '.join(SHAPES)}")
    parser.add_argument("--lengths", default="8192,32768,131072", help="prompt tokens, comma-separated")
    parser.add_argument("--suffix", type=int, default=64, help="tokens of the hit's prompt that differ")
    parser.add_argument("--tiers", default="host,disk")
    parser.add_argument("--tier-mem", default="48GiB", help="the host tier's, or the disk tier's, size")
    parser.add_argument("--max-boundary-states", type=int, default=0,
                        help="CachedPrefill's: recurrent states saved per prompt (0: at every chunk boundary)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--json", required=True, help="written after every case")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    report = {"environment": environment(args), "params": vars(args), "cases": []}
    longest = max(int(x) for x in args.lengths.split(","))
    models: dict[str, object] = {}  # built once each (the cases alternate shapes); 0.8B + 4B in bf16: ~10 GB
    for shape_name, length in cases(args):
        if shape_name not in models:
            models[shape_name] = build_model(SHAPES[shape_name], args.device, DTYPES[args.dtype], longest)
        try:
            case = one_case(shape_name, length, args, models[shape_name])
        except torch.OutOfMemoryError as error:  # said, and the smaller cases kept
            case = {"shape": shape_name, "prompt_tokens": length, "error": f"out of memory: {error}"[:300]}
        report["cases"].append(case)
        write_report(report, args.json)
        print(summary_line(case), flush=True)


def summary_line(case: dict) -> str:
    head = f"{case['shape']} {case['prompt_tokens']:>7} tokens:"
    if "error" in case:
        return f"{head} {case['error']}"
    cells = [f"alone {case['model_alone_ttft_s'] * 1e3:,.0f} ms"]
    for tier, runs in case["tiers"].items():
        hit = runs["hit"]
        load = f"{hit['load_gb_s']:.1f}" if hit["load_gb_s"] else "-"
        pinned = f"{hit['pinned_h2d_gb_s']:.1f}" if hit["pinned_h2d_gb_s"] else "-"
        cells.append(f"{tier}: cold {runs['cold']['ttft_s'] * 1e3:,.0f} ms, hit {hit['ttft_s'] * 1e3:,.0f} ms "
                     f"({hit['hit_tokens']} tokens, load {load} GB/s vs pinned {pinned}, next token "
                     f"{'equal' if hit['next_token_equal'] else 'DIFFERS'})")
    return f"{head} " + "; ".join(cells)


if __name__ == "__main__":
    main()
