"""The vLLM connector's put queue (tiercache.connector.vllm.put_queue) against a real server: steps' saves sent
together, each put at most `batch_s` late on its own, sooner once `batch_bytes` wait, flushed on demand; staging
buffers always go back."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from tests.helpers import ServerProcess
from tiercache.client import Client
from tiercache.connector.vllm.put_queue import Put, PutQueue
from tiercache.connector.vllm.staging import StagingPool
from tiercache.prefix.objects import CacheSpec, ObjectKind, object_ref
from tiercache.prefix.presets import preset

N = 64
SPEC = CacheSpec.for_layout(preset("qwen3.5-0.8b"), chunk_tokens=N)


class _Copied:
    def synchronize(self) -> None:
        pass


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--host-mem", "64MiB", "--disk-size", "0") as process:
        yield process


def _put(staging: StagingPool, seed: int, objects: int = 3, size: int = 4096) -> tuple[Put, dict]:
    """A step's put of `objects` kv objects of one prompt, and their bytes by key."""
    tokens = np.random.default_rng(seed).integers(3, 1000, objects * N + 1)
    hashes = SPEC.hashes(tokens)
    buffer = staging.take(objects * size)  # (of the size class above)
    buffer[:objects * size] = torch.randint(0, 256, (objects * size,), dtype=torch.uint8,
                                            generator=torch.Generator().manual_seed(seed))
    view = memoryview(buffer.numpy()).cast("B")
    payloads = {object_ref(SPEC, hashes, ObjectKind.KV, N * (i + 1), 0): view[i * size:(i + 1) * size]
                for i in range(objects)}
    return Put({SPEC.namespace: payloads}, _Copied(), buffer, objects * size), {
        ref.key: bytes(data) for ref, data in payloads.items()}


def _stored(client: Client, expected: dict) -> bool:
    found = client.get_many(SPEC.namespace, list(expected))
    return all(f is not None and bytes(f.data) == data for f, data in zip(found, expected.values()))


def _wait_for(condition, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _queue(server, staging: StagingPool, saved: list, **settings) -> PutQueue:
    return PutQueue(Client.from_url(server.url), staging, _stored_into(saved), **settings)


def _stored_into(saved: list):
    """An on_sent that keeps (objects stored, bytes stored) of each stored batch."""
    return lambda result: result.objects and saved.append((result.objects, sum(result.bytes_by_tier.values())))


def test_steps_waiting_together_go_as_one_put(server):
    staging, saved = StagingPool(8 << 20, pinned=False), []
    queue = _queue(server, staging, saved, batch_s=60.0)  # nothing is due on its own: only the flush sends
    steps = [_put(staging, seed) for seed in (1, 2, 3)]
    for put, _ in steps:
        queue.add(put)
    assert queue.batches == 0 and staging.out_bytes > 0
    assert queue.flush(30)
    assert queue.batches == 1 and saved == [(9, 9 * 4096)]
    assert staging.out_bytes == 0  # every step's buffer went back
    client = Client.from_url(server.url)
    assert all(_stored(client, expected) for _, expected in steps)
    queue.stop()


def test_a_put_is_sent_on_its_own_once_due(server):
    staging, saved = StagingPool(8 << 20, pinned=False), []
    queue = _queue(server, staging, saved, batch_s=0.05)
    put, expected = _put(staging, 4)
    queue.add(put)
    client = Client.from_url(server.url)
    assert _wait_for(lambda: _stored(client, expected))  # no flush: the batch came due
    assert _wait_for(lambda: staging.out_bytes == 0)
    queue.stop()


def test_enough_bytes_waiting_send_the_batch_before_it_is_due(server):
    staging, saved = StagingPool(8 << 20, pinned=False), []
    queue = _queue(server, staging, saved, batch_s=60.0, batch_bytes=2 * 3 * 4096)
    first, expected_first = _put(staging, 5)
    queue.add(first)
    second, expected_second = _put(staging, 6)
    queue.add(second)  # two steps' bytes: due
    client = Client.from_url(server.url)
    assert _wait_for(lambda: _stored(client, expected_first) and _stored(client, expected_second))
    # The server holds the objects before the sending thread counts its batch and reports it: wait for the report.
    assert _wait_for(lambda: saved)
    assert queue.batches == 1 and saved == [(6, 6 * 4096)]
    queue.stop()


def test_stop_drops_what_waits_and_gives_its_buffers_back(server):
    staging, saved = StagingPool(8 << 20, pinned=False), []
    queue = _queue(server, staging, saved, batch_s=60.0)
    put, expected = _put(staging, 7)
    queue.add(put)
    queue.stop()
    assert _wait_for(lambda: staging.out_bytes == 0)
    assert not _stored(Client.from_url(server.url), expected) and saved == []


def test_what_stop_drops_is_counted_as_dropped_at_shutdown(server):
    staging, results = StagingPool(8 << 20, pinned=False), []
    queue = PutQueue(Client.from_url(server.url), staging, results.append, batch_s=60.0)
    put, expected = _put(staging, 7)
    queue.add(put)
    queue.stop()
    assert _wait_for(lambda: staging.out_bytes == 0)
    assert [(r.objects, dict(r.dropped)) for r in results] == [(0, {"shutdown": len(expected)})]


def test_an_unreachable_server_drops_the_batch_and_returns_the_buffers():
    staging, saved = StagingPool(8 << 20, pinned=False), []
    with ServerProcess("--host-mem", "16MiB", "--disk-size", "0") as gone:
        client = Client.from_url(gone.url, timeout_s=2.0)
    queue = PutQueue(client, staging, saved.append, batch_s=0.0)
    put, expected = _put(staging, 8)
    queue.add(put)
    assert queue.flush(60)
    assert staging.out_bytes == 0  # nothing stored, nothing raised, and every object counted as not stored
    assert [(r.objects, dict(r.dropped)) for r in saved] == [(0, {"unreachable": len(expected)})]
    queue.stop()
