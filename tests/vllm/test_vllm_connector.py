"""TierCacheConnector under vLLM's real scheduler (see tests/vllm/engine.py for what is real and what stands in).

Every step's forward stand-in verifies that the KV and the GDN state a request continues from are what a full
recompute leaves, so each test below also proves that nothing wrong was loaded.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.certs import make_pki
from tests.vllm.engine import ATTENTION, BLOCK, GDN, HASH_BLOCK, Engine, kv_value, next_token, prompt, state_value
from tiercache.client import Client
from tiercache.config import EventsConfig, SecurityConfig
from tiercache.connector.vllm.settings import VllmSettings
from tiercache.errors import InvalidArgument
from tiercache.prefix.hashes import token_bytes
from tiercache.prefix.objects import ObjectKind, object_ref
from tiercache.record.keys import ChunkKey


@pytest.fixture
def server(start_server):
    # KV events on: such a server keeps the token ids and vLLM hashes the connector sends with its kv chunks (one
    # without events drops them at the door; tests/server/test_data_channel.py).
    return start_server(events=EventsConfig(enabled=True))


@pytest.fixture
def engines(server):
    made = []

    def make(url: str | None = None, **options) -> Engine:
        engine = Engine(url or server.url, **options)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()


def test_second_engine_loads_what_the_first_saved_byte_for_byte(server, engines):
    first, second = engines(), engines()
    tokens = prompt(1, 100)
    assert first.generate("a", tokens, 3) == (expected := first.outputs["a"])
    assert first.hits["a"] == 0

    assert second.generate("b", tokens, 3) == expected
    # The 100-token prompt hits at 96: vLLM splits the prefill at the last block boundary, where it commits a state.
    assert second.hits["b"] == 96
    assert second.forward.checked_states >= 1 and second.forward.checked_tokens >= 96
    # Counted as delivered once the workers reported the load done, and reported to the server as such.
    stats = second.connector.planner.stats
    assert (stats.loads_done, stats.loaded_tokens, stats.loads_failed) == (1, 96, 0)
    second.connector.delivery.flush()
    with Client.from_url(server.url) as client:
        assert client.stats()["delivered"]["loaded_tokens_by_tier"] == {"host": 96}

    # What the worker loaded is byte-identical to what tiercache holds (and to what the first engine computed).
    spec = second.connector.spec
    hashes = spec.hashes(np.asarray(tokens[:96]))
    with Client.from_url(server.url) as client:
        for k in range(1, 4):
            chunk = client.get(spec.namespace, object_ref(spec, hashes, ObjectKind.KV, k * BLOCK, 0).key)
            expected_rows = torch.stack([torch.stack([kv_value(tokens[:i + 1], layer)
                                                      for i in range(k * BLOCK - BLOCK, k * BLOCK)])
                                         for layer in ATTENTION])
            # A kv object is each layer's page of the block as vLLM lays it out (LBNHC: token rows of K|V).
            saved = torch.frombuffer(bytearray(chunk), dtype=torch.float32).view(2, BLOCK, 32)
            assert torch.equal(saved, expected_rows)
        state = client.get(spec.namespace, object_ref(spec, hashes, ObjectKind.STATE, 96, 1).key)
        size = len(state) // len(GDN)
        assert state == b"".join(state_value(tokens[:96], layer, size).numpy().tobytes() for layer in GDN)


def test_a_hit_below_the_block_size_comes_from_a_tail(engines):
    first, second = engines(), engines()
    turn_one = prompt(2, 20)
    reply = first.generate("t1", turn_one, 3)
    # The first turn ends with 22 tokens computed (20 + 2 fed back); its tail and state are saved at 22.
    turn_two = turn_one + reply + prompt(3, 8)
    assert second.generate("t2", turn_two, 2) == first.generate("t2-recompute", turn_two, 2)
    assert second.hits["t2"] == 22  # < 32: vLLM alone reuses only whole 32-token blocks (or 16 with its hashes)


def test_a_diverging_prompt_resumes_at_the_deepest_shared_boundary_state(engines):
    # vLLM materializes a state only where a prefill chunk ends, and hands over the ones it retains: with 32-token
    # chunks and a 32-token retention interval, a state at every block boundary.
    first, second = engines(retention_interval=BLOCK, max_num_batched_tokens=BLOCK), engines()
    shared = prompt(4, 70)
    first.generate("a", shared + prompt(5, 30), 2)
    other = shared + prompt(6, 40)
    assert second.generate("b", other, 2) == first.generate("b-recompute", other, 2)
    assert second.hits["b"] == 64


def test_multi_turn_chat_hits_the_previous_turns_end(engines):
    engine, fresh = engines(), engines()
    history = prompt(7, 50)
    for turn in range(3):
        reply = engine.generate(f"turn{turn}", history, 4)
        if turn:
            assert engine.hits[f"turn{turn}"] >= len(history) - 12, "the previous turn's end was not reused"
        history = history + reply + prompt(100 + turn, 9)
    assert fresh.generate("check", history, 4) == engine.generate("again", history, 4)


def test_a_preempted_request_resumes_from_what_it_saved(engines):
    # 12 blocks of 32 tokens: three 100-token prompts fit, their outputs do not; vLLM preempts and later resumes.
    engine = engines(num_blocks=12, max_num_batched_tokens=64, max_model_len=256)
    reference = engines()
    prompts = {f"r{i}": prompt(10 + i, 100) for i in range(3)}
    for req_id, tokens in prompts.items():
        engine.add(req_id, tokens, 60)
    engine.run(*prompts, max_steps=500)
    assert engine.preemptions, "the test must preempt a request"
    assert any(computed > 0 for _, computed in engine.resumed), engine.resumed
    # Every resumption asked tiercache again (its saved prefix may outlive vLLM's own evicted blocks); here vLLM's
    # prefix cache still held the blocks, so the connector rightly claimed nothing beyond them.
    assert engine.connector.planner.stats.lookups == len(prompts) + len(engine.resumed)
    for req_id, tokens in prompts.items():
        assert engine.outputs[req_id] == reference.generate(req_id, tokens, 60)


@pytest.mark.parametrize("damage", ["deleted", "wrong_size"])
def test_a_failed_load_is_reported_and_recomputed(server, engines, damage):
    first, second = engines(), engines()
    tokens = prompt(20, 100)
    expected = first.generate("a", tokens, 2)
    spec = first.connector.spec
    hashes = spec.hashes(np.asarray(tokens))
    victim = object_ref(spec, hashes, ObjectKind.KV, 64, 0).key

    def damage_it() -> None:
        with Client.from_url(server.url) as client:
            client.delete(spec.namespace, [victim])
            if damage == "wrong_size":
                client.put(spec.namespace, victim, b"\0" * 100)

    second.before_load = damage_it  # between the scheduler's lookup and the worker's fetch
    assert second.generate("b", tokens, 2) == expected
    failed = [t for t in second.transfer_log if t.failed_recving]
    assert failed and failed[0].failed_recving == {"b"}
    assert second.hits["b"] == 0 and second.recomputed["b"] >= 100  # the failed load left nothing to reuse
    stats = second.connector.planner.stats
    assert (stats.loads_failed, stats.loaded_tokens) == (1, 0) and stats.failed_load_tokens == stats.load_tokens_planned


def test_a_dead_server_makes_misses_not_errors(engines, unused_port):
    engine = engines(url=f"grpc://127.0.0.1:{unused_port}")
    tokens = prompt(30, 70)
    assert len(engine.generate("a", tokens, 3)) == 3 and engine.hits["a"] == 0


def test_cache_salt_separates_namespaces(engines):
    first, second = engines(), engines()
    tokens = prompt(40, 80)
    first.generate("a", tokens, 2, cache_salt="tenant-a")
    second.generate("b", tokens, 2, cache_salt="tenant-b")
    assert second.hits["b"] == 0
    second.generate("c", tokens, 2, cache_salt="tenant-a")
    assert second.hits["c"] == 64


def test_extra_config_is_checked():
    settings = VllmSettings.from_extra_config({"url": "grpc://h:1", "match_unit": 32, "tls_server_name": "cache"})
    assert (settings.match_unit, settings.connection.url, settings.connection.tls_server_name) == (
        32, "grpc://h:1", "cache")
    with pytest.raises(InvalidArgument, match="unknown kv_connector_extra_config keys"):
        VllmSettings.from_extra_config({"urll": "grpc://h:1"})
    with pytest.raises(InvalidArgument, match="together"):
        VllmSettings.from_extra_config({"tls_cert_file": "/client.pem"})


def test_mutual_tls_from_the_extra_config(start_server, engines, tmp_path):
    """The connection keys are every connector's (tiercache.client.settings): a vLLM engine reaches a server that
    requires client certificates, and one without a certificate gets misses, never a wrong answer or a crash."""
    pki = make_pki(tmp_path)
    server = start_server(security=SecurityConfig(tls_cert_file=pki.server_cert, tls_key_file=pki.server_key,
                                                  tls_client_ca_file=pki.ca))
    certified = {"tls_ca_file": pki.ca, "tls_cert_file": pki.client_cert, "tls_key_file": pki.client_key}
    first, second = engines(server.url, extra=certified), engines(server.url, extra=certified)
    anonymous = engines(server.url, extra={"tls_ca_file": pki.ca})
    tokens = prompt(70, 100)
    expected = first.generate("a", tokens, 3)
    assert second.generate("b", tokens, 3) == expected and second.hits["b"] == 96
    assert anonymous.generate("c", tokens, 3) == expected and anonymous.hits["c"] == 0


def test_async_scheduling_saves_the_end_of_a_request_that_stops_with_a_step_in_flight(engines):
    """vLLM's default async scheduling runs the step after a stop token before it knows the request stopped: the
    end-of-request save must still happen (the next chat turn's prefix), for the tokens that step computed."""
    first, second = engines(async_scheduling=True), engines()
    turn_one = prompt(50, 40)
    replies = []
    for _ in range(3):
        replies.append(next_token(turn_one + replies))
    stop = replies[-1]
    assert first.generate("a", turn_one, 10, stop_token_ids=[stop]) == replies
    # The stop token was fed back in the step in flight: the request ended with 43 tokens computed.
    turn_two = turn_one + replies + prompt(51, 8)
    second.generate("b", turn_two, 2)
    assert second.hits["b"] == len(turn_one) + len(replies)
    assert second.forward.checked_states >= 1  # the state it resumed from is the state after those 43 tokens


def test_without_kv_events_kv_chunks_carry_no_tokens(server, engines):
    """An engine that has no events published (no `events_pod_id`) sends no tokens or hashes, even to a server that
    would keep them: they would cost its scheduler and its step metadata for nothing."""
    engine = engines()
    tokens = prompt(4, 100)
    engine.add("a", tokens, 3)
    engine.run("a")
    spec = engine.connector.spec
    ref = object_ref(spec, spec.hashes(np.asarray(tokens)), ObjectKind.KV, BLOCK, 0)
    metas = dict(server.store.children(ChunkKey(spec.namespace, ref.parent)))
    assert not metas[ChunkKey(spec.namespace, ref.key)].tokens


def test_kv_chunks_carry_their_tokens_and_vllms_own_block_hash(server, engines):
    """The anchor group's kv chunks (and tails) carry their token ids and vLLM's block hash (low 64 bits,
    as vLLM's KV events publish it), so the server's events name blocks as the engine does; states carry none."""
    engine = engines(extra={"events_pod_id": "pod-t"})
    tokens = prompt(3, 100)
    request = engine.add("a", tokens, 3)
    engine.run("a")
    spec = engine.connector.spec
    hashes = spec.hashes(np.asarray(tokens))
    for k in range(1, 4):
        ref = object_ref(spec, hashes, ObjectKind.KV, k * BLOCK, 0)
        metas = dict(server.store.children(ChunkKey(spec.namespace, ref.parent)))
        meta = metas[ChunkKey(spec.namespace, ref.key)]
        assert meta.tokens == token_bytes(tokens[k * BLOCK - BLOCK:k * BLOCK])
        vllm_hash = request.block_hashes[k * BLOCK // HASH_BLOCK - 1]
        assert meta.engine_hash == int.from_bytes(vllm_hash, "big") & (2**64 - 1) != 0
        states = [m for key, m in metas.items() if key.key[-2] == ObjectKind.STATE]
        assert all(not m.tokens for m in states)
    # The request's end (past 96) saved a tail under the kv chunk at 96: its tokens, and no hash (vLLM has none).
    kv = object_ref(spec, hashes, ObjectKind.KV, 96, 0).key
    tails = [m for key, m in server.store.children(ChunkKey(spec.namespace, kv)) if key.key[-2] == ObjectKind.TAIL]
    assert tails and all(len(m.tokens) == 4 * m.prefix_tokens and m.engine_hash == 0 for m in tails)
