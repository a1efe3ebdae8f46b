"""tiercache's KV events decoded by vLLM's own classes (vllm.distributed.kv_events, the vLLM of this venv): every live
batch and every replayed one of a real server process, over real ZMQ sockets, for a hybrid and an attention-only pod,
through puts, a replay from 0 and eviction; and the positional form (events.encoding: array, older vLLMs) decoded by
mirrors of vLLM's classes with `array_like=True` (how older vLLMs encoded them)."""

from __future__ import annotations

import logging
from typing import Union

import msgspec
import pytest
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from testkit.event_subscriber import Subscriber
from testkit.saved_chunks import chunks, engine_hash, prompt, spec_of
from tests.helpers import ServerProcess, wait_for
from tests.prefix.chains import ATTENTION, HYBRID
from tests.vllm.engine import ATTENTION as ENGINE_ATTENTION
from tests.vllm.engine import BLOCK, GDN, HASH_BLOCK, Engine
from tiercache.client import Client
from tiercache.config import EventsConfig
from tiercache.connector.prefix_cache import PrefixCache

decode = msgspec.msgpack.Decoder(KVEventBatch).decode


def array_like(cls: type) -> type:
    """A mirror of one of vLLM's event classes, same name (the tag), fields, order and defaults, encoded as a
    positional array: what vLLM's classes were before vllm#42892."""
    fields = []
    for f in msgspec.structs.fields(cls):
        if f.default is not msgspec.NODEFAULT:
            fields.append((f.name, f.type, f.default))
        elif f.default_factory is not msgspec.NODEFAULT:
            fields.append((f.name, f.type, msgspec.field(default_factory=f.default_factory)))
        else:
            fields.append((f.name, f.type))
    return msgspec.defstruct(cls.__name__, fields, array_like=True, tag=True, omit_defaults=True)


ARRAY_EVENTS = {cls: array_like(cls) for cls in (BlockStored, BlockRemoved, AllBlocksCleared)}
ArrayBatch = msgspec.defstruct("KVEventBatch", [("ts", float), ("events", list[Union[tuple(ARRAY_EVENTS.values())]]),
                                                ("data_parallel_rank", int | None, None)], array_like=True)
array_decoder = msgspec.msgpack.Decoder(ArrayBatch)


def decode_array(payload: bytes) -> KVEventBatch:
    """A positional batch, read with the mirrors, as vLLM's own classes (to check it as the map form is)."""
    batch = array_decoder.decode(payload)
    classes = {mirror: cls for cls, mirror in ARRAY_EVENTS.items()}
    events = [classes[type(e)](**msgspec.structs.asdict(e)) for e in batch.events]
    return KVEventBatch(batch.ts, events, batch.data_parallel_rank)


@pytest.fixture
def server():
    with ServerProcess("--events", "--host-mem", "256KiB", "--disk-size", "1MiB", "--no-data-channel") as process:
        yield process


def check(batch: KVEventBatch) -> None:
    """What routers rely on: known types, dense tokens, hashes that are never 0, media and locality."""
    assert isinstance(batch, KVEventBatch) and batch.data_parallel_rank == 0
    for event in batch.events:
        assert isinstance(event, (BlockStored, BlockRemoved, AllBlocksCleared)), event
        if isinstance(event, AllBlocksCleared):
            continue
        assert event.medium in ("CPU", "STORAGE") and event.locality == "LOCAL" and event.group_idx is not None
        assert all(0 < h < 2**64 for h in event.block_hashes)
        if isinstance(event, BlockStored):
            assert len(event.token_ids) == len(event.block_hashes) * event.block_size
            assert event.kv_cache_spec_kind in ("full_attention", "mamba")


@pytest.mark.parametrize("layout", [HYBRID, ATTENTION], ids=["hybrid", "attention"])
def test_every_event_decodes_with_vllms_classes(server, layout):
    spec = spec_of(layout)
    tokens = prompt(1, 100)
    with Client.from_url(server.url, same_host=False) as client:
        endpoints = client.register_pod("pod-a", "tiny", [spec.namespace], spec.shape, range(len(spec.shape.kinds)))
        subscriber = Subscriber(endpoints.endpoint, endpoints.replay_endpoint, decode).ready()
        try:
            client.put_many(spec.namespace, chunks(spec, tokens, kv=3, states=[64, 96] if layout is HYBRID else []))
            expected = 3 + (2 if layout is HYBRID else 0)  # the blocks, and a hybrid's checkpoints at 64 and 96
            stored = []
            while len(stored) < expected:
                _, _, batch = subscriber.next()
                check(batch)
                stored += [e for e in batch.events if isinstance(e, BlockStored)]
            attention = [e for e in stored if e.kv_cache_spec_kind == "full_attention"]
            assert [e.block_hashes for e in attention] == [[engine_hash(tokens, k * 32)] for k in (1, 2, 3)]
            assert attention[1].parent_block_hash == attention[0].block_hashes[0]
            assert attention[2].token_ids == tokens[64:96]
            assert len(stored) == expected
            frames = subscriber.replay(0)
            for _, _, batch in frames:
                check(batch)
            first = frames[0][2].events
            assert isinstance(first[0], AllBlocksCleared) and first[1:] == stored
            for seed in range(2, 14):  # eviction: removals and moves to STORAGE decode too
                client.put_many(spec.namespace, chunks(spec, prompt(seed, 100), kv=3, payload_bytes=64 << 10))
            for _, batch in subscriber.until(lambda b: any(isinstance(e, BlockRemoved) for e in b.events)):
                check(batch)
        finally:
            subscriber.close()


def test_the_array_encoding_decodes_with_mirrors_of_vllms_classes_and_not_as_maps():
    spec = spec_of(HYBRID)
    tokens = prompt(1, 100)
    flags = ("--events", "--events-encoding", "array", "--host-mem", "256KiB", "--no-data-channel")
    with ServerProcess(*flags) as server, Client.from_url(server.url, same_host=False) as client:
        endpoints = client.register_pod("pod-a", "tiny", [spec.namespace], spec.shape, range(len(spec.shape.kinds)))
        raw = Subscriber(endpoints.endpoint, endpoints.replay_endpoint, lambda payload: payload).ready()
        try:
            client.put_many(spec.namespace, chunks(spec, tokens, kv=3, states=[64, 96]))
            stored = []
            while len(stored) < 5:
                _, _, payload = raw.next()
                batch = decode_array(payload)
                check(batch)
                stored += [e for e in batch.events if isinstance(e, BlockStored)]
                if batch.events:
                    with pytest.raises(msgspec.ValidationError, match="Expected `object`, got `array`"):
                        decode(payload)  # positional, not maps
            attention = [e for e in stored if e.kv_cache_spec_kind == "full_attention"]
            assert [e.block_hashes for e in attention] == [[engine_hash(tokens, k * 32)] for k in (1, 2, 3)]
            assert attention[2].token_ids == tokens[64:96] and attention[2].locality == "LOCAL"
            first = decode_array(raw.replay(0)[0][2]).events
            assert isinstance(first[0], AllBlocksCleared) and first[1:] == stored
            client.delete(spec.namespace, [chunks(spec, tokens, kv=3)[2].key])  # the third block: a BlockRemoved
            while True:
                events = decode_array(raw.next()[2]).events
                removed = {e.group_idx: e.block_hashes for e in events if isinstance(e, BlockRemoved)}
                if removed:  # the block, and the checkpoint at its end (the recurrent group's mamba block)
                    assert removed[0] == [engine_hash(tokens, 96)] and set(removed) == {0, 1}
                    break
        finally:
            raw.close()


def test_the_connector_registers_its_engine_and_its_blocks_carry_vllms_hashes(start_server):
    """vLLM's real scheduler with `events_pod_id`: the scheduler registers the engine, and the blocks the server then
    publishes are named as vLLM names them (its block hashes, its KV cache group indices)."""
    server = start_server(events=EventsConfig(enabled=True))
    engine = Engine(server.url, extra={"events_pod_id": "pod-v"})
    try:
        endpoints = server.events.endpoints()["pod-v"]
        assert endpoints.topic.startswith("kv@pod-v@")
        subscriber = Subscriber(endpoints.endpoint, endpoints.replay_endpoint, decode).ready()
        try:
            tokens = prompt(5, 100)
            request = engine.add("a", tokens, 3)
            engine.run("a")
            groups = [set(g.layer_names) for g in engine.kv_config.kv_cache_groups]
            attention, gdn = groups.index(set(ENGINE_ATTENTION)), groups.index(set(GDN))
            expected = [int.from_bytes(request.block_hashes[k * BLOCK // HASH_BLOCK - 1], "big") & (2**64 - 1)
                        for k in (1, 2, 3)]
            stored: list[BlockStored] = []
            while len([e for e in stored if e.kv_cache_spec_kind == "full_attention"]) < 3:
                _, _, batch = subscriber.next()
                check(batch)
                stored += [e for e in batch.events if isinstance(e, BlockStored)]
            blocks = [e for e in stored if e.kv_cache_spec_kind == "full_attention"]
            assert [e.block_hashes for e in blocks] == [[h] for h in expected]
            assert {e.group_idx for e in blocks} == {attention}
            assert blocks[2].token_ids == tokens[64:96] and blocks[2].parent_block_hash == expected[1]
            assert {e.group_idx for e in stored if e.kv_cache_spec_kind == "mamba"} <= {gdn}
            # The pod query hashes as the connector does (the engine registered its u): it answers what the
            # connector's own Lookup finds, by tokens and by vLLM's hashes.
            spec = engine.connector.spec
            with Client.from_url(server.url, same_host=False) as client:
                cache = PrefixCache(client, spec, report=False, all_ranks=True)
                (answer,) = client.query_pods(tokens)
                assert answer.pod_id == "pod-v" and answer.matched_tokens == cache.lookup(tokens).hit.tokens > 0
                (answer,) = client.query_pods(block_hashes=expected)
                assert answer.matched_tokens == cache.lookup(tokens[:97]).hit.tokens
        finally:
            subscriber.close()
    finally:
        engine.close()


def test_the_connector_registers_its_engine_again_after_a_server_restart(tmp_path, caplog):
    """A deploy restarts `tiercache serve` (same port, same disk directory) while vLLM runs on. The next request's
    lookup tells vLLM's scheduler that the server does not know its pod; the scheduler registers it again in the
    background, asking for its old ports, so a router's subscriber that stayed connected receives AllBlocksCleared and
    then the inventory that survived on disk."""
    flags = ("--events", "--host-mem", "0", "--disk-dir", str(tmp_path / "disk"), "--no-data-channel")
    first = ServerProcess(*flags).start()
    second = None
    engine = Engine(first.url, extra={"events_pod_id": "pod-v"})
    try:
        registration = engine.connector.pod_registration
        endpoints = registration.endpoints
        subscriber = Subscriber(endpoints.endpoint, endpoints.replay_endpoint, decode).ready()
        try:
            tokens = prompt(5, 100)
            request = engine.add("a", tokens, 3)
            engine.run("a")
            expected = [int.from_bytes(request.block_hashes[k * BLOCK // HASH_BLOCK - 1], "big") & (2**64 - 1)
                        for k in (1, 2, 3)]
            stored: list[BlockStored] = []
            while len([e for e in stored if e.kv_cache_spec_kind == "full_attention"]) < 3:
                stored += [e for e in subscriber.next()[2].events if isinstance(e, BlockStored)]
            before = subscriber.replay(0)[0][2].events[1:]
            first.terminate()
            second = ServerProcess(*flags, port=first.port).start()
            with caplog.at_level(logging.INFO, logger="tiercache.connector.pod_registration"):
                sent = []

                def registered_again() -> bool:
                    # A new request's lookup finds the pod unknown. One that cannot reach the new server yet (gRPC
                    # reconnecting, the lookup breaker open) is a miss: the next request asks again.
                    if registration.registered_again == 0 and not registration.in_flight:
                        sent.append(f"b{len(sent)}")
                        engine.generate(sent[-1], prompt(6 + len(sent), 40), 1)
                    return registration.registered_again == 1
                wait_for(registered_again, timeout_s=60, what="the engine registered again", interval_s=0.2)
                assert registration.endpoints == endpoints  # its old ports: the SUB reconnects by itself
                subscriber.next()  # the new server's stream, on the socket that stayed connected
                frames = subscriber.replay(0)  # a router that sees the seq go back replays from 0
                check(frames[0][2])
                first_batch = frames[0][2].events
                assert isinstance(first_batch[0], AllBlocksCleared)
                after = first_batch[1:]
                # Everything advertised before the restart is on disk, and advertised again (with what request b
                # saved since, on the new server).
                assert [e.block_hashes for e in before if e.kv_cache_spec_kind == "full_attention"] == \
                    [[h] for h in expected]
                assert all(e in after for e in before) and {e.medium for e in after} == {"STORAGE"}
                engine.generate("c", prompt(99, 40), 1)  # later lookups find the pod known: no second registration
                assert registration.registered_again == 1
            again = [r for r in caplog.records if "registered it again" in r.getMessage()]
            assert len(again) == 1 and again[0].levelno == logging.INFO
        finally:
            subscriber.close()
    finally:
        engine.close()
        first.kill()
        if second is not None:
            second.kill()
