"""A benchmark run from two checkouts of tiercache, interleaved, and the ratio after / before of each of its figures
with a bootstrap interval: whether a change meant to change nothing (a restructuring) moved a benchmark.

    .venv/bin/python -m benchmarks.before_after --before DIR --after DIR --case eviction [--repeats 3] [--json OUT]

A case is a command run in a checkout (its own tiercache, its benchmarks: `python -m benchmarks.x` and `python -m
tiercache` find the checkout's package first) and a reader of its figures (name -> number). Runs alternate before,
after, before, after... so that the machine's drift falls on both sides. Per figure: the median of each side, the
median of the pairs' ratios after / before, and a 95% bootstrap interval of it (resampling pairs; with 3 pairs it is
about their range). "level" when the interval holds 1. Figures that must not move at all (hit tokens) are compared
for equality instead, run by run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from lab.common import write_report

Figures = dict[str, float]


def read_path_cost(out: str, _: Path) -> tuple[Figures, dict]:
    figures = {}
    for row in json.loads(out)["rows"]:
        size = f"{row['chunk_bytes'] >> 10}KiB"
        for path in ("arena", "data channel"):
            for op in ("put", "get"):
                client_ms, server_ms, wall_ms = row[path][op]
                figures[f"{size} {path} {op} CPU ms"] = client_ms + server_ms
                figures[f"{size} {path} {op} wall ms"] = wall_ms
    return figures, {}


def read_eviction(_: str, written: Path) -> tuple[Figures, dict]:
    figures = {}
    for row in json.loads(written.read_text()):
        name = f"{row['tier']} {row['records']:,}"
        if row["tier"] == "server":
            figures[f"{name} evicting ms per 1,000"] = 1e3 * row["evicting_s_per_1000"]
            figures[f"{name} filling ms per 1,000"] = 1e3 * row["filling_s_per_1000"]
            continue
        figures[f"{name} filling puts/s"] = row["filling_per_s"]
        figures[f"{name} evicting puts/s"] = row["evicting_per_s"]
    return figures, {}


def read_cliff(out: str, _: Path) -> tuple[Figures, dict]:
    result = json.loads(out)
    figures = {key: value for key, value in result.items() if key.startswith("lookup_ms_") and value is not None}
    hits = {part: [row.get("hit_tokens", row.get("tiercache_hit_ratio")) for row in result[part]]
            for part in ("repeated", "multi_turn", "multi_turn_long", "long_context", "branches")}
    return figures, hits


# name -> (command after the interpreter, with {out} for a file it writes; reader of (stdout, that file))
CASES: dict[str, tuple[list[str], Callable[[str, Path], tuple[Figures, dict]]]] = {
    "path_cost": (["-m", "benchmarks.path_cost", "--sizes", "64KiB,1MiB,4MiB", "--calls", "100", "--megabytes", "64",
                   "--json"], read_path_cost),
    "eviction": (["-m", "benchmarks.eviction", "--disk", "1000,100000", "--host-gib", "1", "--server-gib", "0.5",
                  "--json-out", "{out}"], read_eviction),
    "cliff": (["-m", "tiercache", "bench", "cliff", "--quick", "--json", "--no-progress"], read_cliff),
}


def run_once(checkout: Path, case: str, python: str) -> dict:
    command, read = CASES[case]
    with tempfile.TemporaryDirectory(prefix="tiercache-before-after-") as work:
        written = Path(work) / "figures.json"
        argv = [python, *(part.replace("{out}", str(written)) for part in command)]
        started = time.monotonic()
        done = subprocess.run(argv, cwd=checkout, capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(checkout)})
        if done.returncode:
            raise SystemExit(f"{' '.join(argv)} in {checkout} exited with {done.returncode}:\n{done.stderr[-3000:]}")
        figures, exact = read(done.stdout, written)
    return {"figures": figures, "exact": exact, "wall_s": time.monotonic() - started}


def bootstrap(ratios: list[float], rounds: int = 2000, seed: int = 0) -> tuple[float, float]:
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(rounds))
    return medians[int(0.025 * rounds)], medians[int(0.975 * rounds) - 1]


def compare(runs: list[dict]) -> dict:
    before = [r for r in runs if r["side"] == "before"]
    after = [r for r in runs if r["side"] == "after"]
    pairs = list(zip(before, after))
    table = {}
    for name in before[0]["figures"]:
        ratios = [a["figures"][name] / b["figures"][name] for b, a in pairs if b["figures"].get(name)]
        low, high = bootstrap(ratios)
        table[name] = {"before": statistics.median(r["figures"][name] for r in before),
                       "after": statistics.median(r["figures"][name] for r in after),
                       "ratio": statistics.median(ratios), "low": low, "high": high,
                       "verdict": "level" if low <= 1 <= high else "higher" if low > 1 else "lower"}
    exact_equal = all(r["exact"] == runs[0]["exact"] for r in runs)
    return {"figures": table, "exact_equal_in_every_run": exact_equal}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, type=Path, help="a checkout of the code before the change")
    parser.add_argument("--after", required=True, type=Path, help="a checkout of the code after it")
    parser.add_argument("--case", required=True, choices=sorted(CASES))
    parser.add_argument("--repeats", type=int, default=3, help="pairs of runs, interleaved")
    parser.add_argument("--python", default=sys.executable, help="the interpreter both sides run with")
    parser.add_argument("--json", help="write every run and the comparison here")
    parser.add_argument("--plot", help="plot each figure's ratio and interval to this PNG")
    parser.add_argument("--plot-from", help="only plot (--plot) a JSON this script wrote")
    args = parser.parse_args()
    if args.plot_from:
        plot(json.loads(Path(args.plot_from).read_text()), args.plot)
        return 0
    runs = []
    for repeat in range(args.repeats):
        for side, checkout in (("before", args.before), ("after", args.after)):
            run = {"side": side, "repeat": repeat, "checkout": str(checkout), **run_once(checkout, args.case,
                                                                                          args.python)}
            runs.append(run)
            print(f"{args.case} {side} {repeat}: {run['wall_s']:.0f} s", file=sys.stderr, flush=True)
    result = {"case": args.case, "command": CASES[args.case][0], "repeats": args.repeats,
              "commits": {side: _commit(path) for side, path in (("before", args.before), ("after", args.after))},
              "runs": runs, **compare(runs)}
    if args.json:
        write_report(result, args.json)
    if args.plot:
        plot(result, args.plot)
    for name, row in result["figures"].items():
        print(f"{name:40s} {row['before']:>12.4g} {row['after']:>12.4g}  x{row['ratio']:.3f} "
              f"[{row['low']:.3f}, {row['high']:.3f}] {row['verdict']}")
    if result["exact_equal_in_every_run"] is False:
        print("the figures that must not move differ between runs (see the JSON's runs: exact)")
    return 0


def plot(result: dict, path: str) -> None:
    from lab.common import pyplot

    plt = pyplot()

    names = list(result["figures"])
    rows = [result["figures"][name] for name in names]
    fig, ax = plt.subplots(figsize=(8, 0.3 * len(names) + 1.2))
    y = range(len(names))
    ax.errorbar([r["ratio"] for r in rows], y, xerr=[[r["ratio"] - r["low"] for r in rows],
                                                    [r["high"] - r["ratio"] for r in rows]], fmt="o", capsize=3)
    ax.axvline(1.0, color="grey", linewidth=1)
    ax.set_yticks(list(y), names, fontsize=8)
    ax.invert_yaxis()
    commits = result["commits"]
    ax.set_xlabel("after / before, median of pairs, 95% bootstrap interval")
    ax.set_title(f"{result['case']}: {commits['after']} / {commits['before']}, {result['repeats']} interleaved pairs",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _commit(checkout: Path) -> str:
    done = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or "?"


if __name__ == "__main__":
    sys.exit(main())
