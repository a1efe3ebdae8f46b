"""Restart time of a server whose disk tier holds many chunks (the index is rebuilt from the files at start).

Fills a disk directory with `--chunks` records through the disk tier itself, then times (1) the raw filesystem walk
of that directory (scandir + stat + reading each file's first bytes: the floor any rebuild pays), (2) building the
disk tier's index, and (3) `tiercache serve` on that directory from exec to answering health checks.

    .venv/bin/python -m benchmarks.restart [--chunks 100000] [--chunk-bytes 4096]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

from lab.common import write_report
from tiercache.config import DiskTierConfig
from tiercache.process import ServerProcess
from tiercache.record import encoding
from tiercache.record.keys import ChunkKey
from tiercache.store.tiered import TieredStore
from tiercache.tiers.disk import DiskTier


def fill(path: str, chunks: int, chunk_bytes: int) -> None:
    store = TieredStore([DiskTier(DiskTierConfig(path=path, capacity_bytes=chunks * (chunk_bytes + 4096)))])
    payload = os.urandom(chunk_bytes)
    for i in range(chunks):
        key = ChunkKey("bench/restart", i.to_bytes(18, "big"))
        store.put_record(key, encoding.encode(key, payload))
    store.close()


def raw_walk(path: str) -> float:
    """scandir + stat + read 512 bytes of every file: what any index rebuild must at least do."""
    started = time.perf_counter()
    for folder in os.scandir(path):
        if not folder.is_dir():
            continue
        for entry in os.scandir(folder.path):
            entry.stat()
            with open(entry.path, "rb") as f:
                f.read(512)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, default=100_000)
    parser.add_argument("--chunk-bytes", type=int, default=4096)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="tiercache-restart-")
    try:
        started = time.perf_counter()
        fill(root, args.chunks, args.chunk_bytes)
        fill_s = time.perf_counter() - started
        walk_s = raw_walk(root)
        started = time.perf_counter()
        tier = DiskTier(DiskTierConfig(path=root, capacity_bytes=args.chunks * (args.chunk_bytes + 4096)))
        index_s = time.perf_counter() - started
        indexed = tier.usage().chunks
        tier.close()
        server = ServerProcess("--host-mem", "64MiB", "--disk-dir", root,
                               "--disk-size", str(args.chunks * (args.chunk_bytes + 4096)))
        started = time.perf_counter()
        server.start(timeout_s=600)
        serve_s = time.perf_counter() - started
        server.terminate()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report = {"chunks": args.chunks, "indexed": indexed, "chunk_bytes": args.chunk_bytes, "fill_s": round(fill_s, 2),
              "raw_walk_s": round(walk_s, 2), "index_rebuild_s": round(index_s, 2),
              "server_start_to_serving_s": round(serve_s, 2), "rebuild_over_raw_walk": round(index_s / walk_s, 2)}
    if args.json:
        write_report(report)
        return
    print(f"{args.chunks} chunks of {args.chunk_bytes} B on disk (filled in {fill_s:.1f} s); {indexed} indexed")
    print(f"raw walk (scandir + stat + 512 B read per file): {walk_s:.2f} s")
    print(f"disk tier index rebuild: {index_s:.2f} s ({index_s / walk_s:.2f}x the raw walk)")
    print(f"tiercache serve, exec to serving: {serve_s:.2f} s")


if __name__ == "__main__":
    main()
