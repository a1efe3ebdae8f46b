"""tiercache as a secondary tier of vLLM's offloading for a dense model (attention only: chunks of one group, no
states), and the identity the tier keys by: the same checkpoint served with a RoPE scaling override shares nothing
with it (tests/vllm_engine/test_offload_tier.py has the hybrid's cases and says how the engines are set up)."""

from __future__ import annotations

import json

import pytest

from testkit.prompts import prompt
from testkit.vllm_models import DENSE
from tests.vllm_engine.conftest import Engines, start_cache_server
from tests.vllm_engine.offload_runs import EXTERNAL, OffloadEngines, assert_restored, counted
from tiercache.cli.vllm_tier import tier_entry

ROPE = {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}


@pytest.fixture(scope="module")
def run(models_dir, tmp_path_factory):
    server = start_cache_server(tmp_path_factory, "offload-tier-dense")
    engines = Engines(DENSE, models_dir, tmp_path_factory.mktemp("engine-logs"))
    made = OffloadEngines(engines, tier_entry(engines.path, [], server.url), tmp_path_factory.mktemp("fs-tier"))
    yield made, server
    made.close()
    server.kill()


def test_a_restarted_engine_restores_what_the_first_offloaded_exactly(run):
    """The yardstick is vLLM's own offloading: the first engine, its prefix cache reset, resumes from its CPU pool
    at the same position (no engine without offloading is needed: the hybrid's tests hold the offloading engine to
    one)."""
    made, _ = run
    n = made.n
    tokens = prompt(800, 4 * n - 24)
    made.first.one(tokens)
    made.first.reset_prefix_cache()
    own, hits = counted(made.first, tokens)
    assert own.cached == 3 * n and hits == {"host": 3 * n}, f"vLLM's own hit {own.cached}, counted {hits}"
    made.first.close()
    assert not made.first.pool_file_left
    made.restored = assert_restored(made.restarted, tokens, own, EXTERNAL, "restarted engine")


def test_the_same_checkpoint_with_a_rope_scaling_override_shares_nothing(run):
    made, server = run
    n = made.n
    tokens = prompt(800, 4 * n - 24)  # in the server, from the engine without the override
    entry = tier_entry(made.engines.path, ["--hf-overrides", json.dumps(ROPE)], server.url)
    assert entry["model_identity"] != made.tier["model_identity"]
    scaled = made.offloading("rope", entry, hf_overrides=ROPE)
    got, hits = counted(scaled, tokens)
    assert got.cached == 0 and hits == {}, f"the scaled engine hit {got.cached} tokens of another RoPE: {hits}"
    # The override does change what the model computes: bytes of the other would have been wrong here.
    assert got.logprobs != made.restored.logprobs
