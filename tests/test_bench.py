"""`tiercache bench cliff --quick --json` meets the hybrid-caching acceptance criteria. Slow: it moves ~2 GB."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import leaked_arenas, python_env

pytestmark = pytest.mark.slow


def test_cliff_quick(tmp_path):
    plot = tmp_path / "cliff.png"
    with leaked_arenas() as leaked:
        result = subprocess.run([sys.executable, "-m", "tiercache", "bench", "cliff", "--quick", "--json",
                                 "--no-progress", "--plot", str(plot)], capture_output=True, text=True,
                                env=python_env(), timeout=600)
    assert result.returncode == 0, result.stderr
    assert leaked == [], "bench cliff's server left its host arena in /dev/shm"
    report = json.loads(result.stdout)
    n = report["N"]
    assert report["preset"] == "qwen3.5-0.8b" and n == 544 and report["u"] == 16
    for row in report["repeated"]:
        length = row["length"]
        assert row["tiercache_hit_ratio"] >= (length - 1) / length, row
        if length < n:
            assert row["full_block_hit_ratio"] == 0
    for row in report["multi_turn"][1:]:
        assert row["hit_tokens"] >= row["previous_turn_end"], row
    document = report["long_context"][0]["document_tokens"]
    for row in report["long_context"][1:]:
        assert row["hit_tokens"] >= document - n, row
    for row in report["multi_turn_long"][1:]:  # turns adding 1.2 N to 3 N tokens: the previous end, exactly
        assert row["hit_tokens"] == row["previous_turn_end"], row
    assert [row["share"] for row in report["branches"]] == [k / 10 for k in range(1, 10)]
    for row in report["branches"]:
        assert row["shared_tokens"] - n < row["hit_tokens"] <= row["shared_tokens"], row
    assert report["lookup_ms_262144"] is None and report["lookup_ms_16384"] > 0  # --quick: a 16K document
    assert plot.stat().st_size > 10_000
