"""A benchmark run from two checkouts of tiercache, interleaved, with the code before run twice per round (an A/A
pair), and the ratio after / before of each of its figures with its 95% interval: whether a change meant to change
nothing (a restructuring) moved a benchmark.

    .venv/bin/python -m benchmarks.before_after --before DIR --after DIR --case eviction --equivalence-margin 1.10
                                                [--repeats 5] [--json OUT] [--plot OUT.png]

A case is a command run in a checkout (its own tiercache, its benchmarks: `python -m benchmarks.x` and `python -m
tiercache` find the checkout's package first) and a reader of its figures (name -> number). Each round runs before,
before again and after, in an order drawn per round (seeded), so that the machine's drift falls on every side. Per
figure: the median of each side, and for after / before and again / before the median of the per-round ratios with
the interval lab.serving.stats builds for that statistic (calibrated there). Words as the lab's: "equivalent" only
where the whole interval lies inside the margin given before the run; "higher" / "lower" where it excludes 1; else
"level" (the run could not tell). A figure whose A/A pair is not level or equivalent voids the set. Figures that must
not move at all (hit tokens) are compared for equality instead, run by run.
"""

from __future__ import annotations

import argparse
import json
import os
import math
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from lab.common import write_report
from lab.serving.stats import interval

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


SIDES = ("before", "again", "after")  # "again": the before checkout, run a second time in the same round
WORDS = {"ahead": "lower", "behind": "higher"}  # the lab's words for a time ratio, said of any figure


def ratio(runs: list[dict], name: str, side: str, margin: float) -> dict:
    """side / before of one figure: the median of the per-round ratios, its interval and its word."""
    by_round = {(r["repeat"], r["side"]): r["figures"].get(name) for r in runs}
    logs = [math.log(by_round[(k, side)] / by_round[(k, "before")]) for k in sorted({r["repeat"] for r in runs})
            if by_round.get((k, side)) and by_round.get((k, "before"))]
    cell = interval(logs, margin)
    return {**cell, "verdict": WORDS.get(cell["verdict"], cell["verdict"])}


def compare(runs: list[dict], margin: float) -> dict:
    table = {}
    for name in next(r for r in runs if r["side"] == "before")["figures"]:
        table[name] = {side: statistics.median(r["figures"][name] for r in runs if r["side"] == side
                                               and name in r["figures"]) for side in SIDES}
        table[name].update(after_before=ratio(runs, name, "after", margin),
                           again_before=ratio(runs, name, "again", margin))
    void = [name for name, row in table.items() if row["again_before"]["verdict"] in ("higher", "lower")]
    exact_equal = all(r["exact"] == runs[0]["exact"] for r in runs)
    return {"figures": table, "void_by": void, "exact_equal_in_every_run": exact_equal}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, type=Path, help="a checkout of the code before the change")
    parser.add_argument("--after", required=True, type=Path, help="a checkout of the code after it")
    parser.add_argument("--case", required=True, choices=sorted(CASES))
    parser.add_argument("--repeats", type=int, default=5, help="rounds (before, again and after, in a drawn order)")
    parser.add_argument("--equivalence-margin", type=float, default=1.10,
                        help="a ratio inside [1/M, M] with its whole interval is 'equivalent'; fixed before the run")
    parser.add_argument("--seed", type=int, default=0, help="of each round's order")
    parser.add_argument("--python", default=sys.executable, help="the interpreter both sides run with")
    parser.add_argument("--json", help="write every run and the comparison here")
    parser.add_argument("--plot", help="plot each figure's ratio and interval to this PNG")
    parser.add_argument("--plot-from", help="only plot (--plot) a JSON this script wrote")
    args = parser.parse_args()
    if args.plot_from:
        plot(json.loads(Path(args.plot_from).read_text()), args.plot)
        return 0
    rng = random.Random(args.seed)
    checkouts = {"before": args.before, "again": args.before, "after": args.after}
    runs = []
    for repeat in range(args.repeats):
        for position, side in enumerate(rng.sample(SIDES, len(SIDES))):
            run = {"side": side, "repeat": repeat, "position": position, "checkout": str(checkouts[side]),
                   **run_once(checkouts[side], args.case, args.python)}
            runs.append(run)
            print(f"{args.case} {side} {repeat}: {run['wall_s']:.0f} s", file=sys.stderr, flush=True)
    result = {"case": args.case, "command": CASES[args.case][0], "repeats": args.repeats,
              "equivalence_margin": args.equivalence_margin,
              "commits": {side: _commit(path) for side, path in (("before", args.before), ("after", args.after))},
              "runs": runs, **compare(runs, args.equivalence_margin)}
    if args.json:
        write_report(result, args.json)
    if args.plot:
        plot(result, args.plot)
    print(table(result))
    return 0


def table(result: dict) -> str:
    lines = [f"{'figure':40s} {'before':>10s} {'after':>10s}  {'after / before [95%]':36s} again / before [95%]"]
    for name, row in result["figures"].items():
        lines.append(f"{name:40s} {row['before']:>10.4g} {row['after']:>10.4g}  "
                     f"{_cell(row['after_before']):36s} {_cell(row['again_before'])}")
    lines.append(f"equivalence margin {result['equivalence_margin']} (fixed before the run)")
    if result["void_by"]:
        lines.append(f"VOID: the A/A pair is not level on {', '.join(result['void_by'])}")
    if result["exact_equal_in_every_run"] is False:
        lines.append("the figures that must not move differ between runs (see the JSON's runs: exact)")
    return "\n".join(lines)


def _cell(cell: dict) -> str:
    if cell["low"] is None:
        return f"x{cell['ratio']} {cell['verdict']}"
    return f"x{cell['ratio']:.3f} [{cell['low']:.3f}, {cell['high']:.3f}] {cell['verdict']}"


def plot(result: dict, path: str) -> None:
    from lab.common import pyplot

    plt = pyplot()

    names = list(result["figures"])
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(names) + 1.4))
    for offset, (key, label, color) in enumerate((("after_before", "after / before", "C0"),
                                                  ("again_before", "again / before (A/A)", "C7"))):
        cells = [result["figures"][name][key] for name in names]
        shown = [(i, c) for i, c in enumerate(cells) if c["low"] is not None]
        ax.errorbar([c["ratio"] for _, c in shown], [i + 0.2 * offset for i, _ in shown],
                    xerr=[[c["ratio"] - c["low"] for _, c in shown], [c["high"] - c["ratio"] for _, c in shown]],
                    fmt="o", capsize=3, color=color, label=label)
    margin = result["equivalence_margin"]
    ax.axvspan(1 / margin, margin, color="C2", alpha=0.08, label=f"equivalence margin {margin}")
    ax.axvline(1.0, color="grey", linewidth=1)
    ax.set_yticks(list(range(len(names))), names, fontsize=8)
    ax.invert_yaxis()
    commits = result["commits"]
    ax.set_xlabel("median of per-round ratios, 95% interval (lab.serving.stats)")
    ax.set_title(f"{result['case']}: {commits['after']} / {commits['before']}, {result['repeats']} rounds"
                 + (" (VOID: A/A not level)" if result["void_by"] else ""), fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _commit(checkout: Path) -> str:
    done = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or "?"


if __name__ == "__main__":
    sys.exit(main())
