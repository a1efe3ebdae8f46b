"""`python -m lab.serving.rederive` re-derives every published set (docs/runs) with this checkout's statistics: each
stored report still reads back and builds, and each set says whether it has its A/A pair."""

from __future__ import annotations

import json

from lab.serving import rederive
from lab.tests.commands import run_module


def test_every_published_set_is_rederived(tmp_path):
    out = tmp_path / "rederived.json"
    result = run_module("lab.serving.rederive", "--json", str(out), timeout_s=600)
    assert result.returncode == 0, result.stderr[-3000:]
    sets = json.loads(out.read_text())
    assert [found["set"] for found in sets] == [name for name, _, _ in rederive.SETS]
    assert all(found["rows"] for found in sets)
