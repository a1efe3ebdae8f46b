"""The pods' event streams (tiercache.events.publisher) of real server processes, on real ZMQ sockets: the first batch
and live batches, replay from 0 as a snapshot in consecutive seqs, a subscriber that restarts and gets the same
inventory, events after eviction, after a server restart over the disk tier, and pods scoped by tenant."""

from __future__ import annotations

import pytest

from testkit.event_subscriber import Subscriber
from testkit.saved_chunks import chunks, engine_hash, prompt, spec_of
from tests.events.strict_router import Router
from tests.helpers import ServerProcess
from tests.prefix.chains import ATTENTION, HYBRID
from tests.server.test_security import NS_A, NS_B, TOKEN_A, TOKEN_B, tenants_file  # noqa: F401 - a fixture
from tiercache.client import Client, ConnectionSettings
from tiercache.errors import NotFound, PermissionDenied

TOPIC = b"kv@pod-a@tiny"


@pytest.fixture
def served(tmp_path):
    """served(*flags) -> a running `tiercache serve --events`, stopped afterwards."""
    processes = []

    def start(*flags: str) -> ServerProcess:
        process = ServerProcess("--events", "--host-mem", "4MiB", "--no-data-channel", *flags).start()
        processes.append(process)
        return process

    yield start
    for process in processes:
        process.kill()


def register(client: Client, layout=HYBRID, pod_id: str = "pod-a"):
    spec = spec_of(layout)
    return client.register_pod(pod_id, "tiny", [spec.namespace], spec.shape, range(len(spec.shape.kinds)))


def types(batch) -> list[str]:
    return [event["type"] for event in batch[1]]


def inventory(subscriber: Subscriber, start: int = 0, frames: list | None = None) -> Router:
    """What a router holds after replaying from `start` (or the replay `frames` got from there); the replay's seqs
    are consecutive from start."""
    frames = subscriber.replay(start) if frames is None else frames
    assert [seq for _, seq, _ in frames] == list(range(start, start + len(frames)))
    assert {topic for topic, _, _ in frames} == {TOPIC}
    router = Router()
    for _, _, batch in frames:
        router.apply(batch[1])
    return router


def test_a_pod_registered_after_its_saves_gets_its_inventory_first_and_changes_after(served):
    server = served()
    spec = spec_of(HYBRID)
    tokens = prompt(1, 100)
    with Client.from_url(server.url, same_host=False) as client:
        client.put_many(spec.namespace, chunks(spec, tokens, kv=3, states=[64]))
        endpoints = register(client)
        assert endpoints.topic == TOPIC.decode()
        subscriber = Subscriber(endpoints.endpoint, endpoints.replay_endpoint).ready()
        try:
            router = inventory(subscriber)  # a router that connects late replays from 0
            assert set(router.blocks(0)) == {engine_hash(tokens, 32), engine_hash(tokens, 64)}
            client.put_many(spec.namespace, chunks(spec, tokens, states=[96]))
            seen = subscriber.until(lambda batch: "BlockStored" in types(batch))
            _, batch = seen[-1]
            assert batch[2] == 0 and [e["block_hashes"] for e in batch[1] if e["kv_cache_spec_kind"] ==
                                      "full_attention"] == [[engine_hash(tokens, 96)]]
            router.apply(batch[1])
            assert inventory(subscriber).held == router.held  # a restarted subscriber gets the same inventory
            last = seen[-1][0]
            tail = inventory(subscriber, last)  # a replay from a later seq: still the whole inventory, in one frame
            assert tail.held == router.held
        finally:
            subscriber.close()


def test_streams_are_consecutive_and_beat_when_idle(served):
    server = served()
    with Client.from_url(server.url, same_host=False) as client:
        endpoints = register(client)
        subscriber = Subscriber(endpoints.endpoint, endpoints.replay_endpoint).ready()
        try:
            seqs = [seq for seq, _ in subscriber.until(lambda batch: True, timeout_s=5)]
            seqs += [subscriber.next(5)[1] for _ in range(2)]  # heartbeats: empty batches, one a second
            assert seqs == list(range(seqs[0], seqs[0] + 3))
        finally:
            subscriber.close()


def test_eviction_moves_blocks_to_storage_and_losses_remove_them(served):
    server = served("--host-mem", "256KiB", "--disk-size", "1MiB")  # 2 + 15 blocks of 64 KiB
    spec = spec_of(ATTENTION)
    with Client.from_url(server.url, same_host=False) as client:
        endpoints = register(client, ATTENTION)
        subscriber = Subscriber(endpoints.endpoint, endpoints.replay_endpoint).ready()
        try:
            router = inventory(subscriber)
            applied = [-1]  # the seq of the last live batch the router applied

            def follow(until) -> list:
                seen = []
                while not until(seen):
                    _, applied[0], batch = subscriber.next()
                    router.apply(batch[1])
                    seen += batch[1]
                return seen

            for seed in range(4):  # 12 blocks: the host tier's two, the rest demoted to disk
                client.put_many(spec.namespace, chunks(spec, prompt(seed, 100), kv=3, payload_bytes=64 << 10))
            follow(lambda seen: len(router.blocks(0)) == 12)
            assert sorted(router.blocks(0).values()) == ["CPU"] * 2 + ["STORAGE"] * 10
            for seed in range(4, 12):  # more than both tiers hold: the oldest chains shrink, then go
                client.put_many(spec.namespace, chunks(spec, prompt(seed, 100), kv=3, payload_bytes=64 << 10))
            seen = follow(lambda seen: any(e["type"] == "BlockRemoved" and e["medium"] == "STORAGE" for e in seen))
            assert any(e["type"] == "BlockRemoved" and e["medium"] == "CPU" for e in seen)  # moved down
            # A replay now holds every batch the server published so far; the server may still have been evicting
            # after the batch the router stopped at, so the router follows the live stream up to the replay's last
            # batch before the two are compared.
            frames = subscriber.replay(0)
            follow(lambda _: applied[0] >= frames[-1][1])
            assert inventory(subscriber, frames=frames).held == router.held
        finally:
            subscriber.close()


def test_the_inventory_survives_a_server_restart_over_the_disk_tier(served, tmp_path):
    disk = tmp_path / "disk"
    spec = spec_of(HYBRID)
    tokens = prompt(2, 100)
    first = served("--host-mem", "0", "--disk-dir", str(disk))
    with Client.from_url(first.url, same_host=False) as client:
        client.put_many(spec.namespace, chunks(spec, tokens, kv=3, states=[64, 96]))
        endpoints = register(client)
    subscriber = Subscriber(endpoints.endpoint, endpoints.replay_endpoint).ready()
    before = inventory(subscriber).held
    subscriber.close()
    first.terminate()
    second = served("--host-mem", "0", "--disk-dir", str(disk))
    with Client.from_url(second.url, same_host=False) as client:
        endpoints = register(client)
    subscriber = Subscriber(endpoints.endpoint, endpoints.replay_endpoint).ready()
    try:
        after = inventory(subscriber).held
    finally:
        subscriber.close()
    assert len(before) == 3 + 2 and after == before
    assert {e.medium for e in after.values()} == {"STORAGE"}


def test_registering_needs_events_on_and_a_pod_is_its_tenants(served, tenants_file):  # noqa: F811
    plain = ServerProcess("--host-mem", "1MiB").start()
    try:
        with Client.from_url(plain.url) as client, pytest.raises(NotFound):
            register(client)
    finally:
        plain.kill()
    server = served("--tenants-file", tenants_file)
    shape = spec_of(HYBRID).shape
    with Client(ConnectionSettings(url=server.url, token=TOKEN_A)) as a, \
            Client(ConnectionSettings(url=server.url, token=TOKEN_B)) as b:
        with pytest.raises(PermissionDenied):  # b's pod cannot watch a's namespace
            b.register_pod("pod-b", "tiny", [NS_A], shape, [0, 1])
        a.register_pod("pod-a", "tiny", [NS_A], shape, [0, 1])
        with pytest.raises(PermissionDenied):  # nor take over a's pod
            b.register_pod("pod-a", "tiny", [NS_B], shape, [0, 1])
        b.register_pod("pod-b", "tiny", [NS_B], shape, [0, 1])


def test_registering_again_starts_the_stream_over_and_unregistering_ends_it(served):
    server = served()
    spec = spec_of(HYBRID)
    tokens = prompt(3, 100)
    with Client.from_url(server.url, same_host=False) as client:
        client.put_many(spec.namespace, chunks(spec, tokens, kv=3, states=[96]))
        endpoints = register(client)
        subscriber = Subscriber(endpoints.endpoint, endpoints.replay_endpoint).ready()
        try:
            assert register(client) == endpoints  # an engine that restarted: same sockets, the seq goes on
            seen = subscriber.until(lambda batch: "AllBlocksCleared" in types(batch))
            router = Router()
            router.apply(seen[-1][1][1])
            assert len(router.blocks(0)) == 3  # the whole inventory follows the clear
            client.unregister_pod("pod-a")
            seen = subscriber.until(lambda batch: types(batch) == ["AllBlocksCleared"])
            with pytest.raises(TimeoutError):  # nothing after the last batch: the stream is closed
                subscriber.next(2)
        finally:
            subscriber.close()


def _cpu_ticks(thread) -> int:
    """User + system CPU time of one of this process's threads, in clock ticks (Linux /proc)."""
    fields = open(f"/proc/self/task/{thread.native_id}/stat").read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def test_the_events_thread_sleeps_while_no_pod_is_registered():
    """zmq's poll returns at once when it has no socket to poll: with no pod registered the thread must wait, not
    spin (it held the interpreter's lock in every round and starved an in-process engine's thread)."""
    import threading
    import time

    from tiercache.config import EventsConfig, HostTierConfig, MiB
    from tiercache.events.publisher import EventStreams
    from tiercache.events.restorable import RestorableIndex
    from tiercache.store.tiered import TieredStore
    from tiercache.tiers.host import host_tier

    store = TieredStore([host_tier(HostTierConfig(capacity_bytes=4 * MiB, shared_memory=False))])
    streams = EventStreams(RestorableIndex(store), EventsConfig(enabled=True, flush_interval_s=0.01))
    try:
        thread = next(t for t in threading.enumerate() if t.name == "tiercache-kv-events")
        before, started = _cpu_ticks(thread), time.monotonic()
        while time.monotonic() - started < 2.0:  # a hundred and more flush intervals of wall time
            time.sleep(0.1)
        assert _cpu_ticks(thread) - before < 50  # under half a second of CPU in two seconds: not a busy loop
    finally:
        streams.close()
        store.close()
