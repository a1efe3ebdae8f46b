"""The lab's other commands on vLLM's CPU build, each at a smoke size, as docs/benchmarks.md gives them: the fleet on
real engines (`python -m lab.fleet_trace --engine vllm`), the bandwidth of vLLM's offloading tiers
(`python -m lab.tier_bandwidth`) and the engine micro-benchmark (`python -m benchmarks.vllm_engine --quick`). Their
figures go to the notes, not into assertions."""

from __future__ import annotations

import json

import pytest

from lab.tests.commands import run_module
from testkit import mooncake_trace

pytestmark = pytest.mark.slow


@pytest.mark.timeout(1200)  # two engines started in a subprocess: the command's own limit decides
def test_the_fleet_routes_a_few_requests_over_real_engines(tmp_path):
    out = tmp_path / "fleet.json"
    result = run_module("lab.fleet_trace", "--engine", "vllm", "--policies", "restorable", "--pods", "2",
                        "--trace", str(mooncake_trace.CONVERSATION_SLICE), "--max-requests", "6",
                        "--conversations", "1", "--time-scale", "0.02", "--max-input-tokens", "1024",
                        "--max-output-tokens", "4", "--host-mem", "128MiB", "--json", str(out), "--no-progress",
                        timeout_s=1100)
    assert result.returncode == 0, result.stderr[-3000:]
    policy = json.loads(out.read_text())["policies"]["restorable"]
    assert policy["requests"] == 6 and policy["errors"] == 0, policy
    assert sum(policy["requests_per_pod"].values()) == 6


@pytest.mark.timeout(900)
def test_tier_bandwidth_moves_the_same_bytes_through_both_tiers(tmp_path):
    out = tmp_path / "tiers.json"
    result = run_module("lab.tier_bandwidth", "--repeats", "1", "--total-mib", "4", "--chunk-sizes", "1MiB",
                        "--work-dir", str(tmp_path / "fs"), "--seed", "1", "--json", str(out), timeout_s=800)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert sorted(run["arm"] for run in report["runs"]) == ["fs", "fs-again", "tiercache"]
    assert all(run["store_gbps"] > 0 and run["load_gbps"] > 0 for run in report["runs"])
    assert len(report["meta"]["commit"]) == 12  # the code it ran (lab.common.meta)


@pytest.mark.timeout(1500)  # three engines started in a subprocess: the command's own limit decides
def test_the_engine_micro_benchmark_runs_quick(tmp_path):
    out = tmp_path / "engine.json"
    result = run_module("benchmarks.vllm_engine", "--quick", "--json", str(out), timeout_s=1400)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert len(report["by_length"]) == 4 and report["chat"] and report["document"]
