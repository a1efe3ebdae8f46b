"""The vLLM connector's worker loads and saves (tiercache.connector.vllm.loads, .saves) on paged caches laid out as
vLLM's are, against a real tiercache server: a step's saves gathered into a reused staging buffer and put in the
background, loads fetched into staging buffers and copied into blocks, byte for byte. On CPU tensors here; the same
tests run the CUDA branch (side streams, events, pinned staging) with `-m gpu` wherever a GPU exists."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from tests.helpers import ServerProcess, wait_for
from tiercache.client import Client
from tiercache.connector.vllm.layout import PagedViews, PoolSets
from tiercache.connector.vllm.loads import Loads
from tiercache.connector.vllm.plan import Job, Transfer
from tiercache.connector.vllm.salts import namespaces
from tiercache.connector.vllm.saves import Saves
from tiercache.connector.vllm.worker_stats import WorkerStats
from tiercache.prefix.objects import CacheSpec, ObjectKind, object_ref
from tiercache.prefix.presets import preset

BLOCKS, N = 12, 64


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])]


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--host-mem", "64MiB", "--disk-size", "0") as process:
        yield process


def _views(device: str, seed: int) -> PagedViews:
    """One attention group of two layers (pages of 4 KiB), two Mamba groups of two layers each (state bytes of
    different sizes): a state object spans two pool sets, as in models whose recurrent layers form two groups."""
    generator = torch.Generator().manual_seed(seed)

    def pool(row_bytes: int) -> torch.Tensor:
        return torch.randint(0, 256, (BLOCKS, row_bytes), dtype=torch.uint8, generator=generator).to(device)
    return PagedViews(attention=((pool(4096), pool(4096)),), states=((pool(1000), pool(3000)), (pool(520), pool(8))))


@dataclass
class Worker:
    """A worker's two directions, made and registered as the connector makes them (worker_side.py)."""

    spec: CacheSpec
    views: PagedViews
    client: Client
    loads: Loads
    saves: Saves
    stats: WorkerStats

    def namespace(self, salt: str) -> str:
        return namespaces(self.spec)[salt]

    def drain(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        return self.saves.drain(deadline) and self.loads.drain(deadline)

    def stop(self) -> None:
        self.saves.stop()
        self.loads.stop()
        self.client.close()


def _worker(server, device: str, seed: int) -> Worker:
    spec = CacheSpec.for_layout(preset("qwen3.5-0.8b"), chunk_tokens=N)
    views, client, stats, names = _views(device, seed), Client.from_url(server.url), WorkerStats(), namespaces(spec)
    worker = Worker(spec, views, client, Loads(client, names, 8 << 20, stats),
                    Saves(client, names, 8 << 20, stats, engine_blocks=True), stats)
    pools = PoolSets(views)
    worker.loads.register(pools, lambda: None)
    worker.saves.register(pools, lambda: None)
    return worker


def _jobs(spec: CacheSpec, prompt_seed: int) -> list[Job]:
    """Two requests' saves: kv blocks 2 and 5 and a state in blocks (7, 8); kv block 3 and a state in (9, 10)."""
    jobs = []
    for req, (kv_blocks, state_blocks) in enumerate([((2, 5), (7, 8)), ((3,), (9, 10))]):
        tokens = np.random.default_rng(prompt_seed + req).integers(3, 1000, 3 * N + 5)
        hashes = spec.hashes(tokens)
        recurrent = len(spec.layout.groups) - 1
        refs = [Transfer(object_ref(spec, hashes, ObjectKind.KV, N * (i + 1), 0), (block,))
                for i, block in enumerate(kv_blocks)]
        refs.append(Transfer(object_ref(spec, hashes, ObjectKind.STATE, 2 * N, recurrent), state_blocks,
                             running=True))
        jobs.append(Job(f"r{req}", "", tuple(refs), finish=req == 1))
    return jobs


def _saved_finished(worker: Worker) -> set[str]:
    """The end-of-request saves reported, over as many steps as their copies take."""
    saved: set[str] = set()
    wait_for(lambda: saved.update(worker.saves.finished()) or saved, timeout_s=60,
             what="end-of-request saves reported")
    return saved


def _object_bytes(views: PagedViews, transfer: Transfer) -> bytes:
    pools = views.states if transfer.ref.kind is ObjectKind.STATE else views.attention[transfer.ref.group]
    if transfer.ref.kind is ObjectKind.STATE:
        return b"".join(bytes(p[block].cpu().numpy()) for pool_set, block in zip(pools, transfer.blocks)
                        for p in pool_set)
    return b"".join(bytes(p[transfer.blocks[0]].cpu().numpy()) for p in pools)


@pytest.mark.parametrize("device", DEVICES)
def test_saves_of_a_step_are_stored_byte_for_byte_and_load_back_into_other_blocks(server, device):
    saver = _worker(server, device, seed=1)
    jobs = _jobs(saver.spec, prompt_seed=10 if device == "cpu" else 20)
    saver.saves.save(jobs)
    # The finished request's blocks may be freed once its bytes are copied out (on CUDA: once its event is done).
    assert _saved_finished(saver) == {"r1"}
    assert saver.drain(30)
    namespace = saver.namespace("")
    for transfer in (t for job in jobs for t in job.transfers):
        assert saver.client.get(namespace, transfer.ref.key) == _object_bytes(saver.views, transfer)
    assert saver.stats.objects_saved == 5 and saver.stats.saves_dropped == 0
    # Another engine loads them into blocks of its own: a load job per request, reported in an idle step.
    loader = _worker(server, device, seed=2)
    moved = [Job(job.req_id, "", tuple(Transfer(t.ref, tuple(b + 1 for b in t.blocks)) for t in job.transfers))
             for job in jobs]
    loader.loads.start(moved)
    loaded, failed = loader.loads.ended(idle=True)
    assert loader.drain(30)
    loaded |= loader.loads.ended().ended
    assert loaded == {"r0", "r1"} and not failed
    for original, copied in zip((t for j in jobs for t in j.transfers), (t for j in moved for t in j.transfers)):
        assert _object_bytes(loader.views, copied) == _object_bytes(saver.views, original)
    assert loader.stats.loads_done == 2
    saver.stop()
    loader.stop()


@pytest.mark.parametrize("device", DEVICES)
def test_a_load_with_an_object_missing_fails_whole_and_writes_nothing(server, device):
    saver = _worker(server, device, seed=3)
    jobs = _jobs(saver.spec, prompt_seed=30 if device == "cpu" else 40)
    saver.saves.save(jobs[:1])
    assert saver.drain(30)
    loader = _worker(server, device, seed=4)
    before = [p.clone() for p in loader.views.attention[0]]
    loader.loads.start(jobs[1:])  # never saved
    assert loader.drain(30)
    loaded, failed = loader.loads.ended()
    assert failed == {"r1"} and loaded == {"r1"}  # reported, as failed: vLLM recomputes it
    assert all(torch.equal(a, b) for a, b in zip(before, loader.views.attention[0]))
    saver.stop()
    loader.stop()


def test_saves_beyond_the_pending_bound_are_dropped_and_finished_requests_still_released(server):
    saver = _worker(server, "cpu", seed=5)
    saver.saves.staging.limit_bytes = 1  # no room at all
    jobs = _jobs(saver.spec, prompt_seed=50)
    saver.saves.save(jobs)
    assert saver.saves.finished() == {"r1"} and saver.stats.saves_dropped == 5
    assert saver.drain(10) and saver.stats.objects_saved == 0
    saver.stop()


def test_staging_buffers_are_reused(server):
    saver = _worker(server, "cpu", seed=6)
    for step in range(4):
        saver.saves.save(_jobs(saver.spec, prompt_seed=60 + 2 * step))
        assert saver.drain(30)
    assert saver.stats.objects_saved == 20
    assert saver.saves.staging.kept == 1  # one buffer served every step
    saver.stop()


def test_once_steps_are_fenced_a_step_s_saves_are_copied_beside_the_engine_before_the_next_step_writes(server):
    saver = _worker(server, "cpu", seed=7)
    saver.saves.before_step()  # vLLM calls it first thing in every step: from now on gathers run on their own thread
    jobs = _jobs(saver.spec, prompt_seed=70)
    expected = {t.ref.key: _object_bytes(saver.views, t) for job in jobs for t in job.transfers}
    gather, on_engine_thread = saver.saves._gather, threading.get_ident()
    threads = []

    def slow_gather(transfers, rows):  # a gather that takes a while, so a missing fence shows
        threads.append(threading.get_ident())
        time.sleep(0.3)
        return gather(transfers, rows)
    saver.saves._gather = slow_gather
    saver.saves.save(jobs)
    # The request that ended was copied here (vLLM frees its blocks at this step's end); the other one beside.
    assert saver.saves.finished() == {"r1"}
    saver.saves.before_step()  # the next step: it may write any block once this returns
    for pools in (*saver.views.attention, *saver.views.states):
        for pool in pools:
            pool.fill_(0)
    assert saver.drain(30)
    namespace = saver.namespace("")
    assert {key: saver.client.get(namespace, key) for key in expected} == expected
    assert threads[0] == on_engine_thread and threads[1] != on_engine_thread
    saver.stop()


def test_a_gather_that_fails_beside_the_engine_loses_its_save_not_the_engine(server, caplog):
    saver = _worker(server, "cpu", seed=8)
    saver.saves.before_step()

    def broken_gather(transfers, rows):
        raise RuntimeError("injected gather fault")
    saver.saves._gather = broken_gather
    saver.saves.save([job for job in _jobs(saver.spec, prompt_seed=80) if not job.finish])
    saver.saves.before_step()
    assert saver.drain(30) and saver.stats.objects_saved == 0
    assert "injected gather fault" in caplog.text
    assert saver.saves.staging.out_bytes == 0  # its staging buffer went back
    saver.stop()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_saves_and_loads_never_make_vllm_s_thread_wait_for_its_stream(server):
    """vLLM's thread queues a step's saves and a request's load and goes on: while the GPU still runs the step's
    work (a long kernel on vLLM's stream), saves.save, loads.start and loads.ended return; the bytes are right once it
    ends."""
    saver, loader = _worker(server, "cuda", seed=11), _worker(server, "cuda", seed=12)
    warm = _jobs(saver.spec, prompt_seed=110)
    saver.saves.save(warm)  # kernels compiled, staging buffers made
    assert saver.drain(30) and _saved_finished(saver) == {"r1"}
    jobs = _jobs(saver.spec, prompt_seed=120)
    torch.cuda._sleep(4_000_000_000)  # the step's forward pass, still running on the GPU
    busy = torch.cuda.Event()
    busy.record()
    saver.saves.save(jobs)
    assert saver.saves.finished() == set()  # not copied yet: vLLM keeps the finished request's blocks
    loader.loads.start(warm)
    loader.loads.ended(idle=True)
    assert not busy.query()  # vLLM's thread never waited for its stream
    assert _saved_finished(saver) == {"r1"}
    assert saver.drain(30) and loader.drain(30)
    namespace = saver.namespace("")
    for transfer in (t for job in jobs for t in job.transfers):
        assert saver.client.get(namespace, transfer.ref.key) == _object_bytes(saver.views, transfer)
    loaded = loader.loads.ended().ended
    assert loader.stats.loads_done == 2 and loader.stats.loads_failed == 0, loaded
    for transfer in (t for job in warm for t in job.transfers):
        assert _object_bytes(loader.views, transfer) == _object_bytes(saver.views, transfer)
    saver.stop()
    loader.stop()
