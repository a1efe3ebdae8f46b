"""benchmarks/hf_gpu.py off the GPU: its models have the presets' cache shapes, and a smoke run on the CPU (a tiny
shape, real tiercache servers with a host and a disk tier) writes every case: cold, a hit, the load's bytes, the next
token against the model alone."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from benchmarks import hf_gpu
from tiercache.connector.hf.cache import derive_layout
from tiercache.prefix.presets import preset


@pytest.mark.parametrize("name", ["qwen3.5-0.8b", "qwen3.5-4b"])
def test_the_models_hold_the_presets_cache_shapes(name):
    """The hidden and MLP sizes do not change the cache: shrunk here so the model builds in a moment."""
    shape = dataclasses.replace(hf_gpu.SHAPES[name], hidden=64, intermediate=64, vocab=512)
    built = derive_layout(hf_gpu.build_model(shape, "cpu", torch.float32, 4096), "bench", "r")
    expected = preset(shape.preset)
    attention, recurrent = (next(g for g in built.groups if g.kind is kind) for kind in
                            (expected.groups[0].kind, expected.groups[1].kind))
    assert (attention.layers, attention.kv_heads, attention.head_dim) == \
        (expected.groups[0].layers, expected.groups[0].kv_heads, expected.groups[0].head_dim)
    assert recurrent.layers == expected.groups[1].layers
    conv, state = recurrent.state
    assert conv.shape[0] == expected.groups[1].state[0].shape[0]  # channels (HF keeps the whole kernel, vLLM k-1)
    assert state.shape == expected.groups[1].state[1].shape


def test_a_smoke_run_on_the_cpu_writes_every_case(tmp_path):
    out = tmp_path / "hf_gpu.json"
    hf_gpu.main(["--device", "cpu", "--dtype", "float32", "--shapes", "tiny", "--lengths", "2048,1024",
                 "--suffix", "64", "--tier-mem", "256MiB", "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["environment"]["torch"] == torch.__version__
    assert [c["prompt_tokens"] for c in report["cases"]] == [1024, 2048]  # the largest last
    for case in report["cases"]:
        assert case["model_alone_ttft_s"] > 0
        for tier in ("host", "disk"):
            runs = case["tiers"][tier]
            cold, hit = runs["cold"], runs["hit"]
            assert cold["hit_tokens"] == 0 and cold["loaded_bytes"] == 0
            shared = case["prompt_tokens"] - case["suffix_tokens"]
            assert shared - runs["chunk_tokens"] < hit["hit_tokens"] <= shared
            assert hit["hit_tokens"] % runs["chunk_tokens"] == 0 and hit["loaded_bytes"] > 0
            assert hit["next_token_equal"] and hit["max_logit_difference"] < 1e-3  # float32: rounding only
            assert hit["pinned_h2d_gb_s"] is None  # no GPU: no pinned copy to compare with


def test_make_bench_gpu_says_in_one_line_that_it_needs_a_gpu(tmp_path):
    """scripts/bench_gpu.sh runs on a GPU machine with its own CUDA torch; anywhere else it stops at once, saying why
    (this machine's torch is a CPU build)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "out")}
    done = subprocess.run([str(root / "scripts" / "bench_gpu.sh")], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1].startswith("bench-gpu:") and "no CUDA device" in done.stderr
