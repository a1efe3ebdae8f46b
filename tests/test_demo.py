"""`tiercache demo` as the README runs it. Slow: it builds a model and a server."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import python_env

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow


def test_demo_shows_warm_hits():
    result = subprocess.run([sys.executable, "-m", "tiercache", "demo", "--no-progress", "--turns", "3"],
                            capture_output=True, text=True, env=python_env(), timeout=600)
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines() if line.startswith(("below", "above", "chat"))]
    assert len(rows) == 7
    for row in rows:
        kind, hit = row[-3], int(row[-2])
        assert (hit == 0) if kind == "cold" else (hit > 0)
    below_warm = next(r for r in rows if r[0] == "below" and r[-3] == "warm")
    prompt_tokens = int(below_warm[2].strip("("))
    assert int(below_warm[-2]) == prompt_tokens - 1
