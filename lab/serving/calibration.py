"""How often lab/serving/stats.py calls a difference between identical arms, and how often it finds a true
1.25x one: by simulation on the stored runs' own noise.

The identical arms: before its restart, the `restart` arm runs exactly `tiercache`'s setup, and `alone-restart`
exactly `alone-equal`'s, in the same round. A synthetic set of R rounds draws R of those stored rounds with
replacement and makes each a new round: the two runs' requests, kept paired and in their order, resampled in blocks
of BLOCK consecutive requests (a moving-block bootstrap: the serial correlation of an open-loop replay's requests
stays inside each block; the drift between the two runs of the stored round stays in all of them), with a random
sign (which of two identical arms is "the arm" is arbitrary). Its verdict is the report's. The false-verdict rate
is the share of sets called ahead or behind; the power, the share called behind when every arm round is made 1.25x
slower (a percentile scales with its requests: the log ratio moves by log 1.25).

Pools: "all" (every stored A/A round, quiet and loaded machines), "quiet" (the runs whose README says the machine
was quiet). Run: `python -m lab.serving.calibration` (prints the table); lab/tests/
test_serving_calibration.py holds the rates.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from lab.serving import stats
from lab.serving.stored import read_report

RUNS = Path(__file__).resolve().parents[2] / "docs" / "runs"
# (run folder, what its README says of the machine)
STORED = (("serve_trace-2026-11-27-6d215e3", "loaded"), ("serve_trace-quiet-2026-11-27-e893eaf", "quiet"),
          ("serve_trace-round3-2026-11-27-f1c1a03", "unstated"), ("serve_trace-round4-2026-11-27-189fba5", "quiet"))
PAIRS = (("restart", "tiercache"), ("alone-restart", "alone-equal"))  # (arm, its identical arm) before the restart
FIGURES = (("TTFT p50", "ttft_s", 50), ("TTFT p90", "ttft_s", 90), ("E2E p50", "e2e_s", 50))
EFFECT = 1.25
BLOCK = 8


def aa_rounds() -> list[dict]:
    """Every stored A/A round: its run, machine, pair, round, and per figure the paired requests before the restart
    (two arrays in request order) and the percentile the figure takes."""
    found = []
    for folder, machine in STORED:
        runs = read_report(RUNS / folder / "serve_trace.json.gz")["runs"]
        results = {(r["arm"], r["round"]): r["result"] for r in runs if "outcomes" in r["result"]}
        for arm, twin in PAIRS:
            for round_ in sorted({r for _, r in results}):
                if (arm, round_) in results and (twin, round_) in results:
                    first, second = results[(arm, round_)], results[(twin, round_)]
                    figures = {label: (*_paired(first, second, field), p) for label, field, p in FIGURES}
                    found.append({"run": folder, "machine": machine, "pair": f"{arm}/{twin}", "round": round_,
                                  "figures": figures})
    return found


def _paired(first: dict, second: dict, field: str) -> tuple[np.ndarray, np.ndarray]:
    before = first["restart_at"]
    a, b = stats.per_request(first["outcomes"], field), stats.per_request(second["outcomes"], field)
    common = sorted(i for i in set(a) & set(b) if i < before)
    return np.array([a[i] for i in common]), np.array([b[i] for i in common])


def replicate(rng: np.random.Generator, a: np.ndarray, b: np.ndarray, p: float) -> float:
    """One new round from a stored one: its paired requests resampled in circular blocks of BLOCK."""
    n = len(a)
    starts = rng.integers(0, n, -(-n // BLOCK))
    rows = ((starts[:, None] + np.arange(BLOCK)[None, :]) % n).ravel()[:n]
    return math.log(np.percentile(a[rows], p) / np.percentile(b[rows], p))


def simulate(stored: list[tuple], rounds: int, sets: int = 2000, effect: float = 1.0, seed: int = 0) -> dict:
    """Synthetic sets of `rounds` rounds made from `stored` ((a, b, p) per stored round; module docstring); the
    share of each verdict."""
    rng = np.random.default_rng(seed)
    words: dict[str, int] = {}
    for _ in range(sets):
        picks = rng.integers(0, len(stored), rounds)
        logs = [replicate(rng, *stored[i]) * rng.choice([-1.0, 1.0]) + math.log(effect) for i in picks]
        word = stats.interval(logs)["verdict"]
        words[word] = words.get(word, 0) + 1
    return {word: count / sets for word, count in sorted(words.items())}


def pools(rounds_found: list[dict]) -> dict[str, dict[str, list[tuple]]]:
    """pool name -> figure -> the stored rounds' (a, b, p)."""
    chosen = {"all": rounds_found, "quiet": [r for r in rounds_found if r["machine"] == "quiet"]}
    return {name: {label: [r["figures"][label] for r in found] for label, _, _ in FIGURES}
            for name, found in chosen.items()}


def table(sets: int = 2000) -> list[dict]:
    rows = []
    for name, figures in pools(aa_rounds()).items():
        for label, pool in figures.items():
            for rounds in (3, 5, 8):
                null = simulate(pool, rounds, sets, seed=rounds)
                true = simulate(pool, rounds, sets, effect=EFFECT, seed=100 + rounds)
                spread = np.std([math.log(np.percentile(a, p) / np.percentile(b, p)) for a, b, p in pool], ddof=1)
                rows.append({"pool": name, "figure": label, "stored_rounds": len(pool), "rounds": rounds,
                             "false_verdicts": round(null.get("ahead", 0) + null.get("behind", 0), 4),
                             "power": round(true.get("behind", 0), 4), "pool_sd": round(float(spread), 4)})
    return rows


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description="the serving statistics' false verdicts and power, by simulation on "
                                                 "the stored runs' A/A rounds")
    parser.add_argument("--sets", type=int, default=2000, help="synthetic sets per cell (default 2000)")
    parser.add_argument("--json", help="write the table here too")
    parser.add_argument("--plot", help="draw it here (PNG)")
    parser.add_argument("--plot-from", help="draw a table written by --json, and simulate nothing")
    args = parser.parse_args()
    if args.plot_from:
        plot(read_report(args.plot_from)["rows"], args.plot)
        return
    rows = table(args.sets)
    if args.plot:
        plot(rows, args.plot)
    if args.json:
        from lab.common import write_report

        write_report({"sets": args.sets, "block": BLOCK, "effect": EFFECT, "stored": STORED, "rows": rows}, args.json)
    print(f"{'pool':<7}{'figure':<10}{'stored':>7}{'rounds':>7}{'false verdicts':>16}{'power at 1.25x':>16}"
          f"{'sd of a round':>15}")
    for row in rows:
        print(f"{row['pool']:<7}{row['figure']:<10}{row['stored_rounds']:>7}{row['rounds']:>7}"
              f"{row['false_verdicts']:>16.1%}{row['power']:>16.1%}{row['pool_sd']:>15.3f}")


def plot(rows: list[dict], path: str) -> None:
    from lab.common import pyplot

    plt = pyplot()

    fig, (false_ax, power_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for name, style in (("all", "-"), ("quiet", "--")):
        for label, _, _ in FIGURES:
            mine = [r for r in rows if r["pool"] == name and r["figure"] == label]
            rounds = [r["rounds"] for r in mine]
            false_ax.plot(rounds, [r["false_verdicts"] for r in mine], style, marker="o", label=f"{label}, {name}")
            power_ax.plot(rounds, [r["power"] for r in mine], style, marker="o", label=f"{label}, {name}")
    false_ax.axhspan(0.035, 0.065, color="0.9", label="5% +/- 1.5")
    false_ax.set(xlabel="rounds in a set", ylabel="share of sets", title="identical arms called ahead or behind")
    power_ax.axhline(0.8, color="0.6", lw=1)
    power_ax.set(xlabel="rounds in a set", ylabel="share of sets", title=f"a true {EFFECT}x slowdown called behind")
    for ax in (false_ax, power_ax):
        ax.set_xticks([3, 5, 8])
        ax.legend(fontsize=6)
    fig.suptitle("lab/serving/stats.py on the stored runs' A/A rounds (moving-block bootstrap, "
                 f"blocks of {BLOCK} requests)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
