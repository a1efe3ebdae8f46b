"""A lab command run as docs/benchmarks.md gives it: `python -m <module>` from the checkout's root (no module of
lab/ or benchmarks/ changes sys.path), with this interpreter, unbuffered (a smoke that fails shows how far it got)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_module(module: str, *args: str, timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"}, timeout=timeout_s)
