"""Store and load bandwidth of two secondary tiers of vLLM's own KV offloading, on the same bytes.

vLLM's `TieringOffloadingSpec` keeps offloaded KV chunks in a CPU pool (its primary tier, rows of a /dev/shm mmap)
and copies them to and from secondary tiers with jobs (`submit_store`: a cascade, `submit_load`: a promotion into a
fresh pool row). What a tier gives the engine is how fast those jobs finish. Two tiers get the same chunks:
- `fs`: vLLM's own files tier (vllm/v1/kv_offload/tiering/fs), one file per chunk, written and read with O_DIRECT
  where the directory takes it (vLLM probes it), so it bypasses the page cache;
- `tiercache`: tiercache.connector.vllm_tier.TierCacheTier against a `tiercache serve` process started here (host
  tier only): its host tier is an arena in /dev/shm in that other process, reached over gRPC and shared memory.

Each tier is built as vLLM builds it (`TieringOffloadingSpec(config).get_manager()`: the pool, then the tier through
`SecondaryTierFactory`), and only the tier's own jobs are timed: K chunks (--total-mib of them) written into pool rows
as random bytes, stored with all jobs submitted at once (as the manager cascades a step's stores) and timed until
`get_finished_jobs` reported every one; then the page cache is dropped and the chunks are loaded into other rows,
timed the same way, and compared with `==` to what was stored (a difference fails the run). --chunks-per-job: how many
chunks one job carries (1: a step of many requests; K: one long prompt's step).

Rounds run `fs`, `fs-again` (the A/A pair: fs twice) and `tiercache` in a random order, recorded per round, each run on
a fresh fs directory and a fresh server. The summary: per tier and chunk size the median GB/s, and for `tiercache / fs`
and `fs-again / fs` the median of per-round ratios with its 95% interval (lab.serving.stats.per_run_ratio).

    .venv-vllm-cpu/bin/python -m lab.tier_bandwidth [--repeats 5] [--total-mib 256]
        [--chunk-sizes tiny,4MiB,16MiB] [--chunks-per-job 1] [--work-dir DIR] [--json PATH]

`tiny`: the chunk of the tiny test model (testkit.vllm_models.FOUR_LAYER) on this CPU: one block of its attention
layers, a row of vLLM's pool for it.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import logging
import os
import random
import shutil
import statistics
import tempfile
import time
import traceback
import uuid
from contextlib import contextmanager

import numpy as np
import vllm
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import init_none_hash
from vllm.v1.kv_offload.base import ReqContext, make_offload_key
from vllm.v1.kv_offload.config import (OffloadingCacheConfig, OffloadingConfig, OffloadingGroupConfig,
                                       OffloadingModelConfig, OffloadingParallelConfig)
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.fs import io as fs_io
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from lab import common
from lab.serving.provenance import drop_page_cache
from lab.serving.stats import per_run_ratio
from tiercache.config import format_size, parse_size
from tiercache.process import ServerProcess

MiB = 1 << 20
ARMS = ("fs", "fs-again", "tiercache")
COMPARISONS = {"tiercache / fs": ("tiercache", "fs"), "fs-again / fs": ("fs-again", "fs")}
DIRECTIONS = ("store", "load")
POLL_S = 0.001  # between get_finished_jobs polls: short against a job, long enough not to starve the I/O threads
JOBS_TIMEOUT_S = 600.0


# -- one tier, as vLLM builds it ------------------------------------------------------------------------------------

def offloading_config(chunk_bytes: int, rows: int, tier_entry: dict) -> OffloadingConfig:
    """One group of one-block chunks of `chunk_bytes`, one rank: the pool's rows are the chunks (no padding: the
    sizes are page multiples)."""
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("model.layers.0.self_attn",), group_id=0),),
        worker_kv_bytes_per_block=chunk_bytes, enable_kv_cache_events=False,
        extra_config={"cpu_bytes_to_use": rows * chunk_bytes, "secondary_tiers": [tier_entry]},
        engine_id=f"tier-bandwidth-{uuid.uuid4().hex[:12]}",
        model=OffloadingModelConfig(name="tier-bandwidth/random-bytes", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
                                          is_parallelism_agnostic=False))


@contextmanager
def vllm_tier(chunk_bytes: int, rows: int, tier_entry: dict):
    """(the secondary tier, the pool's memoryview); the manager (tier, then pool) shut down after."""
    manager = TieringOffloadingSpec(offloading_config(chunk_bytes, rows, tier_entry)).get_manager()
    try:
        (tier,) = manager.secondary_tiers
        yield tier, manager.primary_tier.get_kv_memoryview()
    finally:
        manager.shutdown()


@contextmanager
def arm_tier(arm: str, chunk_bytes: int, rows: int, args):
    """The arm's tier on a fresh fs directory or a fresh server; what is known of it goes into `facts`."""
    facts: dict = {}
    if arm.startswith("fs"):
        os.makedirs(args.work_dir, exist_ok=True)
        root = tempfile.mkdtemp(prefix="tier-bandwidth-fs-", dir=args.work_dir)
        try:
            with vllm_tier(chunk_bytes, rows, {"type": "fs", "root_dir": root}) as (tier, view):
                facts["o_direct"] = tier._use_o_direct  # what vLLM's probe of the directory decided
                yield tier, view, facts
        finally:
            shutil.rmtree(root, ignore_errors=True)
        return
    # The host tier holds every chunk with room for its per-chunk rounding (nothing may be evicted before the load).
    host_mib = (args.total_mib * 5) // 4 + 64
    server = ServerProcess("--host-mem", f"{host_mib}MiB", "--disk-size", "0").start()
    try:
        entry = {"type": "TierCacheTier", "module_path": "tiercache.connector.vllm_tier", "url": server.url,
                 "model_identity": "tier-bandwidth: random bytes"}
        facts["host_mib"] = host_mib
        with vllm_tier(chunk_bytes, rows, entry) as (tier, view):
            yield tier, view, facts
    finally:
        server.stop()


# -- the tier's own jobs --------------------------------------------------------------------------------------------

def chunk_keys(count: int) -> list:
    return [make_offload_key(hashlib.sha256(i.to_bytes(8, "big")).digest(), 0) for i in range(count)]


def transfer_jobs(keys: list, rows: range, per_job: int, promotion: bool, context: ReqContext, first_id: int):
    return [TransferJob(job_id=first_id + n, keys=keys[i:i + per_job],
                        chunk_ids=np.array(rows[i:i + per_job], dtype=np.int64), is_promotion=promotion,
                        req_context=context)
            for n, i in enumerate(range(0, len(keys), per_job))]


def run_jobs(tier, submit, jobs: list[TransferJob]) -> float:
    """Seconds from the first submit until the tier reported every job; any failed job fails the run."""
    waiting = {job.job_id for job in jobs}
    failed = []
    started = time.perf_counter()
    for job in jobs:
        submit(job)
    while waiting:
        for result in tier.get_finished_jobs():
            waiting.discard(result.job_id)
            if not result.success:
                failed.append(result.job_id)
        if waiting:
            if time.perf_counter() - started > JOBS_TIMEOUT_S:
                raise TimeoutError(f"{tier.tier_type}: {len(waiting)} of {len(jobs)} jobs not reported")
            time.sleep(POLL_S)
    elapsed = time.perf_counter() - started
    if failed:
        raise RuntimeError(f"{tier.tier_type}: {len(failed)} of {len(jobs)} jobs failed")
    return elapsed


def store_and_load(tier, view: memoryview, payload: np.ndarray, per_job: int) -> dict:
    """Store the payload's chunks from rows 0..K-1, drop the page cache, load them into rows K..2K-1, compare."""
    pool = np.asarray(view)  # rows x chunk bytes over the pool itself
    try:
        return _store_and_load(tier, pool, payload, per_job)
    except BaseException as exc:
        traceback.clear_frames(exc.__traceback__)  # its frames' views of the pool would make vLLM's unmap fail
        raise
    finally:
        del pool  # vLLM unmaps the pool at shutdown only if no view of it is left


def _store_and_load(tier, pool: np.ndarray, payload: np.ndarray, per_job: int) -> dict:
    count = len(payload)
    keys, context = chunk_keys(count), ReqContext(req_id="tier-bandwidth")
    tier.on_new_request(context)
    warm_up(tier, context, spare_row=count)
    pool[:count] = payload
    pool[count:2 * count] = 0  # so that a load that wrote nothing cannot pass the comparison
    stores = transfer_jobs(keys, range(count), per_job, False, context, first_id=0)
    store_s = run_jobs(tier, tier.submit_store, stores)
    page_cache = drop_page_cache()  # the load reads what the tier kept, not what the kernel cached of the store
    loads = transfer_jobs(keys, range(count, 2 * count), per_job, True, context, first_id=len(stores))
    load_s = run_jobs(tier, tier.submit_load, loads)
    tier.on_request_finished(context)
    differ = [i for i in range(count) if not (pool[count + i] == pool[i]).all()]
    if differ:
        raise AssertionError(f"{tier.tier_type}: {len(differ)} of {count} chunks loaded differ from what was stored "
                             f"(first: chunk {differ[0]})")
    nbytes = payload.nbytes
    return {"store_s": store_s, "load_s": load_s, "store_gbps": nbytes / store_s / 1e9,
            "load_gbps": nbytes / load_s / 1e9, "jobs": len(stores), "bytes_equal": True, "page_cache": page_cache}


def warm_up(tier, context: ReqContext, spare_row: int) -> None:
    """One chunk stored and loaded untimed, under a key of its own: what a tier does once per engine (tiercache
    resolves its namespace and attaches the server's arena on first use) is not bandwidth."""
    key = [make_offload_key(b"warm-up".ljust(32, b"\0"), 0)]
    run_jobs(tier, tier.submit_store, transfer_jobs(key, range(0, 1), 1, False, context, first_id=1 << 30))
    run_jobs(tier, tier.submit_load, transfer_jobs(key, range(spare_row, spare_row + 1), 1, True, context,
                                                   first_id=(1 << 30) + 1))


def random_chunks(seed: tuple[int, ...], count: int, chunk_bytes: int) -> np.ndarray:
    """The same bytes for every arm of a round and chunk size (seeded)."""
    return np.frombuffer(np.random.default_rng(seed).bytes(count * chunk_bytes), np.uint8).reshape(count, chunk_bytes)


def one_run(arm: str, chunk_bytes: int, seed: tuple[int, ...], args) -> dict:
    count = max(1, args.total_mib * MiB // chunk_bytes)
    per_job = args.chunks_per_job or count
    payload = random_chunks(seed, count, chunk_bytes)
    with arm_tier(arm, chunk_bytes, 2 * count, args) as (tier, view, facts):
        measured = store_and_load(tier, view, payload, per_job)
    return {"arm": arm, "chunk_bytes": chunk_bytes, "chunks": count, "chunks_per_job": per_job, **facts, **measured}


# -- rounds and the summary -----------------------------------------------------------------------------------------

def tiny_model_chunk() -> int:
    """A row of vLLM's pool for the tiny test model: one block (N tokens, N as on this CPU) of its attention layers
    (as its engine tests' pools hold: 256 KiB rows where N is 256)."""
    from testkit.vllm_models import FOUR_LAYER

    return FOUR_LAYER.sizing().kv_chunk_bytes


def chunk_sizes(text: str) -> list[int]:
    return [tiny_model_chunk() if part.strip() == "tiny" else parse_size(part.strip()) for part in text.split(",")]


def per_round(runs: list[dict], arm: str, size: int, direction: str) -> list[float]:
    """The arm's GB/s at this chunk size, in round order (the pairing per_run_ratio takes)."""
    mine = sorted((r["round"], r[f"{direction}_gbps"]) for r in runs if r["arm"] == arm and r["chunk_bytes"] == size)
    return [gbps for _, gbps in mine]


def summarize(runs: list[dict], sizes: list[int], margin: float) -> dict:
    summary = {}
    for size in sizes:
        medians = {arm: {d: round(statistics.median(per_round(runs, arm, size, d)), 3) for d in DIRECTIONS}
                   for arm in ARMS}
        ratios = {name: {d: per_run_ratio(per_round(runs, arm, size, d), per_round(runs, base, size, d), margin)
                         for d in DIRECTIONS}
                  for name, (arm, base) in COMPARISONS.items()}
        summary[format_size(size)] = {"chunk_bytes": size, "median_gbps": medians, "ratios": ratios}
    return summary


def table(summary: dict, margin: float) -> str:
    lines = [f"{'chunk':<10}{'arm':<12}{'store GB/s':>12}{'load GB/s':>12}"]
    for size, cell in summary.items():
        for arm, gbps in cell["median_gbps"].items():
            lines.append(f"{size:<10}{arm:<12}{gbps['store']:>12.3f}{gbps['load']:>12.3f}")
    lines += ["", f"median of per-round ratios of GB/s [95% interval] verdict (equivalence margin {margin})",
              f"{'chunk':<10}{'comparison':<16}{'store':<42}{'load':<42}"]
    for size, cell in summary.items():
        for name, by_direction in cell["ratios"].items():
            lines.append(f"{size:<10}{name:<16}" + "".join(f"{_ratio(by_direction[d]):<42}" for d in DIRECTIONS))
    return "\n".join(line.rstrip() for line in lines)


def _ratio(cell: dict) -> str:
    if cell["ratio"] is None:
        return cell["verdict"]
    if cell["low"] is None:
        return f"{cell['ratio']:.3f} ({cell['verdict']})"
    return f"{cell['ratio']:.3f} [{cell['low']:.3f}, {cell['high']:.3f}] {cell['verdict']}"


def arm_orders(repeats: int, seed: int) -> list[list[str]]:
    """A random order of the arms per round, every order once before any repeats (a position in the round, e.g.
    right after a server start, favours no arm more than the rounds must)."""
    shuffle = random.Random(seed)
    every = [list(order) for order in itertools.permutations(ARMS)]
    orders = []
    while len(orders) < repeats:
        shuffle.shuffle(every)
        orders += every
    return orders[:repeats]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="rounds (each runs every arm once per chunk size)")
    parser.add_argument("--total-mib", type=int, default=256, help="bytes per measurement (K = this / chunk size)")
    parser.add_argument("--chunk-sizes", default="tiny,4MiB,16MiB", help="comma-separated; `tiny`: the test model's")
    parser.add_argument("--chunks-per-job", type=int, default=1, help="chunks in one store or load job (0: all K)")
    parser.add_argument("--equivalence-margin", type=float, default=1.10)
    parser.add_argument("--work-dir", default=tempfile.gettempdir(), help="where the fs tier's directories go")
    parser.add_argument("--seed", type=int, help="of the arms' orders and the bytes (default: drawn, and recorded)")
    parser.add_argument("--json", metavar="PATH", help="write params, meta, every run and the summary here")
    args = parser.parse_args()
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1 << 31)
    logging.getLogger("vllm").setLevel(logging.WARNING)  # vLLM logs every tier and pool it makes
    init_none_hash(sha256)  # the engine core seeds block hashes after making its tiers; tiercache's namespace needs it
    sizes = chunk_sizes(args.chunk_sizes)
    runs, orders = [], arm_orders(args.repeats, args.seed)
    for round_index, order in enumerate(orders):
        for size in sizes:
            for arm in order:
                run = {"round": round_index, **one_run(arm, size, (args.seed, round_index, size), args)}
                runs.append(run)
                print(f"round {round_index} {format_size(size):>9} {arm:<10} store {run['store_gbps']:7.3f} GB/s  "
                      f"load {run['load_gbps']:7.3f} GB/s", flush=True)
    summary = summarize(runs, sizes, args.equivalence_margin)
    print("\n" + table(summary, args.equivalence_margin))
    if args.json:
        meta = common.meta(vllm=vllm.__version__, fs_c_io=fs_io._HAS_FSIO_C)
        common.write_report({"params": {**vars(args), "chunk_bytes": sizes}, "meta": meta, "orders": orders,
                             "runs": runs, "summary": summary}, args.json)


if __name__ == "__main__":
    main()
