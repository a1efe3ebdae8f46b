"""What a prefix lookup costs an engine when the cache server is dead or hung, with and without the circuit breaker.

An engine's scheduler waits on every lookup. Three servers: *healthy* (`tiercache serve`), *dead* (its port closed)
and *hung* (the same server stopped with SIGSTOP: the kernel still accepts connections, nothing answers). Two
clients the way the vLLM connector builds them (one try, `--deadline` seconds): with the breaker
(`tiercache.client.breaker`) and without it (the baseline, measured in the same run). For each: the first lookup,
then `--lookups` more (p50 / p99 / max), and the ratio of the breaker's p50 to the healthy server's.

    .venv/bin/python -m benchmarks.sick_server [--lookups 50] [--tokens 8192] [--deadline 0.5] [--json-out F]
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import time

import numpy as np

from lab.common import percentile, write_report
from tiercache.client import BreakerPolicy, Client, RetryPolicy
from tiercache.connector import PrefixCache
from tiercache.prefix.objects import CacheSpec
from tiercache.prefix.presets import preset
from tiercache.process import ServerProcess, free_port


def lookup_ms(url: str, breaker: bool, prompts: list, deadline_s: float) -> dict:
    """The first lookup's time, then the distribution over the rest (ms)."""
    spec = CacheSpec.for_layout(preset("qwen3.5-0.8b"))
    client = Client.from_url(url, timeout_s=deadline_s, retry=RetryPolicy(attempts=1),
                             breaker=BreakerPolicy() if breaker else None)
    with client:
        cache = PrefixCache(client, spec)
        times, reached = [], []
        for tokens in prompts:
            start = time.perf_counter()
            lookup = cache.lookup(tokens)
            times.append((time.perf_counter() - start) * 1e3)
            reached.append(lookup.reached)
    rest = sorted(times[1:])
    return {"first_ms": times[0], "p50_ms": percentile(rest, 50), "p99_ms": percentile(rest, 99),
            "max_ms": rest[-1], "reached": sum(reached), "lookups": len(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lookups", type=int, default=50, help="lookups after the first, per case")
    parser.add_argument("--tokens", type=int, default=8192, help="prompt length")
    parser.add_argument("--deadline", type=float, default=0.5, help="the lookup deadline (vLLM's lookup_timeout_s)")
    parser.add_argument("--json-out", help="also write the results here")
    args = parser.parse_args()
    logging.getLogger("tiercache").setLevel(logging.ERROR)  # a failed lookup per call is the point, not news
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 150_000, args.tokens).tolist() for _ in range(args.lookups + 1)]
    results: dict[str, dict] = {}
    server = ServerProcess("--host-mem", "64MiB", "--disk-size", "0").start()
    try:
        for breaker in (True, False):
            results[f"healthy/{'breaker' if breaker else 'none'}"] = lookup_ms(server.url, breaker, prompts,
                                                                             args.deadline)
        os.kill(server.process.pid, signal.SIGSTOP)
        try:
            for breaker in (True, False):
                results[f"hung/{'breaker' if breaker else 'none'}"] = lookup_ms(server.url, breaker, prompts,
                                                                              args.deadline)
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
    finally:
        server.kill()
    dead = f"grpc://127.0.0.1:{free_port()}"
    for breaker in (True, False):
        results[f"dead/{'breaker' if breaker else 'none'}"] = lookup_ms(dead, breaker, prompts, args.deadline)

    healthy = results["healthy/breaker"]["p50_ms"]
    print(f"prefix lookups of {args.tokens} tokens, deadline {args.deadline} s, {args.lookups} after the first")
    print(f"{'server/client':<18}{'first ms':>10}{'p50 ms':>10}{'p99 ms':>10}{'max ms':>10}{'reached':>9}"
          f"{'p50 / healthy':>15}")
    for name, r in results.items():
        print(f"{name:<18}{r['first_ms']:>10.1f}{r['p50_ms']:>10.2f}{r['p99_ms']:>10.2f}{r['max_ms']:>10.2f}"
              f"{r['reached']:>9}{r['p50_ms'] / healthy:>15.2f}")
    if args.json_out:
        write_report({"tokens": args.tokens, "deadline_s": args.deadline, "results": results}, args.json_out)


if __name__ == "__main__":
    main()
