"""TierCacheTier driven by vLLM 0.33's own TieringOffloadingManager, against a real `tiercache serve` (no model).

Each engine is what `TieringOffloadingSpec.get_manager` builds from an OffloadingConfig: a CPU primary tier over a
shared region (/dev/shm/vllm_offload_<engine_id>.mmap, removed at shutdown) and our tier from its `secondary_tiers`
entry through vLLM's SecondaryTierFactory. The test plays the scheduler: every call under `manager.lock`, a step's
lookups ended by `on_schedule_end` (which submits the step's promotions), and plays the GPU worker by writing a
stored chunk's bytes into its pool slot before `complete_store` (which cascades it to the tier).
"""

from __future__ import annotations

import glob
import os
import signal
import threading
import time
import uuid

import pytest

tiering = pytest.importorskip("vllm.v1.kv_offload.tiering.manager")
if not hasattr(tiering, "DEFAULT_TIER_POLL_INTERVAL_S"):  # 0.32's manager: no poll thread, other step contract
    pytest.skip("needs vLLM 0.33's tiering manager", allow_module_level=True)

from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import init_none_hash  # noqa: E402
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key  # noqa: E402
from vllm.v1.kv_offload.config import (OffloadingCacheConfig, OffloadingConfig, OffloadingGroupConfig,  # noqa: E402
                                       OffloadingModelConfig, OffloadingParallelConfig)
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: E402

from tests.helpers import ServerProcess, wait_for  # noqa: E402
from tiercache.client import Client  # noqa: E402

HIT, HIT_PENDING, MISS, RETRY = LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.MISS, LookupResult.RETRY
BLOCKS_PER_CHUNK, BLOCK_BYTES, SLOTS = 4, 1024, 4
CHUNK = BLOCKS_PER_CHUNK * BLOCK_BYTES  # one pool row (page-aligned: no padding)
END = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


@pytest.fixture(autouse=True)
def none_hash():
    # The tier's namespace digests vLLM's NONE_HASH, which the engine core seeds after it makes its tiers.
    init_none_hash(sha256)


@pytest.fixture
def server(tmp_path):
    with ServerProcess("--host-mem", "4MiB", "--disk-size", "0", "--disk-dir", str(tmp_path / "disk"),
                       "--no-data-channel") as process:
        yield process


@pytest.fixture
def engines(server):
    """engines(poll_s=0, **tier keys) -> a TieringOffloadingManager; shut down (region removed) after the test.
    poll_s 0 turns vLLM's tier-poll thread off (the default is on: TierCacheTier tolerates off-thread polling), so
    only the steps below service the tier; the poll thread has a test of its own."""
    made = []

    def make(poll_s: float = 0.0, **tier_keys):
        engine_id = f"tiercache-test-{uuid.uuid4().hex[:12]}"
        tier = {"type": "TierCacheTier", "module_path": "tiercache.connector.vllm_tier", "url": server.url,
                "model_identity": "weights=test;quant=None;cache=auto;overrides=none", **tier_keys}
        config = OffloadingConfig(
            groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("model.layers.0.self_attn",),
                                          group_id=0),),
            worker_kv_bytes_per_block=BLOCK_BYTES, enable_kv_cache_events=False,
            extra_config={"cpu_bytes_to_use": SLOTS * CHUNK, "secondary_tiers": [tier],
                          "tier_poll_interval_s": poll_s},
            engine_id=engine_id, model=OffloadingModelConfig(name="test/tiny", dtype="float16"),
            cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=BLOCKS_PER_CHUNK),
            parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                              data_parallel_index=0, data_parallel_size=1,
                                              data_parallel_rank_local=None, is_parallelism_agnostic=False))
        try:
            manager = TieringOffloadingSpec(config).get_manager()
        except BaseException:  # a tier that refused to start: vLLM made the pool first and does not remove it
            for path in glob.glob(f"/dev/shm/vllm_offload_{engine_id}.mmap*"):
                os.unlink(path)
            raise
        made.append((engine_id, manager))
        assert glob.glob(f"/dev/shm/vllm_offload_{engine_id}.mmap*"), "the pool is not where the check looks"
        return manager

    yield make
    left, mapped = [], []
    for engine_id, manager in made:
        region = manager.primary_tier._mmap_region
        manager.shutdown()  # without the lock, as vLLM requires; the tiers first, then the pool
        left += glob.glob(f"/dev/shm/vllm_offload_{engine_id}.mmap*")
        mapped += [engine_id] if region.mmap_obj is not None else []  # vLLM keeps a pool mapped while a view is left
    assert not left, "an engine left its pool in /dev/shm"
    assert not mapped, "a view of the pool outlived the tier's shutdown"


def tier_of(manager):
    (tier,) = manager.secondary_tiers
    return tier


def key_of(n: int):
    return make_offload_key(n.to_bytes(4, "big") * 8, 0)  # a 32-byte block hash, group 0


def request(manager, req_id: str) -> ReqContext:
    context = ReqContext(req_id)
    with manager.lock:
        manager.on_new_request(context)
    return context


def store(manager, context, chunks: dict, settle: bool = True) -> None:
    """The GPU->CPU store of `chunks` ({key: bytes}) as vLLM's connector makes it; `settle`: then step until the
    cascade to the tier is reported."""
    with manager.lock:
        out = manager.prepare_store(list(chunks), context)
        manager.on_schedule_end(END)
    assert out is not None and out.keys_to_store == list(chunks)
    with manager.primary_tier.get_kv_memoryview().cast("B") as rows:
        for key, slot in zip(out.keys_to_store, out.store_spec.chunk_ids):  # the worker's copy into the pool
            rows[int(slot) * CHUNK:(int(slot) + 1) * CHUNK] = chunks[key]
    with manager.lock:
        manager.complete_store(list(chunks), context)  # -> tier.submit_store
    if settle:
        wait_for(lambda: not step(manager) and not pending(manager), what="the cascade to the tier")


def step(manager, lookups=()) -> list[LookupResult]:
    """One scheduler step under the lock: the lookups ((key, context) pairs), then on_schedule_end."""
    with manager.lock:
        results = [manager.lookup(key, context) for key, context in lookups]
        manager.on_schedule_end(END)
    return results


def pending(manager) -> bool:
    with manager.lock:
        return manager.has_pending_work()


def lookups_until(manager, key, context, *wanted: LookupResult, timeout_s: float = 10.0) -> list[LookupResult]:
    """Step until the lookup of `key` answers one of `wanted`; returns the answers seen, each run once."""
    seen: list[LookupResult] = []
    deadline = time.monotonic() + timeout_s
    while not seen or seen[-1] not in wanted:
        assert time.monotonic() < deadline, f"none of {wanted} after {timeout_s}s: {seen}"
        (result,) = step(manager, [(key, context)])
        if not seen or seen[-1] is not result:
            seen.append(result)
        time.sleep(0.002)  # a step is the pace of the scheduler, not a wait for the answer
    return seen


def all_stopped(pid: int) -> bool:
    """Every thread of the process is stopped: SIGSTOP is delivered asynchronously, and a thread of the server may
    still answer a call for a moment after os.kill returns."""
    states = []
    for stat in glob.glob(f"/proc/{pid}/task/*/stat"):
        try:
            with open(stat) as file:
                states.append(file.read().rsplit(")", 1)[1].split()[0])
        except FileNotFoundError:  # a thread that just ended
            pass
    return bool(states) and all(state == "T" for state in states)


def promoted_bytes(manager, key, context) -> bytes:
    """What a GPU load of `key` would read: its pool slot, pinned as the scheduler pins it."""
    with manager.lock:
        (slot,) = manager.prepare_load([key], context).chunk_ids
    try:
        with manager.primary_tier.get_kv_memoryview().cast("B") as rows:
            return bytes(rows[int(slot) * CHUNK:(int(slot) + 1) * CHUNK])
    finally:
        with manager.lock:
            manager.complete_load([key], context)


def record(tier) -> list[tuple[str, list[int]]]:
    """Wrap the tier's get_finished_jobs on the instance: (thread, job ids) of each call that reported jobs."""
    original, reported = tier.get_finished_jobs, []

    def get_finished_jobs():
        results = list(original())
        if results:
            reported.append((threading.current_thread().name, [r.job_id for r in results]))
        return results

    tier.get_finished_jobs = get_finished_jobs
    return reported


def test_a_second_engine_promotes_the_bytes_the_first_stored(engines):
    first, second = engines(), engines()
    key, payload = key_of(1), os.urandom(CHUNK)
    store(first, request(first, "a"), {key: payload})
    assert tier_of(first).counts()["stored_chunks"] == 1

    context = request(second, "b")
    # RETRY while the tier asks the server in the background; then the tier's HIT makes the manager reserve a slot
    # and queue the promotion (HIT_PENDING), submitted at that step's on_schedule_end; HIT once the load is reported.
    assert lookups_until(second, key, context, HIT) == [RETRY, HIT_PENDING, HIT]
    assert promoted_bytes(second, key, context) == payload
    assert tier_of(second).namespace == tier_of(first).namespace
    counts = tier_of(second).counts()
    assert (counts["loaded_chunks"], counts["loaded_bytes"], counts["load_failures"]) == (1, CHUNK, 0)


def test_a_lookup_never_waits_on_a_stopped_server(server, engines):
    engine = engines(lookup_deadline_s=0.2)
    key, payload = key_of(2), os.urandom(CHUNK)
    with Client.from_url(server.url) as client:  # the server holds it: only the stop can make it a miss
        client.put(tier_of(engine).namespace, key, payload)
    context = request(engine, "a")
    seen, slowest, missed_at = [], 0.0, None
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: all_stopped(server.process.pid), what="the server stopped")
        asked = time.monotonic()
        while missed_at is None or time.monotonic() - missed_at < 0.3:  # and on: a MISS stays quick
            assert time.monotonic() - asked < 10, f"no MISS: {seen}"
            started = time.perf_counter()
            (result,) = step(engine, [(key, context)])
            slowest = max(slowest, time.perf_counter() - started)
            if not seen or seen[-1] is not result:
                seen.append(result)
            if result is MISS and missed_at is None:
                missed_at = time.monotonic()
            time.sleep(0.002)
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
    assert seen == [RETRY, MISS]
    counts = tier_of(engine).counts()  # the tier counts it (and logs its counts at shutdown): a late answer, a miss
    assert counts["timed_out"] + counts["failed_calls"] >= 1, counts
    # RETRY until the deadline (the tier's own, or the Exists call's of the same length: whichever ends first).
    assert 0.2 <= missed_at - asked < 1.0
    assert slowest < 0.05, f"a step took {slowest * 1000:.1f} ms with the server stopped"

    # The server answers again, and no engine restart is needed: a later request asks again (a miss stays the
    # asking request's answer; one that asks while the client's breaker still holds off misses too) and promotes it.
    deadline = time.monotonic() + 20
    while (seen := lookups_until(engine, key, context, MISS, HIT))[-1] is MISS:
        assert time.monotonic() < deadline, "the tier never asked the server again"
        with engine.lock:
            engine.on_request_finished(context)
        context = request(engine, uuid.uuid4().hex)
        time.sleep(0.05)
    assert seen[-2:] == [HIT_PENDING, HIT]
    assert promoted_bytes(engine, key, context) == payload


def test_a_chunk_gone_before_its_load_is_a_miss_until_stored_again(server, engines):
    first, second = engines(), engines()
    key, payload = key_of(3), os.urandom(CHUNK)
    store(first, request(first, "a"), {key: payload})
    context = request(second, "b")
    deleted, deadline = 0, time.monotonic() + 10
    while True:  # to the step whose lookup got the tier's HIT: the key goes before that step submits the promotion
        assert time.monotonic() < deadline, "the tier never answered HIT"
        with second.lock:
            result = second.lookup(key, context)
            if result is HIT_PENDING:
                with Client.from_url(server.url) as client:
                    deleted = client.delete(tier_of(second).namespace, [key])
            second.on_schedule_end(END)
        if result is not RETRY:
            break
        time.sleep(0.002)
    assert (result, deleted) == (HIT_PENDING, 1)

    # The load fails, vLLM drops the slot and asks the tier again: a MISS.
    seen = lookups_until(second, key, context, MISS)
    assert set(seen) <= {HIT_PENDING, MISS}, seen
    assert tier_of(second).counts()["load_failures"] == 1
    assert second.primary_tier.lookup(key, context) is MISS
    # And it stays one for the next request, which would ask the server again, though the server says it holds the
    # key again: a chunk of the wrong size put back under it (Exists yes, every load fails). A tier that asked would
    # have every request promote it, fail and come back (vLLM drops a failed key and looks it up again).
    with second.lock:
        second.on_request_finished(context)
    with Client.from_url(server.url) as client:
        client.put(tier_of(second).namespace, key, payload[:CHUNK // 2])
    context = request(second, "c")
    until = time.monotonic() + 0.5  # far longer than an Exists round trip and a load
    while time.monotonic() < until:
        assert step(second, [(key, context)]) == [MISS] and not pending(second)
        time.sleep(0.005)
    assert tier_of(second).counts()["load_failures"] == 1

    # The engine recomputes it and its tier stores it again: the tier may answer HIT for it again. Four other chunks
    # push it out of the pool, so the next lookup reaches the tier, which promotes what it stored.
    store(second, context, {key: payload})
    store(second, request(second, "d"), {key_of(100 + i): os.urandom(CHUNK) for i in range(SLOTS)})
    assert second.primary_tier.lookup(key, context) is MISS
    assert lookups_until(second, key, context, HIT) == [RETRY, HIT_PENDING, HIT]
    assert promoted_bytes(second, key, context) == payload


def test_finished_jobs_are_polled_off_the_scheduler_thread(engines):
    first, second = engines(poll_s=0.005), engines(poll_s=0.005)
    for manager in (first, second):
        # vLLM runs the poll thread for a tier that says it tolerates it: ours does.
        assert type(tier_of(manager)).tolerates_off_thread_polling
        assert manager._tier_poll_thread is not None and manager._tier_poll_thread.is_alive()
    stores, loads = record(tier_of(first)), record(tier_of(second))

    key, payload = key_of(4), os.urandom(CHUNK)
    store(first, request(first, "a"), {key: payload}, settle=False)
    # No step on this thread from here: only the poll thread can retire the cascade.
    wait_for(lambda: not pending(first), what="the cascade retired by the poll thread")
    assert [(thread, len(jobs)) for thread, jobs in stores] == [("vllm_offload_tier_poll", 1)]

    context = request(second, "b")
    assert lookups_until(second, key, context, HIT_PENDING) == [RETRY, HIT_PENDING]  # submitted at that step's end
    wait_for(lambda: not pending(second), what="the promotion retired by the poll thread")
    assert [(thread, len(jobs)) for thread, jobs in loads] == [("vllm_offload_tier_poll", 1)]
    with second.lock:
        assert second.lookup(key, context) is HIT
    assert promoted_bytes(second, key, context) == payload


def test_a_server_whose_chunk_limit_is_below_a_pool_row_is_refused_at_start(engines, tmp_path):
    """A configuration that cannot work is refused before the engine serves: every store would be refused."""
    from tiercache.errors import InvalidArgument

    with ServerProcess("--host-mem", "4MiB", "--disk-size", "0", "--disk-dir", str(tmp_path / "small"),
                       "--max-chunk-size", "2KiB", "--no-data-channel") as small:
        with pytest.raises(InvalidArgument, match="--max-chunk-size"):
            engines(url=small.url)


def test_an_unreachable_server_is_a_miss_not_a_refusal(engines):
    manager = engines(url="grpc://127.0.0.1:1", lookup_deadline_s=0.2)  # nothing listens on port 1
    context = request(manager, "r1")
    answers = []

    def answered() -> bool:
        with manager.lock:
            answers.append(manager.lookup(key_of(7), context))
            manager.on_schedule_end(END)
        return answers[-1] != RETRY

    wait_for(answered, timeout_s=10, what="an answer from an unreachable server")
    assert answers[-1] == MISS


def test_the_short_name_resolves_to_the_tier_and_registering_twice_is_harmless():
    from tiercache.connector.vllm_tier.plugin import register
    from tiercache.connector.vllm_tier.tier import TierCacheTier
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    register()
    register()  # vLLM loads plugins once per process, but more than one process part may
    assert SecondaryTierFactory.get_tier_class({"type": "tiercache"}) is TierCacheTier
