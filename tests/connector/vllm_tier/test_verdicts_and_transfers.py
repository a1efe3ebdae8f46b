"""The tier's two halves without vLLM, against a real server: lookups that never wait (verdicts) and store/load jobs
between a pool's slots and the server (transfers). vLLM's own manager drives them in tests/vllm/test_tier.py and the
engine in tests/vllm_engine/test_offload_tier.py; here each rule is pinned where it can fail alone."""

from __future__ import annotations

import itertools
import threading

import pytest

from tests.helpers import wait_for
from tiercache.client import Client
from tiercache.connector.vllm_tier.transfers import Job, Transfers
from tiercache.connector.vllm_tier.verdicts import Verdict, Verdicts

NAMESPACE = "tier-test@vllm-tier#0"
SLOT = 4096


class Pool:
    """A stand-in for vLLM's CPU pool: rows of SLOT bytes."""

    def __init__(self, slots: int) -> None:
        self.memory = bytearray(slots * SLOT)
        self.view = memoryview(self.memory)

    def slot(self, index: int) -> memoryview:
        return self.view[index * SLOT:(index + 1) * SLOT]

    def fill(self, index: int, byte: int) -> None:
        self.slot(index)[:] = bytes([byte]) * SLOT


@pytest.fixture
def client(start_server):
    with Client.from_url(start_server().url) as made:
        yield made


def transfers(client, pool, known=lambda keys: [False] * len(keys), max_pending=1 << 30) -> Transfers:
    return Transfers(client, lambda: NAMESPACE, pool.slot, SLOT, 2, max_pending, known)


def finished(made: Transfers, count: int) -> list:
    done = []
    wait_for(lambda: done.extend(made.finished()) or len(done) >= count, what=f"{count} finished jobs")
    return done


def test_a_stored_slot_loads_byte_for_byte_into_another_pool(client):
    source, target = Pool(4), Pool(4)
    source.fill(2, 0xAB)
    source.fill(3, 0xCD)
    stores = transfers(client, source)
    stores.submit(Job(1, [b"k-ab", b"k-cd"], [2, 3], load=False))
    assert finished(stores, 1)[0].ok == [b"k-ab", b"k-cd"]
    loads = transfers(client, target)
    loads.submit(Job(2, [b"k-cd", b"k-ab"], [0, 1], load=True))
    done = finished(loads, 1)[0]
    assert done.ok == [b"k-cd", b"k-ab"] and not done.failed and done.nbytes == 2 * SLOT
    assert bytes(target.slot(0)) == bytes(source.slot(3)) and bytes(target.slot(1)) == bytes(source.slot(2))
    stores.close()
    loads.close()


def test_a_load_reports_which_keys_it_could_not_bring(client):
    pool = Pool(3)
    client.put(NAMESPACE, b"here", b"\x01" * SLOT)
    client.put(NAMESPACE, b"short", b"\x01" * (SLOT - 1))  # not a slot's size: not this pool's chunk
    loads = transfers(client, pool)
    loads.submit(Job(7, [b"here", b"gone", b"short"], [0, 1, 2], load=True))
    done = finished(loads, 1)[0]
    assert done.ok == [b"here"] and done.failed == [b"gone", b"short"]
    assert loads.counts.load_failures == 2
    loads.close()


def test_stores_beyond_the_pending_bytes_are_shed_at_once_and_counted(client):
    pool = Pool(8)
    gate, entered = threading.Event(), []

    def held(keys):  # each I/O thread stops here, inside its store, until the gate opens
        entered.append(keys)
        gate.wait(10)
        return [False] * len(keys)

    stores = transfers(client, pool, known=held, max_pending=2 * SLOT)
    for job_id in range(2):
        stores.submit(Job(job_id, [f"k{job_id}".encode()], [job_id], load=False))
    wait_for(lambda: len(entered) == 2, what="both I/O threads in a store")
    for job_id in range(2, 4):  # queued: two slots' bytes, the limit
        stores.submit(Job(job_id, [f"k{job_id}".encode()], [job_id], load=False))
    stores.submit(Job(9, [b"a", b"b", b"c"], [4, 5, 6], load=False))
    shed = [f for f in stores.finished() if f.job_id == 9]
    assert shed and shed[0].failed == [b"a", b"b", b"c"] and stores.counts.shed_chunks == 3
    gate.set()
    stores.drain()
    assert not stores.pending() and stores.counts.stored_chunks == 4
    stores.close()


def test_a_server_that_is_gone_fails_the_job_and_raises_nothing(client, start_server):
    gone = Client.from_url("grpc://127.0.0.1:1", timeout_s=0.5)
    loads = transfers(gone, Pool(1))
    loads.submit(Job(3, [b"k"], [0], load=True))
    assert finished(loads, 1)[0].failed == [b"k"]
    loads.close()
    gone.close()


def test_a_lookup_answers_retry_at_once_then_what_the_server_holds(client):
    client.put(NAMESPACE, b"held", b"\x00" * SLOT)
    verdicts = Verdicts(lambda keys: client.exists(NAMESPACE, keys), deadline_s=10)
    assert verdicts.lookup(b"held", "r1") == Verdict.RETRY
    assert verdicts.lookup(b"absent", "r1") == Verdict.RETRY
    wait_for(lambda: verdicts.lookup(b"held", "r1") != Verdict.RETRY)
    wait_for(lambda: verdicts.lookup(b"absent", "r1") != Verdict.RETRY)
    assert verdicts.lookup(b"held", "r1") == Verdict.HIT and verdicts.lookup(b"absent", "r1") == Verdict.MISS
    verdicts.close()


def test_a_server_that_does_not_answer_is_a_miss_after_the_deadline():
    answer = threading.Event()
    verdicts = Verdicts(lambda keys: answer.wait(30) and [True] * len(keys), deadline_s=0.2)
    assert verdicts.lookup(b"k", "r1") == Verdict.RETRY
    wait_for(lambda: verdicts.lookup(b"k", "r1") == Verdict.MISS, timeout_s=5)
    answer.set()
    assert verdicts.counts.timed_out == 1
    verdicts.close()


def test_a_key_whose_load_failed_is_a_miss_until_this_tier_stores_it_again(client):
    client.put(NAMESPACE, b"k", b"\x00" * SLOT)
    verdicts = Verdicts(lambda keys: client.exists(NAMESPACE, keys), deadline_s=10)
    verdicts.lookup(b"k", "r1")
    wait_for(lambda: verdicts.lookup(b"k", "r1") == Verdict.HIT)
    verdicts.load_failed([b"k"])
    asked = verdicts.counts.asked
    for request in ("r1", "r2"):  # the same request, and a new one: not asked of the server again
        assert verdicts.lookup(b"k", request) == Verdict.MISS
    assert verdicts.counts.asked == asked
    verdicts.stored([b"k"])
    assert verdicts.lookup(b"k", "r2") == Verdict.HIT
    verdicts.close()


def test_answers_are_kept_while_a_request_that_asked_lives_and_asked_again_after(client):
    verdicts = Verdicts(lambda keys: client.exists(NAMESPACE, keys), deadline_s=10)
    verdicts.lookup(b"late", "r1")
    wait_for(lambda: verdicts.lookup(b"late", "r1") == Verdict.MISS)
    client.put(NAMESPACE, b"late", b"\x00" * SLOT)  # another engine stores it
    assert verdicts.lookup(b"late", "r1") == Verdict.MISS  # r1's answer stands while r1 lives
    verdicts.request_finished("r1")
    assert verdicts.lookup(b"late", "r2") == Verdict.RETRY
    wait_for(lambda: verdicts.lookup(b"late", "r2") == Verdict.HIT)
    verdicts.close()


def test_a_later_request_asks_again_about_a_miss_older_than_the_deadline(client):
    """Requests overlapping without end on a hot prefix must not keep a miss for ever (an outage's, or one from before
    another engine stored the key); a request that already has its answer keeps it."""
    verdicts = Verdicts(lambda keys: client.exists(NAMESPACE, keys), deadline_s=0.2)
    verdicts.lookup(b"hot", "r1")
    wait_for(lambda: verdicts.lookup(b"hot", "r1") == Verdict.MISS)
    client.put(NAMESPACE, b"hot", b"\x00" * SLOT)
    later = (f"r{i}" for i in itertools.count(2))  # a new request every poll, r1 alive all along
    wait_for(lambda: verdicts.lookup(b"hot", next(later)) == Verdict.HIT, timeout_s=5)
    assert verdicts.lookup(b"hot", "r1") == Verdict.HIT  # the new answer is shared
    verdicts.close()


def test_a_failed_key_is_asked_about_again_once_its_failure_is_old(client, monkeypatch):
    import tiercache.connector.vllm_tier.verdicts as verdicts_module

    monkeypatch.setattr(verdicts_module, "FAILED_KEY_S", 0.2)
    client.put(NAMESPACE, b"k", b"\x00" * SLOT)
    verdicts = Verdicts(lambda keys: client.exists(NAMESPACE, keys), deadline_s=10)
    verdicts.load_failed([b"k"])
    assert verdicts.lookup(b"k", "r1") == Verdict.MISS
    wait_for(lambda: verdicts.lookup(b"k", "r2") == Verdict.HIT, timeout_s=5)
    verdicts.close()
