"""What every benchmark writes the same way, the lab's (lab/) and the package's micro-benchmarks (benchmarks/) alike:
percentiles with one meaning, a report with its provenance (the code it ran, on what machine) as JSON, and plots.

Percentile, here and in every report: the p-th percentile interpolates linearly between the two nearest ranks
(numpy's default method, statistics.quantiles(method="inclusive"), Hyndman and Fan's type 7): p0 is the smallest
value, p100 the largest, one value is every percentile, and no value gives None, never 0. The serving statistics
(lab/serving/stats.py, calibration.py) take numpy's percentile of arrays directly: the same definition.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np

ROOT = Path(__file__).resolve().parent.parent  # the checkout: `python -m lab.x` and `-m benchmarks.x` run from here


def percentile(values: Iterable[float | None], p: float) -> float | None:
    """The p-th percentile (0-100) of the values, as the module says; None values (a failed request has no TTFT) are
    left out; None when no value is left."""
    kept = [float(v) for v in values if v is not None]
    return float(np.percentile(kept, p, method="linear")) if kept else None


def percentiles(values: Sequence[float | None], points: Iterable[int], scale: float = 1.0,
                digits: int = 2) -> dict[str, float | None]:
    """{"p50": ..., "p99": ...}: each percentile of `points` times `scale` (1e3: seconds to ms), rounded to `digits`."""
    found = {}
    for p in points:
        value = percentile(values, p)
        found[f"p{p}"] = None if value is None else round(value * scale, digits)
    return found


def code() -> dict:
    """The code a run ran: {"commit": the checkout's HEAD, "dirty": None, or a digest of what differs from it}. What
    differs is every uncommitted change to a tracked file and every untracked file that git does not ignore, by
    content, anywhere in the checkout: the product, lab/, benchmarks/ and testkit/ alike (a set stops when this changes
    under it: lab/serving/arms.py, interleaved)."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True).stdout
        except OSError:  # no git on this machine (a GPU machine given the tree without it): commit "unknown"
            return ""

    commit = git("rev-parse", "HEAD").strip() or "unknown"
    diff = git("diff", "HEAD", "--binary")
    untracked = git("ls-files", "--others", "--exclude-standard").splitlines()
    if not diff and not untracked:
        return {"commit": commit, "dirty": None}
    digest = hashlib.sha256(diff.encode())
    for name in untracked:  # by content too: an untracked module edited while a set runs is a change of code
        digest.update(name.encode() + b"\0")
        try:
            digest.update((ROOT / name).read_bytes())
        except OSError:  # removed since git listed it
            pass
    return {"commit": commit, "dirty": digest.hexdigest()[:16]}


def meta(**fields) -> dict:
    """Where and on what a report's runs were made (plots' titles and the docs quote these): the date, the commit
    (short) and the digest of what differed from it, the machine; and `fields` (the engine, the model)."""
    version = code()
    return {"date": time.strftime("%Y-%m-%d"), "commit": version["commit"][:12], "dirty": version["dirty"],
            **fields, "cores": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version()}


def write_report(report: dict, path: str | os.PathLike | None = None, compact: bool = False) -> None:
    """The report as JSON at `path` (stdout without one), its provenance (`meta`) added when it has none. `compact`:
    one line per top-level key, each value on its line without spaces (a report of thousands of per-request rows
    stays small, and a diff of two says which key changed)."""
    report = report if "meta" in report else {**report, "meta": meta()}
    if compact:
        text = "{\n" + ",\n".join(f"{json.dumps(k)}: {json.dumps(v, separators=(',', ':'))}"
                                  for k, v in report.items()) + "\n}"
    else:
        text = json.dumps(report, indent=1)
    if path is None:
        print(text)
    else:
        Path(path).write_text(text + "\n")


def pyplot():
    """matplotlib's pyplot, drawing to files (no display). Imported when a plot is asked for: the engines' venvs
    have no matplotlib (`plot_elsewhere`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_elsewhere(report: dict, json_path: str | None, path: str, module: str,
                   plot: Callable[[dict, str], None]) -> None:
    """`plot(report, path)` here when matplotlib imports, else `python -m module --plot-from JSON --plot path` with
    the dev venv's python (.venv), from the checkout's root."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        source = json_path or tempfile.mkstemp(suffix=".json")[1]
        if not json_path:
            Path(source).write_text(json.dumps(report))
        python = ROOT / ".venv" / "bin" / "python"
        command = [str(python), "-m", module, "--plot-from", os.path.abspath(source), "--plot", os.path.abspath(path)]
        if not python.exists():
            print(f"no matplotlib here and no {python}: plot later with {' '.join(command[1:])} (any venv with "
                  f"matplotlib, from {ROOT})", file=sys.stderr)
            return
        subprocess.run(command, check=True, cwd=ROOT)
        return
    plot(report, path)
