"""The sizes of the models the docs name: the presets give vLLM's own block sizes, docs/deploy.md's sizing
table is what they compute, and the default chunk limit takes every one of their objects — in a real server on its
defaults, and in `tiercache bench cliff`, which refuses a server whose limit is too small at once, in one line."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest
import yaml

from tests.helpers import ROOT, ServerProcess, python_env
from tiercache.client import Client
from tiercache.config import DEFAULT_MAX_CHUNK_BYTES, GiB, KiB, MiB, parse_size
from tiercache.connector.limits import largest_object
from tiercache.prefix.layout import unified_block_size
from tiercache.prefix.objects import CacheSpec
from tiercache.prefix.presets import DOCUMENTED_TP, PRESETS, preset



@pytest.mark.parametrize("name,options,n", [
    # N as vLLM logged it ("Setting attention block size to N tokens"), and the padding it logged with it.
    ("qwen3.5-0.8b", {}, 544),                               # padding 2.64%
    ("qwen3.5-27b", {}, 784),
    ("qwen3.6-27b", {}, 784),
    ("qwen3.5-35b-a3b", {}, 1056),                           # padding 0.76%
    ("qwen3.5-4b", {"kv_dtype": "float8_e4m3fn"}, 1056),      # --kv-cache-dtype fp8, padding 0.76%
    ("qwen3.5-9b", {"kv_dtype": "float8_e4m3fn"}, 1056),
    ("qwen3-next-80b-a3b", {}, 544),                         # padding 1.49%: its state is bf16
])
def test_presets_give_the_block_sizes_vllm_logs(name, options, n):
    assert unified_block_size(preset(name, **options)) == n


@pytest.mark.parametrize("name,n,padding", [("qwen3.5-0.8b", 544, 2.64), ("qwen3.5-35b-a3b", 1056, 0.76),
                                            ("qwen3-next-80b-a3b", 544, 1.49)])
def test_the_state_sizes_give_the_padding_vllm_logs(name, n, padding):
    layout = preset(name)
    page = n * layout.attention_groups[0].kv_bytes_per_token_per_layer
    assert round(100 * (page / layout.recurrent_group.state_bytes_per_layer - 1), 2) == padding


def test_tensor_parallel_ranks_replicate_kv_heads_beyond_their_count():
    full, rank = preset("qwen3.5-397b-a17b"), preset("qwen3.5-397b-a17b", tp_size=8)
    assert rank.attention_groups[0].kv_heads == 1  # 2 KV heads over 8 ranks: one each, as vLLM replicates them
    assert rank.state_bytes * 8 == full.state_bytes
    assert unified_block_size(rank) == 528 and unified_block_size(full) == 2096


def test_nemotron_h_layers_follow_the_hybrid_pattern():
    layout = preset("nemotron-h-8b")
    attention, recurrent = layout.attention_groups[0], layout.recurrent_group
    assert (len(attention.layers), len(recurrent.layers), layout.num_layers) == (4, 24, 52)
    conv, ssm = recurrent.state
    assert conv.shape == (128 * 64 + 2 * 8 * 128, 3) and ssm.shape == (128, 64, 128) and ssm.dtype == "float32"


def _size(n: int) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", MiB)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n / KiB:.1f} KiB".replace(".0 KiB", " KiB")


def _row(name: str) -> list[str]:
    tp = DOCUMENTED_TP.get(name, 1)
    layout = preset(name, tp_size=tp)
    n = unified_block_size(layout)
    chunk = layout.kv_bytes_per_token * n
    return [layout.model.split("/")[1], f"`{name}`", str(tp),
            f"{len(layout.attention_groups[0].layers)} + {len(layout.recurrent_group.layers)}", f"{n:,}",
            _size(layout.kv_bytes_per_token), _size(chunk), _size(layout.state_bytes),
            _size((chunk + layout.state_bytes) // n)]


def test_the_sizing_table_in_the_docs_is_what_the_presets_compute():
    text = (ROOT / "docs" / "deploy.md").read_text()
    table = text[text.index("<!-- sizing:begin -->"):text.index("<!-- sizing:end -->")]
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in table.splitlines()
            if line.startswith("| ") and not line.startswith("| model")]
    assert rows == [_row(name) for name in PRESETS]


def test_the_default_chunk_limit_holds_every_documented_object():
    """At each preset's documented TP and at TP 1 (the largest any rank of them writes)."""
    deploy = yaml.safe_load((ROOT / "deploy" / "base" / "tiercache.yaml").read_text())
    limits = [DEFAULT_MAX_CHUNK_BYTES, parse_size(deploy["server"]["max_chunk_bytes"])]
    for name in PRESETS:
        for tp in {1, DOCUMENTED_TP.get(name, 1)}:
            size = largest_object(CacheSpec.for_layout(preset(name, tp_size=tp))).size_bytes
            assert all(size <= limit for limit in limits), (name, tp, size)


def test_a_server_on_its_default_limit_takes_the_largest_documented_object():
    """Qwen3.5-397B-A17B's state on one rank (183.2 MiB) through the data channel, both ways. With the old 64 MiB
    default the put was refused ("chunk of 153944064 bytes exceeds the maximum of 67108864" for Qwen3.6-27B)."""
    size = max(largest_object(CacheSpec.for_layout(preset(name))).size_bytes for name in PRESETS)
    assert size == 192_061_440
    payload = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    with ServerProcess("--host-mem", "512MiB", "--disk-size", "0") as server, \
            Client.from_url(server.url, same_host=False) as client:
        assert client.server_max_chunk_bytes() == DEFAULT_MAX_CHUNK_BYTES
        assert client.put("sizing", b"state", payload) == "host"
        assert np.array_equal(np.frombuffer(client.get("sizing", b"state"), dtype=np.uint8), payload)


def test_bench_cliff_refuses_a_server_whose_limit_is_below_the_presets_state_in_one_line():
    with ServerProcess("--host-mem", "64MiB", "--disk-size", "0", "--max-chunk-size", "64MiB") as server:
        result = subprocess.run([sys.executable, "-m", "tiercache", "bench", "cliff", "--preset", "qwen3.6-27b",
                                 "--server", server.url, "--quick", "--no-progress"], capture_output=True, text=True,
                                timeout=120, env=python_env())
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert re.search(r"a state of Qwen/Qwen3\.6-27B \(N=784\) is 146\.8 MiB \(153944064 bytes\), above the 64\.0 MiB "
                     r"chunk limit .*`tiercache serve --max-chunk-size 256MiB` \(server\.max_chunk_bytes\)", lines[0])
