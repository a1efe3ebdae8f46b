"""The serving benchmark's report: every run kept, per arm the median of its runs, for every comparison the table
prints a ratio with its 95% interval and the word the docs may use (lab/serving/stats.py), the outputs
compared (lab/serving/outputs.py), and a plot whose title and legend come from the run's parameters.
"""

from __future__ import annotations

from lab.serving import exact, offloading, stats
from lab.serving.outputs import compare_outputs

AA = "A/A: the baseline against itself (the set's noise)"
VOID = "void: the set's A/A pair is not level"
# (arm, baseline, phase, the question the comparison answers)
COMPARISONS = (
    ("tiercache", "alone-equal", "all", "one engine on a CPU host: tiercache's host bytes as vLLM's own KV cache"),
    ("tiercache", "alone", "all", "an engine short of GPU memory (on CPU the small-cache alone stands in)"),
    ("alone-equal", "alone", "all", "what the memory alone buys vLLM"),
    ("restart", "alone-restart", "after", "after a restart (a deploy): tiercache kept, vLLM's cache lost"),
    ("two", "two-alone", "all", "two instances, round robin: one shared tiercache vs two caches of the same memory"),
    ("two-conv", "two-alone-conv", "all", "two instances, session affinity: the same, routed by conversation"),
    ("noreuse-tiercache", "noreuse-alone", "all", "the cost of the cache when nothing is reused"),
    ("noreuse-tiercache", "noreuse-alone-equal", "all", "the same, against vLLM given the memory"),
    # Against vLLM's own offloading (lab/serving/offloading.py), every engine with the same pool.
    ("offload-fs", "offload", "all", "one engine, nothing restarted: vLLM's fs tier added to its CPU offloading"),
    ("offload-tiercache", "offload", "all", "one engine, nothing restarted: tiercache added as the secondary tier"),
    ("offload-tiercache", "offload-fs", "all", "one engine, nothing restarted: tiercache's tier or vLLM's fs tier"),
    ("connector", "offload", "all", "one engine: tiercache's connector or vLLM's offloading, the same host bytes"),
    ("offload-fs-restart", "offload-restart", "after", "after a restart: what vLLM's fs tier kept"),
    ("offload-tiercache-restart", "offload-restart", "after", "after a restart: what tiercache's tier kept"),
    ("offload-tiercache-restart", "offload-fs-restart", "after", "after a restart: tiercache's tier or vLLM's fs"),
    ("connector-restart", "offload-fs-restart", "after", "after a restart: tiercache's connector or offloading + fs"),
    ("two-offload-fs", "two-offload", "all", "two replicas, round robin: an fs tier per replica"),
    ("two-offload-fs-shared", "two-offload", "all", "two replicas, round robin: one fs directory shared"),
    ("two-offload-tiercache", "two-offload", "all", "two replicas, round robin: one tiercache shared as their tier"),
    ("two-offload-tiercache", "two-offload-fs", "all", "two replicas: tiercache shared or an fs tier per replica"),
    ("two-offload-tiercache", "two-offload-fs-shared", "all", "two replicas: tiercache shared or one fs directory"),
    ("two-connector", "two-offload-fs-shared", "all", "two replicas: tiercache's connector or offloading + shared fs"),
    # A/A pairs: the same setup twice in each round (before its restart, `restart` runs tiercache's setup and
    # `alone-restart` alone-equal's; `alone-equal-again` is alone-equal run twice). A set whose A/A pair is not level
    # on a figure is void on that figure (`apply_aa`).
    ("restart", "tiercache", "before", AA),
    ("alone-restart", "alone-equal", "before", AA),
    ("alone-equal-again", "alone-equal", "all", AA),
    ("offload-again", "offload", "all", AA),
    ("offload-restart-again", "offload-restart", "all", AA),
    ("offload-restart", "offload", "before", AA),
    ("two-offload-again", "two-offload", "all", AA),
)
FIGURES = (("TTFT p50", "ttft_s", 50), ("TTFT p90", "ttft_s", 90), ("E2E p50", "e2e_s", 50))


def build(params: dict, runs: list[dict], meta: dict) -> dict:
    saturated = bool(params.get("saturated"))
    return {"params": params, "meta": meta, "runs": runs, "arms": summarize(runs),
            "comparisons": compare(runs, saturated=saturated, margin=params.get("equivalence_margin")),
            "outputs": compare_outputs(runs, saturated=saturated), "exact": exact.by_arm(runs),
            "offload": offloading.summary(runs)}


def summarize(runs: list[dict]) -> dict:
    """Per arm, the median over its runs of each figure (and per phase for the restart arms)."""
    by_arm: dict[str, list[dict]] = {}
    for run in runs:
        by_arm.setdefault(run["arm"], []).append(run["result"])
    arms = {}
    for name, results in by_arm.items():
        done = [r for r in results if "unavailable" not in r]
        if not done:
            arms[name] = {"unavailable": results[0]["unavailable"]}
            continue
        arms[name] = _medians(done)
        if "restart_at" in done[0]:
            arms[name]["phases"] = {phase: _medians([_phase(r, phase) for r in done]) for phase in ("before", "after")}
    return arms


def _medians(results: list[dict]) -> dict:
    figures = {"runs": len(results), "requests": results[0]["requests"],
               "errors": sum(r["errors"] for r in results), "prompt_tokens": results[0]["prompt_tokens"]}
    for group, points in (("ttft_ms", (50, 90, 99)), ("e2e_ms", (50, 90))):
        figures[group] = {f"p{p}": stats.median_of_runs(results, lambda r, p=p, g=group: r[g][f"p{p}"])
                          for p in points}
    figures["throughput_rps"] = stats.median_of_runs(results, lambda r: r["throughput_rps"])
    if all("drain_s" in r for r in results):
        figures["drain_s"] = stats.median_of_runs(results, lambda r: r["drain_s"])
    figures["hit_tokens"] = stats.median_of_runs(results, lambda r: r["hit_tokens"])
    figures["hits"] = {key: stats.median_of_runs(results, lambda r, k=key: r["hits"].get(k))
                       for key in results[0]["hits"]}
    return figures


def _phase(result: dict, phase: str) -> dict:
    """A restart arm's figures over one phase (its own replay's counters; latencies from its outcomes)."""
    return {**result["phases"][phase], "requests": result["phases"][phase]["requests"]}


def compare(runs: list[dict], saturated: bool = False, margin: float | None = None) -> list[dict]:
    """Every comparison both of whose arms ran; a saturated replay's also by requests per second (an open-loop
    replay's is the offered rate, the same in every arm). `margin`: the equivalence margin the run plan fixed before
    the run (stats.verdict), else none: "level" is then the most that can be said of a difference not resolved."""
    rows = []
    for arm, base, phase, question in COMPARISONS:
        arm_runs, base_runs = _rounds(runs, arm), _rounds(runs, base)
        rounds = sorted(set(arm_runs) & set(base_runs))
        if not rounds or (phase == "before" and "restart_at" not in arm_runs[rounds[0]]):
            continue
        row = {"arm": arm, "baseline": base, "phase": phase, "question": question, "rounds": len(rounds)}
        for label, field, p in FIGURES:
            # A phase is cut where the arm restarted (its twin in an A/A pair restarts nowhere).
            cuts = {r: arm_runs[r].get("restart_at") for r in rounds}
            row[label] = stats.paired_ratio([_per_request(arm_runs[r], field, phase, cuts[r]) for r in rounds],
                                            [_per_request(base_runs[r], field, phase, cuts[r]) for r in rounds], p,
                                            margin)
        if saturated and phase == "all":
            row["throughput"] = stats.per_run_ratio([arm_runs[r]["throughput_rps"] for r in rounds],
                                                    [base_runs[r]["throughput_rps"] for r in rounds], margin)
        rows.append(row)
    return apply_aa(rows)


def apply_aa(rows: list[dict]) -> list[dict]:
    """The one rule: on a figure where any of the set's A/A pairs is not level, every other comparison's verdict is
    void (its numbers stay); a set without an A/A pair says so in each verdict."""
    pairs = [row for row in rows if row["question"] == AA]
    for row in rows:
        if row["question"] == AA:
            continue
        for label in [label for label, _, _ in FIGURES] + (["throughput"] if "throughput" in row else []):
            cell = row[label]
            noise = [pair[label]["verdict"] for pair in pairs if label in pair]
            if not noise:
                cell["verdict"] = f"{cell['verdict']} (no A/A pair)"
            elif any(word not in ("level", "equivalent") for word in noise):
                cell["verdict"], cell["verdict_before_aa"] = VOID, cell["verdict"]
    return rows


def _rounds(runs: list[dict], arm: str) -> dict[int, dict]:
    return {run["round"]: run["result"] for run in runs if run["arm"] == arm and "outcomes" in run["result"]}


def _per_request(result: dict, field: str, phase: str, restart_at: int | None) -> dict[int, float]:
    chosen = stats.per_request(result["outcomes"], field)
    if phase == "after":
        return {i: t for i, t in chosen.items() if i >= restart_at}
    if phase == "before":
        return {i: t for i, t in chosen.items() if i < restart_at}
    return chosen


def add_output_flags(parser, plot_help: str) -> None:
    """The flags every serving benchmark shares: where the report, the plot and the engines' logs go; merging."""
    parser.add_argument("--json", help="write the report here (after every run)")
    parser.add_argument("--plot", help=plot_help)
    parser.add_argument("--plot-from", help="plot a report written by --json, and run nothing")
    parser.add_argument("--merge", nargs="+", metavar="REPORT", help="merge these reports into --json, run nothing")
    parser.add_argument("--work-dir", help="where engine logs (and the tiny model) go (default: a temp dir)")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    parser.add_argument("--drop-page-cache", action="store_true",
                        help="write back and drop the machine's page cache before every run (as root; recorded in "
                             "each run's provenance): a disk tier then starts every run from the disk")
    parser.add_argument("--equivalence-margin", type=_margin, metavar="RATIO",
                        help="fixed before the run: a ratio whose whole interval lies within [1/RATIO, RATIO] is "
                             "called equivalent (e.g. 1.10: within 10%% either way); without it, none is")


def _margin(text: str) -> float:
    value = float(text)
    if not value > 1.0:
        raise ValueError(f"an equivalence margin is a ratio above 1, got {text}")
    return value


# -- text ----------------------------------------------------------------------------------------------------------

def table(report: dict) -> str:
    saturated = report["params"].get("saturated")
    head = (f"{'arm':<20}{'runs':>5}{'err':>5}{'TTFT p50':>10}{'p90':>9}{'p99':>9}{'E2E p50':>9}"
            f"{'hit tok':>10}{'own':>9}{'loaded':>9}{'failed':>7}{'drain s':>8}"
            + (f"{'req/s':>7}" if saturated else ""))
    lines = [head]
    if report["params"].get("sequential"):
        lines.insert(0, "sequential replay (one request at a time): its latencies are no user's; it checks outputs")
    for name, arm in report["arms"].items():
        if "unavailable" in arm:
            lines.append(f"{name:<20}unavailable: {arm['unavailable']}")
            continue
        lines.append(_row(name, arm, saturated))
        for phase, figures in arm.get("phases", {}).items():
            lines.append(_row(f"  {phase} restart", figures, saturated))
    margin = report["params"].get("equivalence_margin")
    lines += ["", "ratios (arm / baseline: the median over rounds of the per-round paired ratio, its 95% interval "
              "(stats.py); a verdict counts only where the set's A/A pair is level; equivalence margin: "
              + (f"x{margin}" if margin else "none fixed before the run, so no 'equivalent'")
              + ("; req/s: above 1 is more served" if saturated else "") + "):"]
    for row in report["comparisons"]:
        cells = "  ".join(f"{label} {_ratio(row[label])}" for label, _, _ in FIGURES)
        if "throughput" in row:
            cells += f"  req/s {_ratio(row['throughput'])}"
        phase = "" if row["phase"] == "all" else f" ({row['phase']} restart)"
        lines.append(f"  {row['arm']} / {row['baseline']}{phase}: {cells}   [{row['question']}]")
    outputs = report["outputs"]
    lines += ["", "outputs against vLLM alone (greedy, every generated token):"]
    if outputs.get("reference_runs", 0) > 1:
        unstable, requests = len(outputs["reference_unstable"]), outputs.get("reference_requests", "?")
        lines.append(f"  vLLM alone against itself: {unstable} of {requests} requests answered differently in two of "
                     f"its {outputs['reference_runs']} runs")
    for name, tally in report["outputs"].get("arms", {}).items():
        causes = ", ".join(f"{n} {cause}" for cause, n in tally["causes"].items()) or "none differ"
        lines.append(f"  {name}: {tally['identical']} of {tally['compared']} identical ({causes})")
    return "\n".join(lines + offloading.report_lines(report.get("offload", {})) + exact.report_lines(report["runs"]))


def _row(name: str, arm: dict, saturated: bool) -> str:
    t, e, hits = arm["ttft_ms"], arm["e2e_ms"], arm.get("hits", {})
    loaded = hits.get("tiercache_delivered", hits.get("connector_promised"))
    return (f"{name:<20}{arm.get('runs', ''):>5}{arm['errors']:>5}{_num(t['p50']):>10}{_num(t['p90']):>9}"
            f"{_num(t['p99']):>9}{_num(e['p50']):>9}{_num(arm['hit_tokens'], 0):>10}"
            f"{_num(hits.get('vllm_prefix_cache'), 0):>9}{_num(loaded, 0):>9}"
            f"{_num(hits.get('tiercache_failed_loads'), 0):>7}{_num(arm.get('drain_s')):>8}"
            + (f"{arm['throughput_rps']:>7.2f}" if saturated else ""))


def _num(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _ratio(cell: dict) -> str:
    if cell["ratio"] is None:
        return "no data"
    if cell.get("low") is None:  # one round: no interval
        return f"{cell['ratio']:.2f} ({cell['verdict']})"
    return f"{cell['ratio']:.2f} [{cell['low']:.2f}, {cell['high']:.2f}] {cell['verdict']}"


# -- plot ----------------------------------------------------------------------------------------------------------

def plot(report: dict, path: str) -> None:
    from lab.common import pyplot

    plt = pyplot()

    arms = {name: arm for name, arm in report["arms"].items() if "unavailable" not in arm}
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    for name in arms:
        ttfts = sorted(o["ttft_s"] * 1e3 for run in report["runs"] if run["arm"] == name
                       for o in run["result"].get("outcomes", ()) if o["ok"])
        if ttfts:
            left.plot(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))],
                      label=f"{name} ({arms[name]['runs']} runs)")
    left.set(xscale="log", xlabel="time to first token (ms)", ylabel="fraction of requests",
             title="TTFT distribution per arm, every run pooled")
    left.legend(fontsize=7)
    names = list(arms)
    own = [arms[n]["hits"].get("vllm_prefix_cache") or 0 for n in names]
    loaded = [arms[n]["hits"].get("tiercache_delivered", arms[n]["hits"].get("connector_promised")) or 0
              for n in names]
    right.bar(names, own, label="vLLM's own prefix cache")
    right.bar(names, loaded, bottom=own, label="loaded from tiercache (delivered) / by vLLM's offloading")
    right.set(ylabel="prompt tokens not computed (median of runs)", title="Hit tokens per arm")
    right.tick_params(axis="x", rotation=35, labelsize=7)
    right.legend(fontsize=8)
    fig.suptitle(title(report), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def title(report: dict) -> str:
    params, meta = report["params"], report["meta"]
    mode = ("sequential (outputs only)" if params.get("sequential") else "saturated" if params.get("saturated")
            else f"time x{params['time_scale']}")
    where = f"{meta.get('engine', '?')}, {meta.get('model', '?')} (N = {params['N']}), {meta.get('cores', '?')} cores"
    return (f"{params['trace_name']}: {params['max_requests']} requests from {params['start']}, 1 conversation in "
            f"{params['conversations']}, {mode}, inputs <= {params['max_input_tokens']} tokens, "
            f"KV {params['kv_cache_mib']} MiB + host {params['host_mib']} MiB\n{where}; "
            f"commit {meta.get('commit', '?')}, {meta.get('date', '?')}")
