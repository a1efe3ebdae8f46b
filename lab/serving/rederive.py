"""Every published set of the serving and chat benchmarks re-derived with this checkout's statistics
(lab/serving/stats.py) from its stored runs: per comparison and figure, the cell the set's own report printed
and the one the report prints now, with what the set lacks (an A/A pair) or pools (code versions). Nothing is run again.

    python -m lab.serving.rederive --json rederived.json > rederived.txt
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lab.chat import report as chat_report
from lab.serving import report as serving_report
from lab.serving.stored import read_report

RUNS = Path(__file__).resolve().parents[2] / "docs" / "runs"
# (the set as the docs name it, its stored report, which report builds it)
SETS = (
    ("equal memory, 2 rounds", "serve_trace-equal-memory-2026-11-26-b3c8415/report.json.gz", "serving"),
    ("seven arms, loaded, 3 rounds", "serve_trace-2026-11-27-6d215e3/serve_trace.json.gz", "serving"),
    ("seven arms, quiet, 2 rounds", "serve_trace-quiet-2026-11-27-e893eaf/serve_trace.json.gz", "serving"),
    ("quiet + round 3", "serve_trace-round3-2026-11-27-f1c1a03/merged-with-quiet.json.gz", "serving"),
    ("three quiet rounds", "serve_trace-round4-2026-11-27-189fba5/quiet-three-rounds.json.gz", "serving"),
    ("four open-loop rounds", "serve_trace-round4-2026-11-27-189fba5/four-rounds.json.gz", "serving"),
    ("session affinity, 3 rounds", "serve_trace-affinity-2026-11-27-e22cd4d/three-rounds.json.gz", "serving"),
    ("nothing reused, 2 rounds", "serve_trace-noreuse-2026-11-27-e22cd4d/two-rounds.json.gz", "serving"),
    ("saturated", "serve_trace-saturated-2026-11-27-6d63f4c/saturated.json.gz", "serving"),
    ("chat, 3 repeats", "chat_rounds-2026-11-27-d226055/chat_rounds.json.gz", "chat"),
)
FIGURES = [label for label, _, _ in serving_report.FIGURES] + ["throughput"]


def rederive(name: str, relative: str, kind: str) -> dict:
    stored = read_report(RUNS / relative)
    build = chat_report.build if kind == "chat" else serving_report.build
    now = build(stored["params"], stored["runs"], stored.get("meta", {}))
    then = {(c["arm"], c["baseline"], c["phase"]): c for c in stored.get("comparisons", [])}
    commits = sorted({(run.get("from") or stored.get("meta", {})).get("commit") or "?" for run in stored["runs"]})
    rows = []
    for row in now["comparisons"]:
        before = then.get((row["arm"], row["baseline"], row["phase"]), {})
        for label in FIGURES:
            if label in row:
                rows.append({"comparison": f"{row['arm']} / {row['baseline']} ({row['phase']})", "figure": label,
                             "aa": row["question"] == serving_report.AA, "then": _cell(before.get(label)),
                             "now": _cell(row[label])})
    return {"set": name, "file": relative, "code_versions": commits,
            "rounds": 1 + max(run["round"] for run in stored["runs"]),
            "has_aa_pair": any(r["aa"] for r in rows), "rows": rows}


def _cell(cell: dict | None) -> str:
    if not cell or cell.get("ratio") is None:
        return "-"
    if cell.get("low") is None:
        return f"{cell['ratio']:.2f} ({cell['verdict']})"
    return f"{cell['ratio']:.2f} [{cell['low']:.2f}, {cell['high']:.2f}] {cell['verdict']}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write every set's rows here")
    args = parser.parse_args()
    sets = [rederive(*entry) for entry in SETS]
    if args.json:
        Path(args.json).write_text(json.dumps(sets, indent=1))
    for found in sets:
        pooled = f"; POOLS {len(found['code_versions'])} code versions" if len(found["code_versions"]) > 1 else ""
        print(f"\n{found['set']} ({found['file']}): {found['rounds']} rounds, code {', '.join(found['code_versions'])}"
              f"{pooled}{'' if found['has_aa_pair'] else '; NO A/A PAIR'}")
        for row in found["rows"]:
            print(f"  {row['comparison']:<48}{row['figure']:<11}then {row['then']:<34} now {row['now']}")


if __name__ == "__main__":
    main()
