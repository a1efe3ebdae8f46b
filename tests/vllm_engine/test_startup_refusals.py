"""What the connector refuses at an engine's start, on vLLM's real engine: a cache server whose chunk limit
is below the model's largest object, and an engine whose Mamba groups are not in align mode (prefix caching turned
off) — each in one line naming the flag that fixes it. (Every other engine of these tests passes no
mamba_cache_mode: prefix caching alone gives the connector align mode on vLLM 0.32.)"""

from __future__ import annotations

import re

import pytest

from tests.helpers import ServerProcess


def _refused(four_layer, name: str, url: str, **options) -> str:
    with pytest.raises(RuntimeError):
        four_layer.start(name, url, **options)
    return (four_layer.logs / f"{four_layer.model.name}-{name}.log").read_text(errors="replace")


def test_a_server_whose_chunk_limit_is_below_the_largest_object_is_refused_at_start(four_layer):
    with ServerProcess("--host-mem", "16MiB", "--disk-size", "0", "--max-chunk-size", "64KiB") as server:
        log = _refused(four_layer, "small-chunk-limit", server.url)
    # The 4-layer model's largest object is a kv chunk (2 attention layers x N tokens of 512 bytes each: 256 KiB
    # where N is 256, 128 KiB where N is 128, the CPU's choice; its state is 70 KiB or less).
    sizing = four_layer.model.sizing()
    n, chunk = sizing.block_tokens, sizing.kv_chunk_bytes
    assert chunk > sizing.layout.state_bytes
    assert re.search(rf"TierCacheConnector: a kv chunk of vllm:\S+ \(N={n}\) is {chunk / 1024:.1f} KiB \({chunk} "
                     r"bytes\), above the 64\.0 KiB chunk limit of the tiercache server at \S+: start it with "
                     r"`tiercache serve --max-chunk-size 1MiB` \(server\.max_chunk_bytes\)", log), log[-3000:]


def test_an_engine_without_prefix_caching_is_refused_naming_the_flag_for_its_version(four_layer, cache_server):
    import vllm

    log = _refused(four_layer, "no-prefix-caching", cache_server.url, enable_prefix_caching=False,
                   prefix_cache_retention_interval=0)
    assert (f"TierCacheConnector needs vLLM's Mamba cache mode 'align', got 'none' (no state kept per block): "
            f"start vLLM with --enable-prefix-caching (vLLM {vllm.__version__} derives the mode from it") in log
