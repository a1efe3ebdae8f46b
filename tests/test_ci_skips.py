"""`.ci/run` fails on a skip that .ci/allowed-skips does not name (scripts/check_skips.py), from the file every
suite's pytest plugin (testkit/pytest_session.py) writes: shown here on a planted skip, and by a pytest run that records
its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.helpers import ROOT

CHECK = [sys.executable, str(ROOT / "scripts" / "check_skips.py")]
ALLOWED = str(ROOT / ".ci" / "allowed-skips")


def _check(tmp_path, skips: list[dict]) -> subprocess.CompletedProcess:
    path = tmp_path / "skips.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in skips))
    return subprocess.run([*CHECK, str(path), ALLOWED], capture_output=True, text=True)


def test_only_the_allowed_skips_pass(tmp_path):
    gpu = {"test": "tests/server/test_gpu_server.py::t", "reason": "needs a CUDA device"}
    assert _check(tmp_path, [gpu]).returncode == 0
    for reason in ("kubectl (with kustomize) is not installed", "nvcc is not installed: CUDA sources were not compiled",
                   "cannot mount a tmpfs here: permission denied", "the trace is not here"):
        result = _check(tmp_path, [gpu, {"test": "tests/x.py::t", "reason": reason}])
        assert result.returncode == 1 and f"tests/x.py::t: {reason}" in result.stdout, result.stdout


def test_a_pytest_run_writes_its_skips(tmp_path):
    test = tmp_path / "test_planted.py"
    test.write_text("import pytest\n\ndef test_skipped():\n    pytest.skip('planted: no such tool')\n\n"
                    "@pytest.mark.xfail(reason='an expected failure is not a skip')\ndef test_xfail():\n    assert 0\n")
    skips = tmp_path / "skips.jsonl"
    # The suites' plugin is what writes the file: loaded into a run of the planted test alone.
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "testkit.pytest_session",
                    "--rootdir", str(tmp_path), str(test)], cwd=tmp_path, capture_output=True,
                   env={**os.environ, "TIERCACHE_SKIPS_FILE": str(skips), "PYTHONPATH": str(ROOT)})
    written = [json.loads(line) for line in skips.read_text().splitlines()]
    assert [s["reason"] for s in written] == ["planted: no such tool"]
    result = subprocess.run([*CHECK, str(skips), ALLOWED], capture_output=True, text=True)
    assert result.returncode == 1 and "planted: no such tool" in result.stdout
