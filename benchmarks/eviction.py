"""The put rate while a tier evicts against the put rate while it fills, at growing record counts, in ONE run.

The eviction policy (tiercache.tiers.index) should cost O(log n) per eviction: a full tier of a million records must
take puts at a rate close to the rate at which it filled. Records form hybrid chains, as the connectors write them:
chains of --chain kv chunks, each naming the one before it as its parent, with a state under every chunk (so every
eviction exposes a new leaf, the expensive case for a chain-aware policy).

For each configuration the tier is filled to capacity; `filling` is the rate of the last --window puts before it is
full (the index is as large then as while evicting), `evicting` the rate of the next --window puts, each of which
evicts. The ratio evicting / filling is the figure of merit (goal: at least 0.5).
Puts go through a store over the one tier (TieredStore.put_record: make room, put), as a server places them.
  disk    DiskTier in a temp dir: one file per record. Baselines in the same directories right after: raw file
          creation (temp file + rename, as the tier writes) and creation with one unlink of an old file each (what
          any one-file-per-record store must do while full), and the index alone in memory at the same size.
  host    the host tier in-process (ArenaTier over shared memory), 64 KiB pages
  server  a server process with only a host tier, client.put_many batches of 1,000 chunks (what a client sees)

    .venv/bin/python -m benchmarks.eviction [--disk 1000,100000,1000000] [--host-gib 8] [--server-gib 2]
                                            [--json-out docs/eviction.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

from tiercache.client import Chunk, Client
from tiercache.config import DiskTierConfig, GiB, HostTierConfig, KiB
from tiercache.process import ServerProcess
from tiercache.record import encoding
from tiercache.record.encoding import CLASS_KV, CLASS_STATE, ChunkMeta
from tiercache.record.keys import ChunkKey
from tiercache.store.tiered import TieredStore
from tiercache.tiers.disk import DiskTier
from tiercache.tiers.host import host_tier
from tiercache.tiers.index import ChunkIndex

NS = "bench-eviction"
PAYLOAD = bytes(64)


def chained(i: int, chain: int) -> tuple[bytes, ChunkMeta]:
    """Record i of the workload: even i a kv chunk extending the previous kv of its chain, odd i a state under it."""
    link, is_state = divmod(i, 2)
    position = link % chain
    kv_key = b"kv%012d" % link
    if is_state:
        return b"st%012d" % link, ChunkMeta(CLASS_STATE, 544 * (position + 1), kv_key)
    parent = b"kv%012d" % (link - 1) if position else b""
    return kv_key, ChunkMeta(CLASS_KV, 544, parent)


def records(start: int, count: int, chain: int):
    for i in range(start, start + count):
        name, meta = chained(i, chain)
        key = ChunkKey(NS, name)
        yield key, encoding.encode(key, PAYLOAD, meta)


def rate(store: TieredStore, start: int, count: int, chain: int) -> float:
    batch = list(records(start, count, chain))  # encoded up front: only the placement is timed
    began = time.perf_counter()
    for key, record in batch:
        store.put_record(key, record)
    return count / (time.perf_counter() - began)


def fill_then_evict(tier, capacity_records: int, window: int, chain: int) -> dict:
    """Through a store over the tier alone: the placement a server runs (make room, put), victims dropped."""
    store = TieredStore([tier])
    window = min(window, capacity_records // 2)
    filled = capacity_records - window
    began = time.perf_counter()
    for key, record in records(0, filled, chain):
        store.put_record(key, record)
    setup_s = time.perf_counter() - began
    filling = rate(store, filled, window, chain)
    assert tier.usage().chunks == capacity_records, "the tier evicted before it was full"
    evicting = rate(store, capacity_records, window, chain)
    assert tier.usage().chunks >= 0.95 * capacity_records  # chain heads are a few bytes smaller (no parent)
    return {"records": capacity_records, "window": window, "filling_per_s": filling, "evicting_per_s": evicting,
            "ratio": evicting / filling, "fill_s": setup_s}


def disk_case(records_count: int, window: int, chain: int) -> dict:
    root = tempfile.mkdtemp(prefix="tiercache-evict-", dir=os.environ.get("EVICTION_BENCH_DIR"))
    try:
        sizes = {len(r) for _, r in records(0, 4, chain)}
        tier = DiskTier(DiskTierConfig(path=root, capacity_bytes=records_count * max(sizes),
                                       state_budget_bytes=records_count * max(sizes)))
        # Records differ in size by a few bytes (key lengths): count what the cap actually holds.
        result = fill_then_evict(tier, _records_held(tier, records_count, chain), window, chain)
        tier.close()  # its unlinker drained: the raw baseline below has the folders to itself
        result.update(_raw_files(root, result["window"], max(sizes)))
        result["index_evicting_per_s"] = _index_alone(result["records"], result["window"], chain)
        return {"tier": "disk", **result}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _raw_files(root: str, window: int, size: int) -> dict:
    """File creation (temp + rename) in the tier's own folders, alone and with one unlink of an old file each."""
    data = bytes(size)
    folders = sorted(os.path.join(root, d) for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    old = [os.path.join(f, name) for f in folders for name in os.listdir(f)][:window]

    def create(i: int) -> None:
        path = os.path.join(folders[i % len(folders)], f"raw-{i}.chunk")
        with open(path + ".tmp", "wb", buffering=0) as f:
            f.write(data)
        os.replace(path + ".tmp", path)

    began = time.perf_counter()
    for i in range(window):
        create(i)
    created = window / (time.perf_counter() - began)
    began = time.perf_counter()
    for i, path in enumerate(old):
        create(window + i)
        os.unlink(path)
    churned = len(old) / (time.perf_counter() - began)
    return {"raw_create_per_s": created, "raw_create_unlink_per_s": churned}


def _index_alone(records_count: int, window: int, chain: int) -> float:
    """The policy alone: ChunkIndex with as many entries, one eviction per insert (no I/O)."""

    class _Entry:
        __slots__ = ("record_bytes", "meta")

        def __init__(self, meta: ChunkMeta) -> None:
            self.record_bytes, self.meta = 100, meta

    index: ChunkIndex = ChunkIndex()
    for i in range(records_count):
        name, meta = chained(i, chain)
        index.add(ChunkKey(NS, name), _Entry(meta))
    began = time.perf_counter()
    for i in range(records_count, records_count + window):
        name, meta = chained(i, chain)
        index.victims(100, 0)
        index.add(ChunkKey(NS, name), _Entry(meta))
    return window / (time.perf_counter() - began)


def _records_held(tier, wanted: int, chain: int) -> int:
    """Largest record count the tier holds without evicting (the cap is in bytes; record sizes vary a little)."""
    total = 0
    for held, (_, record) in enumerate(records(0, wanted + 1, chain)):
        total += len(record)
        if total > tier.capacity_bytes:
            return held
    return wanted


def host_case(gib: float, window: int, chain: int) -> dict:
    page = 64 * KiB
    capacity = int(gib * GiB) // page * page
    tier = host_tier(HostTierConfig(capacity_bytes=capacity, page_bytes=page, state_budget_bytes=capacity))
    try:
        return {"tier": "host", "gib": gib, **fill_then_evict(tier, capacity // page, window, chain)}
    finally:
        tier.close()


def server_case(gib: float, batches: int, chain: int) -> dict:
    """What a client sees: 1,000-chunk put_many calls against a server whose host tier is full."""
    page = 64 * KiB
    records_count = int(gib * GiB) // page
    with ServerProcess("--host-mem", f"{int(gib * 1024)}MiB", "--disk-size", "0") as server, \
            Client.from_url(server.url, timeout_s=120) as client:
        def batch(start: int) -> float:
            chunks = []
            for i in range(start, start + 1000):
                name, meta = chained(i, chain)
                chunks.append(Chunk(name, PAYLOAD, meta))
            began = time.perf_counter()
            client.put_many(NS, chunks)
            return time.perf_counter() - began

        full = records_count - records_count % 1000
        times = [batch(start) for start in range(0, full, 1000)]
        filling = sorted(times[-batches:])[len(times[-batches:]) // 2]
        evicting = sorted(batch(full + 1000 * b) for b in range(batches))[batches // 2]
    return {"tier": "server", "gib": gib, "records": records_count, "filling_s_per_1000": filling,
            "evicting_s_per_1000": evicting, "ratio": filling / evicting}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--disk", default="1000,100000,1000000", help="disk tier record counts")
    parser.add_argument("--host-gib", type=float, default=8.0, help="host tier size in-process (0: skip)")
    parser.add_argument("--server-gib", type=float, default=2.0, help="host tier size of the server case (0: skip)")
    parser.add_argument("--window", type=int, default=20_000, help="puts timed while filling and while evicting")
    parser.add_argument("--chain", type=int, default=16, help="kv chunks per chain")
    parser.add_argument("--json-out")
    args = parser.parse_args()
    results = []
    for count in (int(c) for c in args.disk.split(",") if c):
        results.append(disk_case(count, args.window, args.chain))
        _print(results[-1])
    if args.host_gib:
        results.append(host_case(args.host_gib, args.window, args.chain))
        _print(results[-1])
    if args.server_gib:
        results.append(server_case(args.server_gib, 5, args.chain))
        _print(results[-1])
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def _print(row: dict) -> None:
    if row["tier"] == "server":
        print(f"server host {row['gib']:g} GiB ({row['records']:,} records): put_many of 1,000 chunks "
              f"{row['filling_s_per_1000'] * 1e3:.1f} ms filling, {row['evicting_s_per_1000'] * 1e3:.1f} ms "
              f"evicting: ratio {row['ratio']:.2f}", flush=True)
        return
    size = f" {row['gib']:g} GiB" if "gib" in row else ""
    print(f"{row['tier']}{size} {row['records']:>9,} records: filling {row['filling_per_s']:>9,.0f} puts/s, "
          f"evicting {row['evicting_per_s']:>9,.0f} puts/s: ratio {row['ratio']:.2f} "
          f"(fill took {row['fill_s']:.0f} s)", flush=True)
    if "raw_create_per_s" in row:
        raw_ratio = row["raw_create_unlink_per_s"] / row["raw_create_per_s"]
        print(f"    same folders, raw files: create {row['raw_create_per_s']:,.0f}/s, create + unlink an old one "
              f"{row['raw_create_unlink_per_s']:,.0f}/s (ratio {raw_ratio:.2f}); the index alone evicting: "
              f"{row['index_evicting_per_s']:,.0f}/s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
