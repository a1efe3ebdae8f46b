"""The micro-benchmarks still run (benchmarks/, as `python -m benchmarks.<name>`: `make lab-smoke`). Their figures go
to the notes, not into assertions."""

from __future__ import annotations

import json

import pytest

from lab.tests.commands import run_module

pytestmark = pytest.mark.slow


def _run(name: str, *args: str, timeout_s: float = 300) -> str:
    result = run_module(f"benchmarks.{name}", *args, timeout_s=timeout_s)
    assert result.returncode == 0, result.stderr
    return result.stdout


def _run_json(name: str, *args: str) -> dict:
    return json.loads(_run(name, *args, "--json", timeout_s=600))


def test_throughput_quick(tmp_path):
    out, png = tmp_path / "t.json", tmp_path / "t.png"
    _run("throughput", "--quick", "--sizes", "1,4", "--json-out", str(out), "--plot", str(png))
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert [r["chunk_bytes"] for r in rows] == [1 << 20, 4 << 20]
    assert all(r["same_host_put"] > 0 and r["remote_get"] > 0 and "same_host_vs_memcpy" in r["ratios"] for r in rows)
    assert len(report["meta"]["commit"]) == 12  # the code it ran (lab.common.write_report)
    assert png.stat().st_size > 10_000


def test_grpc_modes_and_kernels_scripts_run():
    for name, args in (("grpc_modes", ["--rounds", "1"]), ("kernels", [])):
        assert _run(name, *args).strip()


def test_soak_short_run(tmp_path):
    config = tmp_path / "server.yaml"
    config.write_text("server:\n  stream_idle_timeout_s: 1\n")
    report = _run_json("soak", "--seconds", "8", "--baseline-seconds", "3", "--sample-s", "1", "--keys", "400",
                       "--host-mem", "32MiB", "--disk-size", "64MiB", "--plot", str(tmp_path / "rss.png"),
                       "--stalled", "2", "--disconnecting", "1", "--server-config", str(config), "--remote", "2",
                       "--stalled-data", "2", "--unread-data", "1", "--unread-hold-s", "2.5")
    assert report["ops"] > 0 and report["errors"] == 0 and report["wrong_bytes"] == 0
    assert (tmp_path / "rss.png").stat().st_size > 5_000
    outcomes = report["misbehaving"]["outcomes"]
    assert outcomes["stalled"].get("UNAVAILABLE", 0) > 0  # the idle timeout ended the stalled Puts
    assert outcomes["disconnecting"].get("cancelled by the client", 0) > 0
    for kind in ("stalled-data", "unread-data"):  # the idle timeout closed their data connections
        assert outcomes[kind].get("closed by the server", 0) > 0, outcomes


def test_restart_small():
    report = _run_json("restart", "--chunks", "2000", "--chunk-bytes", "1024")
    assert report["indexed"] == 2000 and report["server_start_to_serving_s"] > 0


def test_cross_node_tiny():
    report = _run_json("cross_node", "--hidden", "64", "--layers", "4", "--prefix", "300", "--suffix", "8",
                       "--prefixes", "1")
    for result in report["results"]:
        b_first = result["steps"]["B first (from Redis)"]
        assert b_first["hit_tokens"] > 0 and result["node_b_hit_tokens_from_redis"] >= b_first["hit_tokens"]


def test_eviction_and_hybrid_soak_scripts_run(tmp_path):
    evicted = tmp_path / "e.json"
    _run("eviction", "--disk", "2000", "--host-gib", "0.0625", "--server-gib", "0.0625", "--window", "500",
         "--json-out", str(evicted))
    assert [row["tier"] for row in json.loads(evicted.read_text())] == ["disk", "host", "server"]
    soak, png = tmp_path / "s.json", tmp_path / "s.png"
    _run("hybrid_soak", "--requests", "300", "--host-mem", "32MiB", "--disk-size", "64MiB", "--json-out", str(soak),
         "--plot", str(png))
    assert png.stat().st_size > 10_000 and soak.stat().st_size > 1000


def test_sick_server_script_runs(tmp_path):
    out = tmp_path / "sick.json"
    _run("sick_server", "--lookups", "5", "--tokens", "2048", "--deadline", "0.2", "--json-out", str(out))
    reached = {name: r["reached"] for name, r in json.loads(out.read_text())["results"].items()}
    assert reached == {"healthy/breaker": 6, "healthy/none": 6, "hung/breaker": 0, "hung/none": 0,
                       "dead/breaker": 0, "dead/none": 0}


def test_simple_api_script_runs():
    stdout = _run("simple_api", "--chunks", "2", "--chunk-size", "1MiB", "--rounds", "1", "--tune-allocator")
    assert stdout.count("x memcpy") == 3  # put, get, get into a reused buffer


def test_put_get_and_path_cost_run():
    put_get = _run_json("put_get", "--chunks", "4", "--chunk-size", "1MiB", "--repeat", "1")
    assert put_get["chunks"] == 4 and put_get["gbps"]["put"] > 0 and put_get["gbps"]["get"] > 0
    path_cost = _run_json("path_cost", "--sizes", "64KiB", "--calls", "5", "--megabytes", "1")
    assert [row["chunk_bytes"] for row in path_cost["rows"]] == [64 << 10]


def test_hf_ttft_and_codec_run():
    report = _run_json("hf_ttft", "--hidden", "64", "--layers", "4", "--prefix", "300", "--suffix", "8", "--warm", "1",
                       "--tiers", "host")
    assert [tier["tier"] for tier in report["tiers"]] == ["host"] and report["tiers"][0]["warm_ttft_ms"] > 0
    assert "lz4" in _run("codec", "--tokens", "256")


def test_events_shared_prefix_runs():
    assert "requests, flush 0.01s" in _run("events_shared_prefix", "8", "0.01")
