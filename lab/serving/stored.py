"""Reports as the lab keeps them: the JSON a benchmark writes while it runs, stored gzipped in docs/runs once
published (a run folder stays small in every clone: tests/test_run_artifacts.py holds each to its limit). Every tool
that reads a report back (--merge, --plot-from, rederive.py, calibration.py) reads either."""

from __future__ import annotations

import gzip
import json
from pathlib import Path


def read_report(path: str | Path) -> dict:
    raw = Path(path).read_bytes()
    return json.loads(gzip.decompress(raw) if str(path).endswith(".gz") else raw)
