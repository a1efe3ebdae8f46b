"""The benchmark scripts still run (CI smoke; slow suite). Their figures go to the notes, not into assertions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import python_env

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent


def test_throughput_quick(tmp_path):
    out, png = tmp_path / "t.json", tmp_path / "t.png"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "throughput.py"), "--quick", "--sizes", "1,4",
                             "--json-out", str(out), "--plot", str(png)], capture_output=True, text=True,
                            env=python_env(), timeout=300)
    assert result.returncode == 0, result.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["chunk_bytes"] for r in rows] == [1 << 20, 4 << 20]
    assert all(r["same_host_put"] > 0 and r["remote_get"] > 0 and "same_host_vs_memcpy" in r["ratios"] for r in rows)
    assert png.stat().st_size > 10_000


def test_grpc_modes_and_kernels_scripts_run():
    for script, args in (("grpc_modes.py", ["--rounds", "1"]), ("kernels.py", [])):
        result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], capture_output=True,
                                text=True, env=python_env(), timeout=300)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip()
