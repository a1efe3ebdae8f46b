"""Time to first token with and without tiercache, per tier, on a transformers model with real prefill cost.

A 2,048-token shared prefix followed by 32-token suffixes: the first request computes everything and stores the
prefix; later requests with other suffixes reuse it (up to the chunk boundary below the end of the prefix) and
compute only the rest. For each tier (host / disk / redis, one server with only that tier), prints the baseline
(the model alone, no cache), the cold request through tiercache, and the median warm TTFT, with warm/baseline ratios.
TTFT = lookup + load + compute: the first token's logits exist then; the save that follows is reported apart.

    .venv/bin/python -m benchmarks.hf_ttft [--hidden 512] [--layers 8] [--warm 5] [--json]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from lab.common import write_report
from testkit.redis_processes import RedisProcess
from tiercache.client import Client
from tiercache.connector.hf.prefill import CachedPrefill
from tiercache.demo import qwen35_model
from tiercache.process import ServerProcess

TIERS = {
    "host": ["--host-mem", "2GiB", "--disk-size", "0"],
    "disk": ["--host-mem", "0", "--disk-size", "4GiB"],
    "redis": ["--host-mem", "0", "--disk-size", "0"],
}


@torch.no_grad()
def baseline_ms(model, tokens: np.ndarray) -> float:
    started = time.perf_counter()
    model(torch.as_tensor(tokens)[None])
    return 1000 * (time.perf_counter() - started)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model and prompt shape options the transformers benchmarks share."""
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--prefix", type=int, default=2048)
    parser.add_argument("--suffix", type=int, default=32)


def describe_model(args: argparse.Namespace) -> str:
    return f"Qwen3.5 architecture, hidden {args.hidden}, {args.layers} layers, random weights, fp32, CPU"


def measure_tier(model, tier: str, prefix: np.ndarray, suffixes: list[np.ndarray], redis_url: str | None) -> dict:
    args = list(TIERS[tier])  # the disk tier in the server's own scratch folder
    if tier == "redis":
        args += ["--redis-url", redis_url]
    with ServerProcess(*args) as server, Client.from_url(server.url, timeout_s=300) as client:
        cached = CachedPrefill(model, client, model_name=f"bench/ttft-{tier}")
        runs = []
        for suffix in suffixes:
            result = cached.prefill(np.concatenate([prefix, suffix]))
            t = cached.last_timings
            runs.append({"hit_tokens": result.hit_tokens, "ttft_ms": 1000 * cached.last_ttft_s,
                         **{f"{k}_ms": 1000 * v for k, v in t.items()}})
    warm = runs[1:]
    return {"tier": tier, "chunk_tokens": cached.spec.chunk_tokens, "cold": runs[0], "warm": warm,
            "warm_ttft_ms": statistics.median(r["ttft_ms"] for r in warm),
            "warm_hit_tokens": statistics.median(r["hit_tokens"] for r in warm)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--warm", type=int, default=5, help="warm requests per tier")
    parser.add_argument("--tiers", default="host,disk,redis")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    model = qwen35_model(hidden=args.hidden, layers=args.layers)
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, model.config.vocab_size, args.prefix)
    suffixes = [rng.integers(0, model.config.vocab_size, args.suffix) for _ in range(args.warm + 1)]
    baseline = statistics.median(baseline_ms(model, np.concatenate([prefix, s])) for s in suffixes[:3])
    redis = RedisProcess().start() if "redis" in args.tiers else None
    try:
        results = [measure_tier(model, tier, prefix, suffixes, redis.url if redis else None)
                   for tier in args.tiers.split(",")]
    finally:
        if redis is not None:
            redis.stop()
    report = {"model": describe_model(args), "prompt_tokens": args.prefix + args.suffix, "baseline_ttft_ms": baseline,
              "tiers": results}
    if args.json:
        write_report(report)
        return
    print(f"{report['model']}; {args.prefix}-token shared prefix + {args.suffix}-token suffixes; "
          f"N = {results[0]['chunk_tokens']}")
    print(f"baseline (model alone, no cache): TTFT {baseline:.0f} ms")
    print(f"{'tier':<6}{'cold ms':>9}{'warm ms':>9}{'warm hit':>10}{'warm/baseline':>15}{'warm/cold':>11}"
          f"{'save ms (cold)':>16}")
    for r in results:
        cold = r["cold"]["ttft_ms"]
        print(f"{r['tier']:<6}{cold:>9.0f}{r['warm_ttft_ms']:>9.0f}{r['warm_hit_tokens']:>10.0f}"
              f"{r['warm_ttft_ms'] / baseline:>15.3f}{r['warm_ttft_ms'] / cold:>11.3f}{r['cold']['save_ms']:>16.0f}")


if __name__ == "__main__":
    main()
