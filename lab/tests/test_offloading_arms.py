"""The serving lab's arms with vLLM's own offloading (lab/serving/offloading.py): what each name runs, the
engine flags they give vLLM, and vLLM's offloading figures read from its /metrics text. (On real engines:
lab/tests/vllm_engine/test_lab_smokes.py.)"""

from __future__ import annotations

import json

import pytest

from lab.serving.engines import EngineSettings
from lab.serving.offloading import (OFFLOAD_ARMS, OffloadArm, figures_change, offload_figures, offloading,
                                           summed)
from testkit.offload_worker import STOOD_IN_LINE

METRICS = """\
# HELP vllm:prompt_tokens_cached_by_source_total Prompt tokens served from cache, by source.
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="device"} 512.0
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="host"} 256.0
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="external_unspecified"} 768.0
vllm:kv_offload_tiering_chunk_hits_total{engine="0",model_name="m",tier="1:TierCacheTier"} 3.0
vllm:kv_offload_lookup_sync_delay_seconds_sum{engine="0",model_name="m"} 0.25
vllm:kv_offload_lookup_sync_delay_seconds_count{engine="0",model_name="m"} 100.0
vllm:kv_offload_lookup_sync_delay_seconds_bucket{engine="0",model_name="m",le="0.001"} 99.0
"""


@pytest.mark.parametrize("name, replicas, tier, restart", [
    ("offload", 1, None, False), ("offload-again", 1, None, False), ("offload-fs-restart", 1, "fs", True),
    ("offload-tiercache-restart-again", 1, "tiercache", True), ("two-offload-fs-shared", 2, "fs-shared", False),
    ("two-offload-tiercache-again", 2, "tiercache", False)])
def test_an_arms_name_says_what_it_runs(name, replicas, tier, restart):
    assert OffloadArm.parse(name) == OffloadArm(replicas, tier, restart)


@pytest.mark.parametrize("name", ["offload-fs-shared", "two-offload-restart", "offload-nvme", "tiercache"])
def test_names_that_run_nothing_sensible_are_not_arms(name):
    assert name not in OFFLOAD_ARMS
    with pytest.raises(ValueError, match="not an offloading arm"):
        OffloadArm.parse(name)


def test_an_offloading_engine_gets_vllms_offloading_connector_and_the_stood_in_worker():
    base = EngineSettings(model_dir="/m", block_size=256, kv_cache_bytes=64 << 20, max_model_len=4096)
    tier = {"type": "fs", "root_dir": "/tmp/x"}
    settings = offloading(base, 2 << 30, [tier])
    flags = settings.arguments()
    config = json.loads(flags[flags.index("--kv-transfer-config") + 1])
    assert config["kv_connector"] == "OffloadingConnector" and config["engine_id"] == settings.offload_id
    assert config["kv_connector_extra_config"] == {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 2 << 30,
                                                   "offload_prompt_only": False, "secondary_tiers": [tier]}
    assert settings.testkit == {"TIERCACHE_OFFLOAD_WORKER": "1"} and settings.testkit_lines == (STOOD_IN_LINE,)
    assert offloading(base, 1, []).offload_id != settings.offload_id  # each engine its own pool file
    assert "--kv-transfer-config" not in base.arguments()


def test_figures_are_read_by_label_and_histograms_by_sum_and_count():
    figures = offload_figures(METRICS)
    assert figures["cached_by_source"] == {"device": 512.0, "host": 256.0, "external_unspecified": 768.0}
    assert figures["tier_chunk_hits"] == {"1:TierCacheTier": 3.0}
    assert figures["lookup_sync_delay_s"] == {"sum": 0.25, "count": 100.0}
    assert figures["tier_chunk_queries"] == {}


def test_a_replays_figures_are_what_grew_summed_over_engines_and_phases():
    before = [{"cached_by_source": {"host": 10.0}}, {"cached_by_source": {}}]
    after = [{"cached_by_source": {"host": 30.0, "disk": 5.0}}, {"cached_by_source": {"host": 1.0}}]
    change = figures_change(before, after)
    assert change == {"cached_by_source": {"host": 21.0, "disk": 5.0}}
    assert summed(change, {"cached_by_source": {"host": 1.0}, "x": {"a": 2.0}}) == {
        "cached_by_source": {"host": 22.0, "disk": 5.0}, "x": {"a": 2.0}}


def test_every_engine_start_gets_a_pool_of_its_own():
    from lab.serving.offloading import own_pool

    base = EngineSettings(model_dir="/m", block_size=256, kv_cache_bytes=64 << 20, max_model_len=4096)
    settings = offloading(base, 1 << 30, [])
    assert own_pool(settings).offload_id not in ("", settings.offload_id)  # a restarted engine: another pool file
    assert own_pool(base) is base


def test_an_fs_tiers_run_says_what_it_was_stored_on(tmp_path):
    from lab.serving.offloading import O_DIRECT_REFUSED, FsDirs, filesystem_of

    dirs = FsDirs(tmp_path, "offload-fs")
    dirs(0)
    log = tmp_path / "offload-fs.log"
    log.write_text("INFO started\n")
    assert dirs.facts([log, tmp_path / "absent.log"]) == {"filesystem": filesystem_of(tmp_path), "o_direct": True}
    log.write_text(f"WARNING {O_DIRECT_REFUSED} at '{dirs.root}'; falling back to buffered I/O\n")
    assert dirs.facts([log])["o_direct"] is False
    assert filesystem_of(tmp_path) != "unknown"
    dirs.remove()
    assert not dirs.root.exists()
