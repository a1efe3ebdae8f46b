"""The simple same-host API, one call per chunk: `client.put` and `client.get` of 16 MiB chunks (a fresh `bytes`
per get), `client.get(..., into=buffer)` into one reused buffer, next to memcpy measured in the same run; with
`--tune-allocator` the client process first calls `tiercache.tune_allocator()` (glibc keeps freed large buffers for
reuse: no page faults on the next get's bytes). `put_many` / `get_many` into buffers are benchmarks/throughput.py's.

    .venv/bin/python -m benchmarks.simple_api [--chunks 32] [--chunk-size 16MiB] [--rounds 3] [--tune-allocator]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

import tiercache
from tiercache.client import Client
from tiercache.config import parse_size
from tiercache.process import ServerProcess


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, default=32)
    parser.add_argument("--chunk-size", type=parse_size, default=parse_size("16MiB"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tune-allocator", action="store_true")
    args = parser.parse_args()
    if args.tune_allocator:
        tiercache.tune_allocator()
    size, n = args.chunk_size, args.chunks
    data = os.urandom(size)
    source, target = np.frombuffer(data, np.uint8), np.empty(size, np.uint8)
    rates: dict[str, list[float]] = {"memcpy": [], "put": [], "get": [], "get_out": []}
    reused = bytearray(size)
    with ServerProcess("--host-mem", str(2 * size * n + (64 << 20)), "--disk-size", "0") as server, \
            Client.from_url(server.url) as client:
        assert client.same_host, "the server's arena cannot be mapped here"
        for _ in range(args.rounds):
            started = time.perf_counter()
            for _ in range(n):
                np.copyto(target, source)
            rates["memcpy"].append(size * n / (time.perf_counter() - started) / 1e9)
            started = time.perf_counter()
            for i in range(n):
                client.put("simple", b"k%d" % i, data)
            rates["put"].append(size * n / (time.perf_counter() - started) / 1e9)
            started = time.perf_counter()
            for i in range(n):
                assert len(client.get("simple", b"k%d" % i)) == size
            rates["get"].append(size * n / (time.perf_counter() - started) / 1e9)
            started = time.perf_counter()
            for i in range(n):
                assert len(client.get("simple", b"k%d" % i, into=reused)) == size
            rates["get_out"].append(size * n / (time.perf_counter() - started) / 1e9)
    memcpy = statistics.median(rates["memcpy"])
    print(f"{n} x {size >> 20} MiB, one call per chunk, same host{' (tune_allocator)' if args.tune_allocator else ''}")
    for name in ("memcpy", "put", "get", "get_out"):
        rate = statistics.median(rates[name])
        print(f"  {name:<7}{rate:>7.2f} GB/s{'' if name == 'memcpy' else f'   {rate / memcpy:.2f} x memcpy'}")


if __name__ == "__main__":
    main()
