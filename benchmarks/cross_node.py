"""Cross-node hits: a prefix computed through node A is reused through node B, over one Redis and over Redis Cluster.

Two tiercache servers (separate processes, each with its own host tier) share one Redis (or a 3+3 Redis Cluster);
A writes through. For each shared prefix: a request through A computes and stores it; then a request through B with
another suffix finds it in Redis (B's local tiers are empty), and a second one through B finds it in B's host tier
(the first B hit promoted it). Prints hit tokens and TTFT of each step, against the model alone (baseline, measured
in the same run) and against the same-node hit through A.

    .venv/bin/python -m benchmarks.cross_node [--hidden 512] [--layers 8] [--prefixes 4] [--json]
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np

from benchmarks.hf_ttft import add_model_arguments, baseline_ms, describe_model
from lab.common import write_report
from testkit.redis_processes import RedisClusterProcess, RedisProcess
from tiercache.client import Client
from tiercache.connector.hf.prefill import CachedPrefill
from tiercache.demo import qwen35_model
from tiercache.process import ServerProcess

STEPS = ("A cold", "A warm (same node)", "B first (from Redis)", "B again (B's host tier)")


def _node(redis_url: str, cluster: bool, *extra: str) -> ServerProcess:
    args = ["--host-mem", "2GiB", "--disk-size", "0", "--redis-url", redis_url, *extra]
    return ServerProcess(*args, *(["--redis-cluster"] if cluster else []))


def _request(cached: CachedPrefill, tokens: np.ndarray) -> dict:
    result = cached.prefill(tokens)
    return {"hit_tokens": result.hit_tokens, "ttft_ms": 1000 * cached.last_ttft_s}


def measure(model, redis_url: str, cluster: bool, prefixes: list[np.ndarray], suffixes) -> dict:
    with _node(redis_url, cluster, "--write-through") as node_a, _node(redis_url, cluster) as node_b, \
            Client.from_url(node_a.url, timeout_s=300) as a, Client.from_url(node_b.url, timeout_s=300) as b:
        through_a = CachedPrefill(model, a, model_name="bench/cross-node")
        through_b = CachedPrefill(model, b, model_name="bench/cross-node")
        runs = {step: [] for step in STEPS}
        for prefix in prefixes:
            for step, cached, suffix in zip(STEPS, (through_a, through_a, through_b, through_b), suffixes):
                runs[step].append(_request(cached, np.concatenate([prefix, suffix])))
        stats_b = b.stats()
    redis_hits = stats_b["delivered"]["loaded_tokens_by_tier"].get("redis", 0)  # what node B's loads read from Redis
    return {"shared_tier": "redis-cluster (3+3)" if cluster else "redis", "chunk_tokens": through_a.spec.chunk_tokens,
            "steps": {step: {"hit_tokens": statistics.median(r["hit_tokens"] for r in rs),
                             "ttft_ms": statistics.median(r["ttft_ms"] for r in rs)} for step, rs in runs.items()},
            "node_b_hit_tokens_from_redis": redis_hits}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--prefixes", type=int, default=4, help="shared prefixes, each requested 4 times")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    model = qwen35_model(hidden=args.hidden, layers=args.layers)
    rng = np.random.default_rng(0)
    prefixes = [rng.integers(0, model.config.vocab_size, args.prefix) for _ in range(args.prefixes)]
    suffixes = [rng.integers(0, model.config.vocab_size, args.suffix) for _ in STEPS]
    baseline = statistics.median(baseline_ms(model, np.concatenate([prefixes[0], s])) for s in suffixes[:3])
    results = []
    redis = RedisProcess().start()
    try:
        results.append(measure(model, redis.url, False, prefixes, suffixes))
    finally:
        redis.stop()
    cluster = RedisClusterProcess().start()
    try:
        results.append(measure(model, cluster.url, True, prefixes, suffixes))
    finally:
        cluster.stop()
    report = {"model": describe_model(args), "prompt_tokens": args.prefix + args.suffix, "baseline_ttft_ms": baseline,
              "results": results}
    if args.json:
        write_report(report)
        return
    print(f"{report['model']}; {args.prefixes} prefixes of {args.prefix} tokens + {args.suffix}-token suffixes; "
          f"N = {results[0]['chunk_tokens']}; medians over prefixes")
    print(f"baseline (model alone, no cache): TTFT {baseline:.0f} ms")
    for r in results:
        print(f"\nshared tier: {r['shared_tier']}  (node B hit tokens served from Redis: "
              f"{r['node_b_hit_tokens_from_redis']})")
        print(f"{'step':<26}{'hit tokens':>11}{'TTFT ms':>9}{'/baseline':>11}{'/same-node':>12}")
        same_node = r["steps"]["A warm (same node)"]["ttft_ms"]
        for step, s in r["steps"].items():
            print(f"{step:<26}{s['hit_tokens']:>11.0f}{s['ttft_ms']:>9.0f}{s['ttft_ms'] / baseline:>11.3f}"
                  f"{s['ttft_ms'] / same_node:>12.3f}")


if __name__ == "__main__":
    main()
