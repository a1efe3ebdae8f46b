"""`tiercache demo` as the README runs it. Slow: it builds a model and a server."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.helpers import leaked_arenas, python_env

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow
# "above N (469 tokens)  warm  468  903.1  (800.8 .. 1005.3)": the name, its length, cold/warm, hit tokens, median
ROW = re.compile(r"^(below N|above N|chat turn \d+) \((\d+) tokens\)\s+(cold|warm)\s+(\d+)\s+([\d.]+)\s+\(")


def test_demo_shows_warm_hits():
    with leaked_arenas() as leaked:
        result = subprocess.run([sys.executable, "-m", "tiercache", "demo", "--no-progress", "--turns", "3",
                                 "--repeats", "2"],
                                capture_output=True, text=True, env=python_env(), timeout=1200)
    assert result.returncode == 0, result.stderr
    assert leaked == [], "the demo's server left its host arena in /dev/shm"
    rows = [ROW.match(line).groups() for line in result.stdout.splitlines() if ROW.match(line)]
    assert len(rows) == 7
    for name, length, kind, hit, ttft in rows:
        assert (int(hit) == 0) if kind == "cold" else (int(hit) > 0)
        assert float(ttft) > 0
    below_warm = next(r for r in rows if r[0] == "below N" and r[2] == "warm")
    assert int(below_warm[3]) == int(below_warm[1]) - 1
    assert "warm answers equal cold ones" in result.stdout and "(0 differ)" in result.stdout


def test_the_demo_says_when_a_warm_answer_differs():
    import torch

    from tiercache.demo import Checks

    checks = Checks()
    checks.logits(torch.tensor([[0.0, 1.0]]), torch.tensor([[0.0, 1.0]]))
    checks.tokens([5, 6, 7], [5, 6, 7])
    assert checks.equal and "(0 differ)" in checks.summary()
    checks.tokens([5, 6, 8], [5, 6, 7])  # a warm answer one token off
    assert not checks.equal and "WARM ANSWERS DIFFER" in checks.summary()
    other = Checks()
    other.logits(torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]]))  # another next token
    assert not other.equal
