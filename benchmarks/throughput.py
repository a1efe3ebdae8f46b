"""Throughput of every data path next to the baselines that bound it, measured in ONE run.

For chunk sizes 1, 4 and 16 MiB (a working set of --set-mib per size), in GB/s (medians of --repeat rounds):
  memcpy                 numpy copy into a preallocated, pre-faulted buffer
  loopback socket        sendall / recv_into over 127.0.0.1
  file write / +fsync    raw files in a temp dir; cold read after posix_fadvise(DONTNEED), warm read from page cache
  redis-py SET / GET     against a redis-server this script starts
  tiercache same-host    put_many through the shared-memory arena / get_many into preallocated buffers
  redis-py pipelined     the same, all SETs (GETs) of a round in one pipeline
  tiercache remote       put_many / get_many over the data channel (same_host=False: a plain socket beside gRPC)
  tiercache remote gRPC  the same streamed over gRPC (data_channel=False), what remote clients used before
  disk tier              DiskTier.put / get in-process (what the server does below the RPC layer)
  redis tier             RedisTier.put / get in-process
  LMCache store/retrieve  with --lmcache-venv: LMCache's multiprocess server (shared-memory transfer mode) started
                         from that venv and driven by its own `lmcache bench server --mode cpu`, with a KV shape
                         whose 256-token chunks have the same byte size
and the ratios docs/performance.md tracks against its targets. The remote path and redis-py are also measured
interleaved (redis-py SET, tiercache put, redis-py GET, tiercache get, round after round): on a shared machine the speed
drifts between phases, so `remote_vs_redis_py` is the median of the per-round ratios (`remote_vs_redis_py_rounds`), each
taken under the same conditions. Writes JSON (--json-out) and a PNG chart (--plot).

    .venv/bin/python -m benchmarks.throughput [--quick] [--sizes 1,4,16] [--set-mib 256] [--repeat 3]
                                              [--lmcache-venv /path/to/venv]

An LMCache venv that worked here (kept out of the project's dependencies; it pins other protobuf/torch builds):
    python3 -m venv /tmp/lmvenv && /tmp/lmvenv/bin/pip install torch==2.13.0 && \
    /tmp/lmvenv/bin/pip install lmcache==0.5.6 --no-deps && /tmp/lmvenv/bin/pip install requests aiofile aiofiles \
      aiohttp blake3 cachetools cryptography fastapi httptools httpx msgspec numba nvtx prometheus_client psutil \
      py-cpuinfo pyyaml pyzmq redis safetensors sortedcontainers uvicorn transformers setuptools_scm \
      opentelemetry-api opentelemetry-sdk opentelemetry-exporter-prometheus opentelemetry-exporter-otlp
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import tempfile
import threading
import time
from typing import Callable

import numpy as np
import redis

from lab.common import write_report
from testkit.redis_processes import RedisProcess
from tiercache.client import Client
from tiercache.config import DiskTierConfig, MiB, RedisTierConfig
from tiercache.malloc import tune_allocator
from tiercache.process import ServerProcess
from tiercache.record import encoding
from tiercache.record.keys import ChunkKey
from tiercache.tiers.disk import DiskTier
from tiercache.tiers.redis import RedisTier


def rate(total_bytes: int, action: Callable[[], None], repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        started = time.perf_counter()
        action()
        samples.append(time.perf_counter() - started)
    return total_bytes / statistics.median(samples) / 1e9


def memcpy(payloads, repeat):
    outs = [np.empty_like(p) for p in payloads]
    for out in outs:
        out.fill(0)  # pre-fault

    def run():
        for src, dst in zip(payloads, outs):
            np.copyto(dst, src)
    return rate(sum(p.nbytes for p in payloads), run, repeat)


def loopback_socket(payloads, repeat):
    size, total = payloads[0].nbytes, sum(p.nbytes for p in payloads)

    def run():
        listener = socket.create_server(("127.0.0.1", 0))
        buf = memoryview(bytearray(size))

        def sink():
            conn, _ = listener.accept()
            received = 0
            while received < total:
                received += conn.recv_into(buf, min(size, total - received))
            conn.sendall(b"k")
            conn.close()

        thread = threading.Thread(target=sink)
        thread.start()
        with socket.create_connection(listener.getsockname()) as s:
            for p in payloads:
                s.sendall(p)
            s.recv(1)
        thread.join()
        listener.close()
    return rate(total, run, repeat)


def files(payloads, repeat, fsync: bool):
    root = tempfile.mkdtemp(prefix="tiercache-bench-files-")
    total = sum(p.nbytes for p in payloads)
    paths = [os.path.join(root, f"f{i}") for i in range(len(payloads))]

    def write():
        for path, p in zip(paths, payloads):
            with open(path, "wb", buffering=0) as f:
                f.write(p)
                if fsync:
                    os.fsync(f.fileno())
    write_gbps = rate(total, write, repeat)
    out = bytearray(payloads[0].nbytes)

    def read(cold: bool):
        def run():
            for path in paths:
                with open(path, "rb", buffering=0) as f:
                    if cold:
                        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                    f.readinto(out)
        return run
    cold = rate(total, read(True), repeat)
    warm = rate(total, read(False), repeat)
    shutil.rmtree(root)
    return write_gbps, cold, warm


def redis_py(payloads, repeat, url):
    r = redis.Redis.from_url(url)
    total = sum(p.nbytes for p in payloads)
    keys = [b"bench:%d" % i for i in range(len(payloads))]
    set_gbps = rate(total, lambda: [r.set(k, memoryview(p)) for k, p in zip(keys, payloads)], repeat)
    get_gbps = rate(total, lambda: [r.get(k) for k in keys], repeat)
    r.flushall()

    def pipelined(command):
        def run():
            pipe = r.pipeline(transaction=False)
            for k, p in zip(keys, payloads):
                command(pipe, k, p)
            pipe.execute()
        return run
    pipe_set = rate(total, pipelined(lambda pipe, k, p: pipe.set(k, memoryview(p))), repeat)
    pipe_get = rate(total, pipelined(lambda pipe, k, p: pipe.get(k)), repeat)
    r.flushall()
    return set_gbps, get_gbps, pipe_set, pipe_get


def tiercache_paths(payloads, repeat, url, same_host: bool, data_channel: bool = True):
    total = sum(p.nbytes for p in payloads)
    keys = [b"bench-%d" % i for i in range(len(payloads))]
    with Client.from_url(url, same_host=same_host, timeout_s=300, data_channel=data_channel) as client:
        assert client.same_host == same_host
        put = rate(total, lambda: client.put_many("bench", list(zip(keys, payloads))), repeat)
        if same_host:
            outs = [bytearray(p.nbytes) for p in payloads]
            get = rate(total, lambda: client.get_many("bench", keys, outs), repeat)
        else:
            get = rate(total, lambda: client.get_many("bench", keys), repeat)
        client.delete("bench", keys)
    return put, get


def remote_vs_redis_py(payloads, rounds, url, redis_url) -> list[float]:
    """Per round: (tiercache remote put + get) / (redis-py SET + GET) on the same payloads, measured back to back."""
    r = redis.Redis.from_url(redis_url)
    total = sum(p.nbytes for p in payloads)
    keys = [b"bench-%d" % i for i in range(len(payloads))]
    ratios = []
    with Client.from_url(url, same_host=False, timeout_s=300) as client:
        for _ in range(rounds):
            redis_set = rate(total, lambda: [r.set(k, memoryview(p)) for k, p in zip(keys, payloads)], 1)
            put = rate(total, lambda: client.put_many("bench", list(zip(keys, payloads))), 1)
            redis_get = rate(total, lambda: [r.get(k) for k in keys], 1)
            get = rate(total, lambda: client.get_many("bench", keys), 1)
            ratios.append((put + get) / (redis_set + redis_get))
        client.delete("bench", keys)
    r.flushall()
    return ratios


def tier_in_process(tier, payloads, repeat):
    keys = [ChunkKey("bench", b"t-%d" % i) for i in range(len(payloads))]
    records = [encoding.encode(k, p) for k, p in zip(keys, payloads)]
    total = sum(len(r) for r in records)

    def put():  # the tier holds the whole set: its rooms are ready at once, nothing is evicted
        for k, r in zip(keys, records):
            tier.put(tier.make_room(k, encoding.read_meta(r), len(r), read_victims=False), r)

    def get():  # each record is verified, then dropped, as the server does after sending it
        for k in keys:
            encoding.decode(tier.get(k), k)

    put_gbps, get_gbps = rate(total, put, repeat), rate(total, get, repeat)
    tier.delete(keys)
    return put_gbps, get_gbps


def measure(size: int, set_bytes: int, repeat: int, shared_url: str, remote_url: str, redis_url: str,
            lmcache_venv: str | None) -> dict:
    count = max(set_bytes // size, 2)
    rng = np.random.default_rng(size)
    payloads = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(count)]
    row = {"chunk_bytes": size, "chunks": count}
    row["memcpy"] = memcpy(payloads, repeat)
    row["loopback_socket"] = loopback_socket(payloads, repeat)
    row["file_write"], row["file_read_cold"], row["file_read_warm"] = files(payloads, repeat, fsync=False)
    row["file_write_fsync"], _, _ = files(payloads, repeat, fsync=True)
    (row["redis_py_set"], row["redis_py_get"], row["redis_py_pipeline_set"],
     row["redis_py_pipeline_get"]) = redis_py(payloads, repeat, redis_url)
    row["same_host_put"], row["same_host_get"] = tiercache_paths(payloads, repeat, shared_url, True)
    row["remote_put"], row["remote_get"] = tiercache_paths(payloads, repeat, remote_url, False)
    row["remote_grpc_put"], row["remote_grpc_get"] = tiercache_paths(payloads, repeat, remote_url, False,
                                                                     data_channel=False)
    row["remote_vs_redis_py_rounds"] = remote_vs_redis_py(payloads, max(repeat, 5), remote_url, redis_url)
    disk_dir = tempfile.mkdtemp(prefix="tiercache-bench-disk-")
    disk = DiskTier(DiskTierConfig(path=disk_dir, capacity_bytes=2 * set_bytes + 64 * MiB))
    row["disk_tier_put"], row["disk_tier_get"] = tier_in_process(disk, payloads, repeat)
    shutil.rmtree(disk_dir)
    redis_tier = RedisTier(RedisTierConfig(url=redis_url))
    row["redis_tier_put"], row["redis_tier_get"] = tier_in_process(redis_tier, payloads, repeat)
    redis_tier.close()
    if lmcache_venv:
        row["lmcache_store"], row["lmcache_retrieve"] = lmcache(lmcache_venv, size, repeat)
    row["ratios"] = {
        "same_host_vs_memcpy": (row["same_host_put"] + row["same_host_get"]) / 2 / row["memcpy"],
        "remote_vs_redis_py": statistics.median(row["remote_vs_redis_py_rounds"]),
        "remote_vs_redis_py_phases": (row["remote_put"] + row["remote_get"]) / (row["redis_py_set"]
                                                                               + row["redis_py_get"]),
        # against redis-py's better way for each direction: the stricter ratio
        "remote_vs_best_redis_py": (row["remote_put"] + row["remote_get"]) / (
            max(row["redis_py_set"], row["redis_py_pipeline_set"]) + max(row["redis_py_get"],
                                                                         row["redis_py_pipeline_get"])),
        "remote_grpc_vs_redis_py": (row["remote_grpc_put"] + row["remote_grpc_get"]) / (row["redis_py_set"]
                                                                                       + row["redis_py_get"]),
        "disk_tier_put_vs_file_write": row["disk_tier_put"] / row["file_write"],
        "disk_tier_get_vs_file_read_warm": row["disk_tier_get"] / row["file_read_warm"],
        "redis_tier_vs_redis_py": (row["redis_tier_put"] + row["redis_tier_get"]) / (row["redis_py_set"]
                                                                                     + row["redis_py_get"]),
    }
    if lmcache_venv:
        row["ratios"]["same_host_put_vs_lmcache_store"] = row["same_host_put"] / row["lmcache_store"]
        row["ratios"]["same_host_get_vs_lmcache_retrieve"] = row["same_host_get"] / row["lmcache_retrieve"]
    return row


def lmcache(venv: str, size: int, repeat: int) -> tuple[float, float]:
    """LMCache's own server benchmark, 2048 tokens per request in 256-token chunks of `size` bytes (bf16, 8 heads x
    128 dims: 1 MiB per chunk per layer). Returns (store, retrieve) GB/s from its p50 latencies."""
    import subprocess

    layers = max(size // MiB, 1)
    rpc, http = free_ports(2)
    env = {**os.environ, "LMCACHE_DISABLE_BANNER": "1"}
    lm = os.path.join(venv, "bin", "lmcache")
    server = subprocess.Popen([lm, "server", "--host", "127.0.0.1", "--port", str(rpc), "--http-port", str(http),
                               "--chunk-size", "256", "--l1-size-gb", "4", "--eviction-policy", "LRU",
                               "--supported-transfer-mode", "auto"], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    out = tempfile.mktemp(suffix=".json")
    try:
        _wait_http(f"http://127.0.0.1:{http}/", 120)
        subprocess.run([lm, "bench", "server", "--mode", "cpu", "--transfer-mode", "lmcache_driven",
                        "--rpc-url", f"tcp://127.0.0.1:{rpc}", "--url", f"http://127.0.0.1:{http}",
                        "--num-tokens", "2048", "--kvcache-shape-spec", f"(2,1024,16,8,128):bfloat16:{layers}",
                        "--start", "0", "--end", str(max(repeat, 3) * 3), "--interval", "0", "--format", "json",
                        "--output", out, "-q"], env=env, check=True, timeout=600, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        metrics = json.load(open(out))["metrics"]
    finally:
        server.kill()
        server.wait()
    request_bytes = 2048 * layers * MiB // 256
    return (request_bytes / (metrics["cold_store"]["cold_store_p50"] / 1000) / 1e9,
            request_bytes / (metrics["warm_retrieve"]["warm_retrieve_p50"] / 1000) / 1e9)


def free_ports(n: int) -> list[int]:
    from tiercache.process import free_port

    return [free_port() for _ in range(n)]


def _wait_http(url: str, timeout_s: float) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(url, timeout=1)
            return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} did not answer in {timeout_s}s") from None
            time.sleep(0.2)


COLUMNS = ["memcpy", "loopback_socket", "file_write", "file_write_fsync", "file_read_cold", "file_read_warm",
           "redis_py_set", "redis_py_get", "redis_py_pipeline_set", "redis_py_pipeline_get", "same_host_put",
           "same_host_get", "remote_put", "remote_get", "remote_grpc_put", "remote_grpc_get", "disk_tier_put",
           "disk_tier_get", "redis_tier_put", "redis_tier_get"]


def print_table(rows: list[dict]) -> None:
    print(f"{'GB/s':<22}" + "".join(f"{r['chunk_bytes'] // MiB:>8} MiB" for r in rows))
    for name in COLUMNS + [c for c in ("lmcache_store", "lmcache_retrieve") if c in rows[0]]:
        print(f"{name:<22}" + "".join(f"{r[name]:>12.2f}" for r in rows))
    print()
    for name in rows[0]["ratios"]:
        print(f"{name:<34}" + "".join(f"{r['ratios'][name]:>8.2f}" for r in rows))


def plot(rows: list[dict], path: str) -> None:
    from lab.common import pyplot

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(12, 5))
    width = 0.8 / len(rows)
    for i, r in enumerate(rows):
        ax.bar([x + i * width for x in range(len(COLUMNS))], [r[c] for c in COLUMNS], width,
               label=f"{r['chunk_bytes'] // MiB} MiB")
    ax.set_xticks([x + width for x in range(len(COLUMNS))], COLUMNS, rotation=45, ha="right")
    ax.set_ylabel("GB/s")
    ax.set_title("tiercache data paths and their baselines (one run)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1,4,16", help="chunk sizes in MiB")
    parser.add_argument("--set-mib", type=int, default=256, help="bytes moved per size and round")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="64 MiB per size, 1 round: CI smoke, < 1 minute")
    parser.add_argument("--json-out", default="throughput.json")
    parser.add_argument("--plot", default="throughput.png")
    parser.add_argument("--lmcache-venv", help="a venv with lmcache installed: compare with its server too")
    args = parser.parse_args()
    tune_allocator()  # this process hosts the in-process tiers and the clients: same settings as the server
    set_bytes = (64 if args.quick else args.set_mib) * MiB
    repeat = 1 if args.quick else args.repeat
    host_mem = f"{4 * set_bytes // MiB + 256}MiB"
    redis_proc = RedisProcess("--maxmemory", "0").start()
    shared = ServerProcess("--host-mem", host_mem, "--disk-size", "0").start()
    remote = ServerProcess("--host-mem", host_mem, "--disk-size", "0").start()
    try:
        rows = [measure(int(s) * MiB, set_bytes, repeat, shared.url, remote.url, redis_proc.url, args.lmcache_venv)
                for s in args.sizes.split(",")]
    finally:
        shared.kill()
        remote.kill()
        redis_proc.stop()
    print_table(rows)
    write_report({"set_bytes": set_bytes, "repeat": repeat, "rows": rows}, args.json_out)
    if args.plot:
        plot(rows, args.plot)
    print(f"\nwrote {args.json_out}" + (f" and {args.plot}" if args.plot else ""))


if __name__ == "__main__":
    main()
