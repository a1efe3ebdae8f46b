"""benchmarks/sglang_backend.py runs (tiny sizes, the tiercache arm only: its writer and fresh reader engines; the
other arms run the same code with other settings): a fresh engine reads every document's full pages from
tiercache, and the report has what `make bench-sglang` prints. No timing is checked."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from testkit.sglang_engine import ROOT


@pytest.mark.timeout(660)  # the benchmark's own limit (600 s, below) decides, not the suite's 300 s per test
def test_the_real_engine_benchmark_runs(tmp_path):
    report_path = tmp_path / "report.json"
    result = subprocess.run([sys.executable, "-m", "benchmarks.sglang_backend", "--smoke", "--arms",
                             "tiercache", "--json", str(report_path), "--logs", str(tmp_path / "logs")],
                            capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(report_path.read_text())
    settings, tiercache = report["settings"], report["arms"]["tiercache"]
    full_pages = settings["doc_tokens"] // settings["page_size"] * settings["page_size"]
    shared = tiercache["shared_prefix"]
    assert shared["requests"] == settings["docs"]
    assert shared["storage_tokens"] == settings["docs"] * full_pages, shared
    chat = tiercache["chat"]
    assert chat["requests"] == settings["chats"] * (settings["turns"] - 1)
    assert chat["cached_tokens"] > 0, chat
    assert "tiercache" in result.stdout and "shared_prefix" in result.stdout
