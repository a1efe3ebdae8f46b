"""The small hybrid shape the lab's simulated engines run by default (benchmarks/hybrid_soak.py's and
lab/fleet_trace.py's `--preset small`): Qwen3.5-0.8B's layer pattern with small heads, so a run's tiers hold and
evict many chains in a few hundred MiB; `--preset` names one of tiercache.prefix.presets for real byte sizes."""

from __future__ import annotations

from tiercache.prefix.layout import ModelLayout
from tiercache.prefix.presets import gated_deltanet_layout


def small_layout() -> ModelLayout:
    """Qwen3.5-0.8B's pattern (24 layers, every 4th full attention) with small heads: state 617 KiB, kv chunk 210 KiB
    at N = 560 (Qwen3.5-0.8B: 18.6 MiB and 6.4 MiB at N = 544; the same ratio)."""
    return gated_deltanet_layout("soak/qwen3.5-shape-small", layers=24, full_attention_interval=4, kv_heads=1,
                                 head_dim=16, key_heads=2, value_heads=2, key_dim=64, value_dim=64, conv_kernel=4)
