"""The store-vs-retrieve correctness gate: real transformers models (tiny configs, random weights, CPU) restored
from every tier must reproduce a full recompute.

Exact, in the same shape: a restored prefill's next-token logits are torch.equal to those of a recompute from
scratch that splits the prompt as the restored path met it (tests/hf_models.py, Forwards: the forward passes that
computed the stored prefix, then the restored run's own), in bfloat16 and float32 alike. A second check, float32
only, against one forward pass over the whole prompt (atol 1e-4; measured <= 2e-7): a split is float rounding away
from it, and it would catch passes at wrong positions, which a replay of the same passes repeats.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from tests.hf_models import VOCAB, Forwards, reference_greedy, reference_logits, tiny_model  # noqa: E402
from tiercache.client import Client  # noqa: E402
from tiercache.connector.hf import prefill as hf_prefill  # noqa: E402
from tiercache.connector.hf.prefill import CachedPrefill, continuation_refusal  # noqa: E402
from tiercache.prefix.layout import GroupKind  # noqa: E402
from tiercache.record import encoding  # noqa: E402

TIERS = {
    "host": dict(host_bytes=64 << 20, disk_bytes=0),
    "disk": dict(host_bytes=0, disk_bytes=128 << 20),
    "redis": dict(host_bytes=0, disk_bytes=0),
}


def prompt(length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


def recorded_model(family: str, dtype: torch.dtype = torch.float32, **options):
    """A tiny model whose forward passes are recorded from the start (what `restored` replays)."""
    model = tiny_model(family, dtype, **options)
    Forwards.of(model)
    return model


def restored(cached: CachedPrefill, ids: torch.Tensor):
    """Prefill `ids` and check its logits against the recompute in the same shape (exact) and, in float32, against
    one forward pass (to rounding)."""
    forwards = Forwards.of(cached.model)
    mark = forwards.mark()
    result = cached.prefill(ids)
    expected = forwards.reference_logits(ids, mark)
    assert torch.equal(result.logits, expected), \
        f"logits differ by up to {(result.logits.float() - expected.float()).abs().max().item():.3g}"
    if expected.dtype == torch.float32:
        torch.testing.assert_close(result.logits, reference_logits(cached.model, ids), atol=1e-4, rtol=0)
    return result


@pytest.fixture
def connect(start_server, request):
    clients = []

    def connect(tier: str = "host") -> Client:
        options = dict(TIERS[tier])
        if tier == "redis":
            options["redis_url"] = request.getfixturevalue("redis_url")
        client = Client.from_url(start_server(**options).url)
        clients.append(client)
        return client

    yield connect
    for client in clients:
        client.close()


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", ["qwen3_5", "falcon_h1"])
def test_restored_cache_matches_full_recompute(connect, family, dtype, tier):
    model = recorded_model(family, dtype)
    cached = CachedPrefill(model, connect(tier))
    ids = prompt(70)
    cold = cached.prefill(ids)
    warm = restored(cached, ids)
    assert (cold.hit_tokens, warm.hit_tokens) == (0, 69)
    generation = cached.generate(ids, 8)
    assert generation.hit_tokens == 69
    assert generation.tokens == reference_greedy(model, ids, 8)


@pytest.mark.parametrize("family", ["qwen3_next", "bamba", "lfm2", "gemma3", "llama"])
def test_other_families(connect, family):
    model = recorded_model(family)
    cached = CachedPrefill(model, connect())
    ids = prompt(50)
    cached.prefill(ids)
    assert restored(cached, ids).hit_tokens == 49


def test_exact_repeat_below_n_hits_all_but_the_last_token(connect):
    model = recorded_model("qwen3_5")
    cached = CachedPrefill(model, connect(), chunk_tokens=64)
    ids = prompt(37)
    cached.prefill(ids)
    assert restored(cached, ids).hit_tokens == 36


def test_partial_prefix_hits_the_deepest_stored_state(connect):
    model = recorded_model("qwen3_5")
    cached = CachedPrefill(model, connect())  # N = 16: a state at every boundary of the 100-token prompt
    first = prompt(100)
    cached.prefill(first)
    second = first.clone()
    second[0, 85:] = prompt(15, seed=7)
    assert restored(cached, second).hit_tokens == 80


def test_multi_turn_chat_reuses_everything_up_to_the_previous_turn(connect):
    model = tiny_model("qwen3_5")
    cached = CachedPrefill(model, connect())
    conversation = prompt(40)
    for turn in range(3):
        user = prompt(9, seed=10 + turn)
        turn_prompt = torch.cat([conversation, user], dim=1) if turn else conversation
        generation = cached.generate(turn_prompt, 6)
        if turn:
            assert generation.hit_tokens == conversation.shape[1]
        assert generation.tokens == reference_greedy(model, turn_prompt, 6)
        conversation = torch.cat([turn_prompt, torch.tensor([generation.tokens])], dim=1)


def test_chat_turns_adding_more_than_n_tokens_resume_at_the_previous_end(connect):
    model = tiny_model("qwen3_5")
    cached = CachedPrefill(model, connect())  # N = 16
    conversation = prompt(30)
    for turn, added in enumerate([20, 33, 48]):  # 1.25 N, 2 N + 1, 3 N: the previous end lies more than N back
        turn_prompt = torch.cat([conversation, prompt(added, seed=20 + turn)], dim=1)
        generation = cached.generate(turn_prompt, 5)
        if turn:
            assert generation.hit_tokens == conversation.shape[1]
        assert generation.tokens == reference_greedy(model, turn_prompt, 5)
        conversation = torch.cat([turn_prompt, torch.tensor([generation.tokens])], dim=1)


@pytest.mark.parametrize("share", [0.1, 0.5, 0.9])
def test_questions_branching_inside_a_document_resume_within_n_of_the_branch(connect, share):
    model = recorded_model("qwen3_5")
    cached = CachedPrefill(model, connect())  # N = 16: a state at every boundary of the document
    document = prompt(200)
    cached.prefill(torch.cat([document, prompt(12, seed=3)], dim=1))
    shared = int(share * document.shape[1])
    branch = torch.cat([document[:, :shared], prompt(10, seed=4)], dim=1)
    assert restored(cached, branch).hit_tokens == shared // 16 * 16 > shared - 16


def test_sliding_window_model_reuses_a_prefix_longer_than_its_window(connect):
    model = recorded_model("gemma3")  # sliding_window 8, every other layer full attention
    cached = CachedPrefill(model, connect())
    assert any(g.kind is GroupKind.SLIDING_WINDOW and g.window == 8 for g in cached.layout.groups)
    ids = prompt(90)
    cached.prefill(ids)
    other = ids.clone()
    other[0, 75:] = prompt(15, seed=3)
    assert restored(cached, other).hit_tokens >= 64


@pytest.mark.parametrize("window", [8, 40], ids=["window<N", "window>N"])
def test_a_sliding_window_partial_hit_never_fails_the_request(connect, window):
    """A restored sliding layer holds only its window, and the save plan after a partial hit used to ask for a
    chunk spanning the hit (W-1 < p mod N): the prefill raised. A cache may skip a save; it must
    never fail the request."""
    model = recorded_model("gemma3", sliding_window=window)
    cached = CachedPrefill(model, connect(), chunk_tokens=16)
    ids = prompt(29)
    cached.prefill(ids)
    longer = torch.cat([ids[:, :28], prompt(12, seed=11)], dim=1)
    assert restored(cached, longer).hit_tokens == 28
    restored(cached, torch.cat([longer, prompt(5, seed=12)], dim=1))


def test_corrupt_state_leads_to_recompute_never_wrong_logits(connect, tmp_path):
    model = recorded_model("qwen3_5")
    cached = CachedPrefill(model, connect("disk"))
    ids = prompt(70)
    cached.prefill(ids)
    corrupted = 0
    for path in (tmp_path / "disk").glob("*/*.chunk"):
        data = bytearray(path.read_bytes())
        if encoding.read_header(data).meta.object_class == encoding.CLASS_STATE:
            data[-5] ^= 0x40
            path.write_bytes(data)
            corrupted += 1
    assert corrupted
    result = restored(cached, ids)
    assert result.hit_tokens == 0  # the hit was found, its state failed the checksum, the prompt was recomputed
    assert cached.prefill(ids).hit_tokens == 69  # and the recompute stored good copies again


def test_models_with_different_weights_never_share(connect):
    client = connect()
    ids = prompt(40)
    CachedPrefill(tiny_model("qwen3_5", seed=0), client).prefill(ids)
    other = CachedPrefill(tiny_model("qwen3_5", seed=1), client)
    assert other.prefill(ids).hit_tokens == 0


def test_jamba_is_refused_hits_with_a_reason(connect):
    model = recorded_model("jamba")
    cached = CachedPrefill(model, connect())
    assert "zero state" in cached.refusal
    ids = prompt(40)
    cached.prefill(ids)
    assert restored(cached, ids).hit_tokens == 0


def test_self_test_catches_a_broken_continuation_without_the_known_list(monkeypatch):
    monkeypatch.setattr(hf_prefill, "KNOWN_BROKEN_CONTINUATION", {})
    assert "changes the logits" in continuation_refusal(tiny_model("jamba"))
    assert continuation_refusal(tiny_model("qwen3_5")) is None


def test_layout_is_derived_from_the_model(connect):
    cached = CachedPrefill(tiny_model("qwen3_5", torch.bfloat16), connect())
    attention, recurrent = cached.layout.groups
    assert attention.kind is GroupKind.FULL_ATTENTION and attention.layers == (1, 3)
    assert (attention.kv_heads, attention.head_dim, attention.kv_dtype) == (2, 16, "bfloat16")
    assert recurrent.layers == (0, 2)
    assert [(t.name, t.shape, t.dtype) for t in recurrent.state] == [
        ("conv0", (64, 4), "bfloat16"), ("recurrent0", (4, 8, 8), "float32")]  # SSM state stays fp32
    assert cached.spec.namespace.startswith("qwen3_5_text@")


def test_token_ids_may_be_lists_or_arrays(connect):
    model = tiny_model("llama")
    cached = CachedPrefill(model, connect())
    ids = prompt(20)
    cached.prefill(ids[0].tolist())
    assert cached.prefill(np.asarray(ids[0])).hit_tokens == 19
    with pytest.raises(ValueError):
        cached.prefill(torch.zeros((2, 5), dtype=torch.long))


def test_prefix_computed_through_node_a_is_a_hit_through_node_b(start_server, redis_url):
    """Cross-node sharing: node A writes through to the shared Redis; node B, with empty local tiers, hits it."""
    model = recorded_model("qwen3_5")
    node_a = start_server(redis_url=redis_url, write_through=True)
    node_b = start_server(redis_url=redis_url)
    ids = prompt(70)
    with Client.from_url(node_a.url) as a, Client.from_url(node_b.url) as b:
        assert CachedPrefill(model, a).prefill(ids).hit_tokens == 0
        assert restored(CachedPrefill(model, b), ids).hit_tokens == 69


@pytest.mark.parametrize("part", ["recurrent state", "attention key"])
def test_the_gate_fails_on_one_bit_flipped_in_the_restored_cache(connect, monkeypatch, part):
    """A gate counts once it has failed on a planted fault: one bit of the restored cache (the sign of one value, in
    a recurrent layer's state or an attention layer's keys) flipped after the objects passed their checksums, and
    restored()'s exact comparison must fail."""
    from tiercache.connector.hf import cache as hf_cache

    model = recorded_model("qwen3_5")
    cached = CachedPrefill(model, connect())
    ids = prompt(70)
    cached.prefill(ids)
    build = hf_prefill.build_cache

    def with_a_bit_flipped(*args):
        past = build(*args)
        if part == "recurrent state":
            layer = next(layer for layer in past.layers if hf_cache._is_recurrent(layer))
            tensor = hf_cache._state_tensors(layer)[-1][2]
        else:
            tensor = next(layer for layer in past.layers if hf_cache._is_attention(layer)).keys
        where = tuple(tensor.nonzero()[0].tolist())
        tensor[where] = -tensor[where]
        return past
    monkeypatch.setattr(hf_prefill, "build_cache", with_a_bit_flipped)
    with pytest.raises(AssertionError, match="logits differ"):
        restored(cached, ids)
