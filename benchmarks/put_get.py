"""Put/get throughput of 4 MiB chunks, one call per chunk, client -> `tiercache serve`, next to a raw loopback socket.

Starts its own server (host tier big enough for the working set, so this measures the call path, not eviction)
unless --server is given. `--path same-host` moves payloads through the shared-memory arena, `--path data` over the
data channel (the remote path), `--path grpc` streams them over gRPC. Prints medians of --repeat rounds and the
ratio to the raw socket measured in the same run. For batched calls and every other baseline see
benchmarks/throughput.py.

    .venv/bin/python -m benchmarks.put_get [--path data|grpc|same-host] [--chunks 64] [--chunk-size 4MiB] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from benchmarks.throughput import loopback_socket
from lab.common import write_report
from tiercache.client import Client
from tiercache.config import format_size, parse_size
from tiercache.process import ServerProcess


def loopback_socket_gbps(size: int, count: int) -> float:
    """Raw TCP over loopback: sendall from one buffer, recv_into a preallocated one (benchmarks/throughput.py)."""
    payload = np.frombuffer(os.urandom(size), dtype=np.uint8)
    return loopback_socket([payload] * count, repeat=1)


def tiercache_gbps(url: str, size: int, count: int, path: str) -> tuple[float, float]:
    chunks = [os.urandom(size) for _ in range(min(count, 8))]
    keys = [b"bench-%06d" % i for i in range(count)]
    with Client.from_url(url, same_host=path == "same-host", data_channel=path == "data") as client:
        start = time.perf_counter()
        for i, key in enumerate(keys):
            client.put("bench", key, chunks[i % len(chunks)])
        put_s = time.perf_counter() - start
        start = time.perf_counter()
        for i, key in enumerate(keys):
            data = client.get("bench", key)
            assert data is not None and len(data) == size
        get_s = time.perf_counter() - start
        client.delete("bench", keys)
    return size * count / put_s / 1e9, size * count / get_s / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, default=64)
    parser.add_argument("--chunk-size", type=parse_size, default=parse_size("4MiB"))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--server", help="use a running server instead of starting one")
    parser.add_argument("--path", choices=["data", "grpc", "same-host"], default="data")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    server = None
    url = args.server
    if url is None:
        host_mem = args.chunk_size * args.chunks * 2 + (64 << 20)
        server = ServerProcess("--host-mem", str(host_mem), "--disk-size", "0").start()
        url = server.url
    try:
        rounds = {"socket": [], "put": [], "get": []}
        for _ in range(args.repeat):
            rounds["socket"].append(loopback_socket_gbps(args.chunk_size, args.chunks))
            put, get = tiercache_gbps(url, args.chunk_size, args.chunks, args.path)
            rounds["put"].append(put)
            rounds["get"].append(get)
    finally:
        if server is not None:
            server.kill()
    medians = {name: statistics.median(values) for name, values in rounds.items()}
    result = {"path": args.path, "chunk_bytes": args.chunk_size, "chunks": args.chunks, "repeat": args.repeat,
              "gbps": medians, "ratio_to_socket": {k: medians[k] / medians["socket"] for k in ("put", "get")}}
    if args.json:
        write_report(result)
        return
    print(f"{args.chunks} chunks of {format_size(args.chunk_size)}, median of {args.repeat} rounds")
    print(f"{'path':<28}{'GB/s':>8}{'x socket':>10}")
    print(f"{'raw loopback socket':<28}{medians['socket']:>8.2f}{1:>10.2f}")
    for name in ("put", "get"):
        label = f"tiercache {name} ({args.path})"
        print(f"{label:<28}{medians[name]:>8.2f}{medians[name] / medians['socket']:>10.2f}")


if __name__ == "__main__":
    main()
