"""The chat benchmark's report: the serving benchmark's per-arm medians, overall ratios and output comparison
(lab/serving/report.py, outputs.py), and per round: each run's TTFT percentiles and hit tokens per round, the
median over runs per arm, and the ratios per round with their 95% intervals (lab/serving/stats.py).

In a closed loop a round's prompt holds the replies before it, so one reply that differs changes every later prompt
of that user: a mismatch whose prompt already differed from the reference's is counted as following an earlier one,
and the first differing (user, round) of each run is where to look.
"""

from __future__ import annotations

from lab.common import percentile
from lab.serving import offloading
from lab.serving import report as serving
from lab.serving import stats
from lab.serving.outputs import DIFFERENT_HIT, UNEXPLAINED, compare_outputs

FOLLOWS = "prompt differs: an earlier reply differed"
# (arm, baseline, first round compared: None for all, "restart" for the rounds after the restart)
ROUND_COMPARISONS = (("tiercache", "alone-equal", None), ("tiercache", "alone", None),
                     ("restart", "alone-restart", "restart"),
                     # against vLLM's own offloading (lab/serving/offloading.py)
                     ("connector", "offload", None), ("offload-tiercache", "offload-fs", None),
                     ("offload-tiercache-restart", "offload-fs-restart", "restart"),
                     ("connector-restart", "offload-fs-restart", "restart"))
ROUND_FIGURES = (("TTFT p50", 50), ("TTFT p90", 90))


def build(params: dict, runs: list[dict], meta: dict) -> dict:
    users = params["users"]
    return {"params": params, "meta": meta, "runs": runs, "arms": serving.summarize(runs),
            "comparisons": serving.compare(runs, margin=params.get("equivalence_margin")),
            "offload": offloading.summary(runs),
            "rounds": rounds_per_arm(runs, users),
            "round_comparisons": compare_rounds(runs, users, params["rounds"]), "outputs": compare_chat(runs, users)}


# -- per round -----------------------------------------------------------------------------------------------------

def round_figures(result: dict, users: int) -> dict[int, dict]:
    """One run's figures per round: TTFT p50 / p90 (ms) over the round's requests that succeeded, hit tokens (the sum
    of their cached_tokens), and the vLLM counters' hits charged to them (own prefix cache, connector)."""
    records = {record["index"]: record for record in result.get("chat", ())}
    grouped: dict[int, list[dict]] = {}
    for outcome in result["outcomes"]:
        grouped.setdefault(outcome["index"] // users, []).append(outcome)
    figures = {}
    for round_, outcomes in sorted(grouped.items()):
        good = [o for o in outcomes if o["ok"]]
        charged = [records.get(o["index"], {}) for o in outcomes]
        ttfts = [o["ttft_s"] * 1e3 for o in good]
        figures[round_] = {"requests": len(outcomes), "errors": len(outcomes) - len(good),
                           "ttft_p50_ms": percentile(ttfts, 50), "ttft_p90_ms": percentile(ttfts, 90),
                           "hit_tokens": sum(o.get("cached_tokens") or 0 for o in good),
                           "own_hits": sum(c.get("own_hits") or 0 for c in charged),
                           "connector_hits": sum(c.get("connector_hits") or 0 for c in charged)}
    return figures


def rounds_per_arm(runs: list[dict], users: int) -> dict[str, dict[int, dict]]:
    """Per arm and round, the median over the arm's runs of each run's round figures."""
    by_arm: dict[str, list[dict[int, dict]]] = {}
    for run in runs:
        if "outcomes" in run["result"]:
            by_arm.setdefault(run["arm"], []).append(round_figures(run["result"], users))
    medians = {}
    for arm, per_run in by_arm.items():
        rounds = sorted({r for figures in per_run for r in figures})
        medians[arm] = {r: {key: stats.median_of_runs([f[r] for f in per_run if r in f], lambda f, k=key: f[k])
                            for key in per_run[0][rounds[0]]} for r in rounds}
    return medians


def compare_rounds(runs: list[dict], users: int, rounds: int) -> list[dict]:
    """Per comparison and round, the TTFT ratios (arm / baseline) with their intervals over repeats and users."""
    rows = []
    for arm, base, start in ROUND_COMPARISONS:
        arm_runs, base_runs = _by_repeat(runs, arm), _by_repeat(runs, base)
        repeats = sorted(set(arm_runs) & set(base_runs))
        if not repeats:
            continue
        first = restart_round(rounds) if start == "restart" else 0
        row = {"arm": arm, "baseline": base, "from_round": first, "repeats": len(repeats), "rounds": {}}
        for round_ in range(first, rounds):
            row["rounds"][round_] = {
                label: descriptive(stats.paired_ratio([_in_round(arm_runs[r], users, round_) for r in repeats],
                                                      [_in_round(base_runs[r], users, round_) for r in repeats], p))
                for label, p in ROUND_FIGURES}
        rows.append(row)
    return rows


def descriptive(cell: dict) -> dict:
    """A chat round's cell (one round of each user: 16 requests a cell) describes, it does not decide: its interval
    is kept, its verdict word is not (verdicts come from the comparisons over whole runs)."""
    return {**cell, "verdict": "descriptive"}


def restart_round(rounds: int) -> int:
    """The first round after the restart (the engine is restarted once every user has finished the rounds before)."""
    return rounds // 2


def _by_repeat(runs: list[dict], arm: str) -> dict[int, dict]:
    return {run["round"]: run["result"] for run in runs if run["arm"] == arm and "outcomes" in run["result"]}


def _in_round(result: dict, users: int, round_: int) -> dict[int, float]:
    return {i: t for i, t in stats.per_request(result["outcomes"], "ttft_s").items() if i // users == round_}


# -- outputs -------------------------------------------------------------------------------------------------------

def compare_chat(runs: list[dict], users: int, reference: str = "alone") -> dict:
    """outputs.compare_outputs, each mismatch placed at its (user, round) and, where the prompt already differed
    from the reference's, counted as following an earlier mismatch; per run, the first differing (user, round)."""
    compared = compare_outputs(runs, reference)
    references = {run["round"]: run["result"] for run in runs if run["arm"] == reference and "chat" in run["result"]}
    if not references:
        return compared
    for arm, tally in compared["arms"].items():
        mine = {run["round"]: run["result"] for run in runs if run["arm"] == arm}
        first: dict[int, dict] = {}
        for mismatch in tally["mismatches"]:
            repeat = mismatch["round"]
            own = _hashes(mine.get(repeat, {}))
            base = _hashes(references.get(repeat, references[min(references)]))
            index = mismatch["request"]
            mismatch["user"], mismatch["chat_round"] = index % users, index // users
            if own.get(index) != base.get(index):
                mismatch["cause"] = FOLLOWS
            at = first.get(repeat)
            if at is None or (mismatch["chat_round"], mismatch["user"]) < (at["chat_round"], at["user"]):
                first[repeat] = {"chat_round": mismatch["chat_round"], "user": mismatch["user"],
                                 "cause": mismatch["cause"]}
        tally["causes"] = {}
        for mismatch in tally["mismatches"]:
            tally["causes"][mismatch["cause"]] = tally["causes"].get(mismatch["cause"], 0) + 1
        tally["first_difference"] = {str(repeat): at for repeat, at in sorted(first.items())}
    return compared


def _hashes(result: dict) -> dict[int, str]:
    return {record["index"]: record["prompt_hash"] for record in result.get("chat", ())}


# -- text ----------------------------------------------------------------------------------------------------------

def table(report: dict) -> str:
    lines = [serving.table(report), "", "per round (median of runs): TTFT p50 / p90 ms, hit tokens (cached_tokens), "
             "own / connector hits as vLLM's counters charged them"]
    for arm, per_round in report["rounds"].items():
        rounds = sorted(per_round, key=int)
        lines.append(f"  {arm:<18}" + "".join(f"{'round ' + str(r):>16}" for r in rounds))
        for label, key in (("TTFT p50", "ttft_p50_ms"), ("TTFT p90", "ttft_p90_ms"), ("hit tokens", "hit_tokens"),
                           ("own", "own_hits"), ("connector", "connector_hits")):
            digits = 1 if key.startswith("ttft") else 0
            lines.append(f"    {label:<16}" + "".join(f"{serving._num(per_round[r][key], digits):>16}" for r in rounds))
    lines += ["", "ratios per round (arm / baseline, TTFT; median of the repeats' paired ratios and its 95% interval; "
                  "descriptive, no verdict: a cell is one round of each user):"]
    for row in report["round_comparisons"]:
        after = " (the rounds after the restart)" if row["from_round"] else ""
        lines.append(f"  {row['arm']} / {row['baseline']}{after}:")
        for round_, cells in row["rounds"].items():
            lines.append(f"    round {round_}: " + "   ".join(f"{label} {serving._ratio(cell)}"
                                                           for label, cell in cells.items()))
    lines += ["", f"first differing (user, round) per run ({DIFFERENT_HIT} / {UNEXPLAINED} / {FOLLOWS}):"]
    for arm, tally in report["outputs"].get("arms", {}).items():
        firsts = tally.get("first_difference") or {}
        where = ", ".join(f"run {repeat}: user {at['user']} round {at['chat_round']} ({at['cause']})"
                          for repeat, at in firsts.items()) or "none: every reply identical"
        lines.append(f"  {arm}: {where}")
    return "\n".join(lines)


# -- plot ----------------------------------------------------------------------------------------------------------

def plot(report: dict, path: str) -> None:
    from lab.common import pyplot

    plt = pyplot()

    per_arm = report["rounds"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    for arm, per_round in per_arm.items():
        rounds = sorted(per_round, key=int)
        left.plot([int(r) for r in rounds], [per_round[r]["ttft_p50_ms"] for r in rounds], marker="o",
                  label=f"{arm} ({report['arms'][arm].get('runs', '?')} runs)")
    if report["params"].get("rounds", 0) > 1 and any(a in per_arm for a in ("restart", "alone-restart")):
        left.axvline(restart_round(report["params"]["rounds"]) - 0.5, color="grey", linestyle=":",
                     label="engine restarted")
    left.set(yscale="log", xlabel="round", ylabel="TTFT p50 (ms, median of runs)", title="TTFT per round")
    left.legend(fontsize=7)
    width = 0.8 / max(len(per_arm), 1)
    for k, (arm, per_round) in enumerate(per_arm.items()):
        rounds = sorted(per_round, key=int)
        xs = [int(r) - 0.4 + width * (k + 0.5) for r in rounds]
        hits = [per_round[r]["hit_tokens"] or 0 for r in rounds]
        own = [min(per_round[r]["own_hits"] or 0, h) for r, h in zip(rounds, hits)]
        loaded = [min(per_round[r]["connector_hits"] or 0, h - o) for r, h, o in zip(rounds, hits, own)]
        colour = f"C{k}"  # the arm's colour on the left too
        right.bar(xs, own, width, color=colour, label=f"{arm}: vLLM's own prefix cache")
        right.bar(xs, loaded, width, bottom=own, color=colour, alpha=0.45, hatch="//",
                  label=f"{arm}: loaded through the connector")
        # vLLM's counters are read between requests, not per request: what a round's requests hit but the counters
        # charged to a neighbouring round's is left as the outline up to the hit tokens (cached_tokens).
        right.bar(xs, hits, width, fill=False, edgecolor=colour, linewidth=0.7,
                  label="hit tokens (cached_tokens); unfilled: charged to another round" if k == 0 else None)
    right.set(xlabel="round", ylabel="prompt tokens not computed (median of runs)",
              title="Hit tokens per round: own (solid), loaded (hatched)")
    right.legend(fontsize=6, ncol=2)
    fig.suptitle(title(report), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def title(report: dict) -> str:
    params, meta = report["params"], report["meta"]
    where = f"{meta.get('engine', '?')}, {meta.get('model', '?')} (N = {params['N']}), {meta.get('cores', '?')} cores"
    return (f"chat rounds, closed loop: {params['users']} users x {params['rounds']} rounds, system "
            f"{params['system_tokens']} + context {params['context_tokens']} tokens, questions "
            f"{params['question_tokens']}, replies {params['answer_tokens']}, gap {params['gap_s']} s, stagger "
            f"{params['stagger_s']} s, KV {params['kv_cache_mib']} MiB + host {params['host_mib']} MiB\n{where}; "
            f"commit {meta.get('commit', '?')}, {meta.get('date', '?')}")
