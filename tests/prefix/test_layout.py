import pytest

from tiercache.errors import InvalidArgument
from tiercache.prefix.layout import GroupKind, LayerGroup, ModelLayout, StateTensor, unified_block_size
from tiercache.prefix.objects import CacheSpec
from tiercache.prefix.presets import gated_deltanet_layout, preset


@pytest.mark.parametrize("name,n,attention,recurrent", [
    ("qwen3.5-0.8b", 544, 6, 18), ("qwen3.5-4b", 528, 8, 24), ("qwen3.6-27b", 784, 16, 48)])
def test_presets_give_the_published_unified_block_size(name, n, attention, recurrent):
    layout = preset(name)
    assert unified_block_size(layout) == n
    assert len(layout.groups[0].layers) == attention and len(layout.recurrent_group.layers) == recurrent


def test_qwen35_08b_sizes_match_the_design_brief():
    layout = preset("qwen3.5-0.8b")
    assert layout.kv_bytes_per_token == 12 * 1024  # 12 KiB of attention KV per token
    assert round(layout.state_bytes / 2**20, 1) == 18.6  # all 18 GDN layers
    assert round(layout.kv_bytes_per_token * 544 / 2**20, 1) == 6.4  # one kv chunk


def test_pure_attention_model_uses_the_kernel_alignment():
    layout = ModelLayout("llama", (LayerGroup(GroupKind.FULL_ATTENTION, (0, 1), kv_heads=8, head_dim=128),))
    assert unified_block_size(layout) == 16 and not layout.is_hybrid


def test_tensor_parallel_shares_shrink_both_sides_alike():
    full = preset("qwen3.5-4b")
    half = preset("qwen3.5-4b", tp_rank=1, tp_size=2)
    assert half.state_bytes * 2 == full.state_bytes and half.kv_bytes_per_token * 2 == full.kv_bytes_per_token
    assert unified_block_size(half) == unified_block_size(full)
    assert half.fingerprint(528, 16) != full.fingerprint(528, 16)


def test_fingerprint_tracks_everything_that_changes_bytes():
    base = preset("qwen3.5-0.8b")
    prints = {
        base.fingerprint(544, 16),
        base.fingerprint(544, 32),
        base.fingerprint(560, 16),
        preset("qwen3.5-0.8b", kv_dtype="float16").fingerprint(544, 16),
        preset("qwen3.5-0.8b", ssm_dtype="bfloat16").fingerprint(544, 16),
        preset("qwen3.5-0.8b", tp_rank=0, tp_size=2).fingerprint(544, 16),
    }
    assert len(prints) == 6
    assert base.fingerprint(544, 16) == preset("qwen3.5-0.8b").fingerprint(544, 16)  # deterministic


def test_namespace_carries_model_revision_layout_and_salt_digest():
    spec = CacheSpec.for_layout(preset("qwen3.5-0.8b", revision="abc123"), salt="tenant-secret")
    assert spec.namespace.startswith("Qwen/Qwen3.5-0.8B@abc123#") and "tenant-secret" not in spec.namespace
    assert spec.chunk_tokens == 544 and spec.match_unit == 16


@pytest.mark.parametrize("make", [
    lambda: LayerGroup(GroupKind.RECURRENT, (0,)),
    lambda: LayerGroup(GroupKind.FULL_ATTENTION, (0,)),
    lambda: LayerGroup(GroupKind.SLIDING_WINDOW, (0,), kv_heads=1, head_dim=8),
    lambda: LayerGroup(GroupKind.FULL_ATTENTION, (0,), kv_heads=1, head_dim=8, kv_dtype="float99"),
    lambda: ModelLayout("m", (LayerGroup(GroupKind.FULL_ATTENTION, (0,), kv_heads=1, head_dim=8),
                              LayerGroup(GroupKind.SLIDING_WINDOW, (0,), kv_heads=1, head_dim=8, window=4))),
    lambda: gated_deltanet_layout("m", layers=4, full_attention_interval=4, kv_heads=3, head_dim=8, key_heads=2,
                                  value_heads=2, key_dim=4, value_dim=4, conv_kernel=4, tp_size=2),
    lambda: CacheSpec(preset("qwen3.5-0.8b"), 544, match_unit=48),
    lambda: preset("qwen9"),
])
def test_invalid_layouts_are_rejected(make):
    with pytest.raises(InvalidArgument):
        make()


def test_state_tensor_sizes():
    assert StateTensor("ssm", (16, 128, 128), "float32").size_bytes == 1 << 20
