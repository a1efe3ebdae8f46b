"""Draws benchmarks/hf_gpu.py's reports: per case, the model's own prefill against the cold pass and the hit through
each tier (log scale: the cold pass and a 128K prompt are orders apart from an 8K hit).

    python -m benchmarks.hf_gpu_plot hf_gpu.json [more.json ...] --out hf_gpu.png

Several reports are drawn as one (a run whose later cases ran in another process writes several).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def load_cases(paths: list[str]) -> list[dict]:
    cases = [case for path in paths for case in json.loads(Path(path).read_text())["cases"] if "error" not in case]
    return sorted(cases, key=lambda case: (case["prompt_tokens"], case["shape"]))


def draw(cases: list[dict], out: str, title: str) -> None:
    from lab.common import pyplot

    plt = pyplot()

    tiers = sorted({tier for case in cases for tier in case["tiers"]})
    bars = [("alone", lambda case: case["model_alone_ttft_s"])]
    for tier in tiers:
        bars.append((f"{tier} cold", lambda case, t=tier: case["tiers"][t]["cold"]["ttft_s"]))
        bars.append((f"{tier} hit", lambda case, t=tier: case["tiers"][t]["hit"]["ttft_s"]))
    width = 0.8 / len(bars)
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(cases)), 4))
    for i, (label, value) in enumerate(bars):
        xs = [c + (i - (len(bars) - 1) / 2) * width for c in range(len(cases))]
        ax.bar(xs, [value(case) for case in cases], width, label=label)
    ax.set_xticks(range(len(cases)), [f"{c['shape']}\n{c['prompt_tokens']:,}" for c in cases])
    ax.set_yscale("log")
    ax.set_ylabel("time to first token, s")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reports", nargs="+")
    parser.add_argument("--out", required=True)
    parser.add_argument("--title", default="CachedPrefill on CUDA: one run per case")
    args = parser.parse_args(argv)
    cases = load_cases(args.reports)
    if not cases:
        raise SystemExit("hf_gpu_plot: no case without an error in these reports")
    draw(cases, args.out, args.title)


if __name__ == "__main__":
    main()
