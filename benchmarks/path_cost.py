"""What a same-host call costs by payload path: CPU seconds of the client process (its gRPC threads included) and of
the server process per put_many / get_many of a batch, and wall time, for the arena (Reserve + copy + Commit, Acquire +
copy + Release), the data channel (one round trip on a local socket) and the client's own choice (client.chooser:
the data channel below ARENA_MIN_BYTES a call, the arena above). Baseline measured in the same run: one memcpy of the
batch's bytes. This is what sets ARENA_MIN_BYTES: where the two paths' total CPU cross.

A CPU engine's saves run on the cores its scheduler needs (docs/vllm.md), so CPU per call, not only wall time, is
what a connector's saves cost the engine.

    .venv/bin/python -m benchmarks.path_cost [--sizes 64KiB,256KiB,512KiB,1MiB,4MiB] [--batch 4] [--calls 200] [--json]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from lab.common import write_report
from tiercache.client import Client
from tiercache.client.chooser import ARENA_MIN_BYTES
from tiercache.config import format_size, parse_size
from tiercache.process import ServerProcess

HOST_BYTES = 2 << 30
PATHS = {"arena": {"same_host": True}, "data channel": {"same_host": False}, "chosen": {}}


def cpu_s(pid: int | str = "self") -> float:
    """User + system CPU seconds of a whole process (every thread), from /proc."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def memcpy_ms(size: int, batch: int, rounds: int) -> float:
    source, target = np.frombuffer(os.urandom(size * batch), np.uint8), np.empty(size * batch, np.uint8)
    start = time.perf_counter()
    for _ in range(rounds):
        np.copyto(target, source)
    return 1e3 * (time.perf_counter() - start) / rounds


def measure(url: str, server_pid: int, options: dict, size: int, batch: int, calls: int) -> dict:
    """{op: (client CPU ms, server CPU ms, wall ms) per call} for puts, then gets into the caller's buffers."""
    payload = os.urandom(size)
    namespace = "path-cost-%d" % size  # each measure deletes its keys: the next one starts on an empty namespace
    keys = [[b"k%06d-%02d" % (call, i) for i in range(batch)] for call in range(calls)]
    buffers = [bytearray(size) for _ in range(batch)]
    answer = {}
    with Client.from_url(url, **options) as client:
        client.put_many(namespace, [(b"warm-%02d" % i, payload) for i in range(batch)])  # attach, map, connect
        client.get_many(namespace, [b"warm-%02d" % i for i in range(batch)], buffers)
        for op in ("put", "get"):
            client_start, server_start, wall_start = cpu_s(), cpu_s(server_pid), time.perf_counter()
            for call in range(calls):
                if op == "put":
                    client.put_many(namespace, [(key, payload) for key in keys[call]])
                else:
                    got = client.get_many(namespace, keys[call], buffers)
                    assert all(f is not None and len(f.data) == size for f in got), "a chunk went missing"
            answer[op] = tuple(1e3 * x / calls for x in (cpu_s() - client_start, cpu_s(server_pid) - server_start,
                                                          time.perf_counter() - wall_start))
        client.delete(namespace, [key for call in keys for key in call])
    return answer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="64KiB,256KiB,512KiB,1MiB,4MiB", help="chunk sizes, comma-separated")
    parser.add_argument("--batch", type=int, default=4, help="chunks per call")
    parser.add_argument("--megabytes", type=int, default=256, help="bytes moved per path, size and op, at least")
    parser.add_argument("--calls", type=int, default=200, help="calls per path, size and op, at least (CPU time is "
                        "counted in clock ticks: enough calls make them count)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    rows = []
    with ServerProcess("--host-mem", f"{HOST_BYTES >> 20}MiB", "--disk-size", "0") as server:
        for size in sizes:
            # Enough calls to count ticks, at most what the host tier holds (a get must find every chunk).
            calls = min(max(args.calls, args.megabytes * 2**20 // (size * args.batch)),
                        HOST_BYTES // 2 // (size * args.batch))
            row = {"chunk_bytes": size, "batch": args.batch, "calls": calls,
                   "memcpy_ms": memcpy_ms(size, args.batch, calls)}
            for name, options in PATHS.items():
                row[name] = measure(server.url, server.process.pid, options, size, args.batch, calls)
            rows.append(row)
    if args.json:
        write_report({"arena_min_bytes": ARENA_MIN_BYTES, "rows": rows})
        return
    print(f"per call of {args.batch} chunks: client CPU + server CPU = total (wall) in ms; ratio: total CPU / arena's; "
          f"chosen: data channel below {format_size(ARENA_MIN_BYTES)} a call")
    for row in rows:
        print(f"\n{format_size(row['chunk_bytes'])} x {row['batch']} ({row['calls']} calls; memcpy of the batch "
              f"{row['memcpy_ms']:.3f} ms)")
        for op in ("put", "get"):
            arena_total = sum(row["arena"][op][:2])
            for name in PATHS:
                client_ms, server_ms, wall_ms = row[name][op]
                total = client_ms + server_ms
                print(f"  {op} {name:13s} {client_ms:6.3f} + {server_ms:6.3f} = {total:6.3f} ({wall_ms:6.3f})   "
                      f"x{total / arena_total:.2f}" if arena_total else "")


if __name__ == "__main__":
    main()
