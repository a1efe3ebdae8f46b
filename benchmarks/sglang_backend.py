"""SGLang alone vs SGLang + its own file backend vs SGLang + tiercache, on SGLang 0.5.23's real engine on the CPU
(testkit/sglang_engine.py, as tests/sglang_engine runs it: its scheduler, radix cache, HiCache controller, storage
prefetch and backup; testkit/sglang_site on PYTHONPATH), with a random-weight dense Qwen3 written here. Time to
first token (TTFT: the first streamed token, measured in the engine's process) and cached tokens (device, host,
storage), per arm, in one run.

Arms (each HiCache with SGLang's host pool, L2, of twice the device pool, write-through, `direct` io backend,
`page_first_direct` layout; `--page-size` tokens a page):
- alone: no storage backend: SGLang's radix cache and host pool only;
- file: SGLang's HiCacheFile (a file per page in a scratch folder, the page cache warm);
- tiercache: TierCacheStorage (v1: pages straight between the host pool and the server) on a local
  `tiercache serve` (host memory tier).

Scenarios:
- shared prefix: documents of `--doc-tokens` each, computed by a writer engine (file, tiercache: the pages go to
  storage; flush_cache waits for the backups); then a fresh engine, a new process, asks a new question (32 tokens)
  about each. SGLang alone computes every document (its fresh engine has nothing); the others read them from
  storage. One request per document: its TTFT is the sample.
- multi-turn chat, in the same fresh engine after flush_cache: `--chats` conversations, round robin, each turn the
  conversation so far + the engine's reply (`--reply` tokens) + a new message; the conversations outgrow the device
  and host pools (`--device-tokens`, twice that in the host pool), so by a conversation's next turn SGLang alone has
  evicted part of it, while the storage arms read it back. Turns 2.. are the samples.
The writers run one after the other; then the arms' fresh engines (three processes) are alive at once and take
turns, one request at a time, so each arm's samples see the same background load.

Ratios are TTFT (p50 and mean) of an arm over SGLang alone's in the same run. The model is tiny (`--layers`,
`--hidden`): a hit saves less compute than on a real model, and moving its pages costs relatively more. On a CPU
without AMX SGLang runs its `torch_native` attention backend, whose extend attends a query padded to the whole
sequence (prefix included): a hit saves the projections and MLP of the cached tokens but not their attention, so
a hit's TTFT here keeps a cost that grows with the prompt, and the ratios understate what a hit saves.

    make install-sglang-engine
    .venv-sglang/bin/python -m benchmarks.sglang_backend [--json out.json] [--smoke]
    make bench-sglang   (the same, JSON in sglang_backend.json)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from lab.common import write_report
from testkit.prompts import prompt
from testkit.sglang_engine import EngineProcess, Timed, engine_settings, start_together
from testkit.sglang_models import TinyModel
from tiercache.process import ServerProcess

ARMS = ("alone", "file", "tiercache")
QUESTION = 32  # tokens of a question about a document


def ms(seconds: float) -> float:
    return round(seconds * 1e3, 2)


def summary(samples: list[tuple[int, Timed]]) -> dict:
    """(prompt tokens, timed request) samples: TTFT p50 and mean, and the tokens SGLang did not compute, by tier."""
    ttft = [t.ttft for _, t in samples]
    timed = [t for _, t in samples]
    return {"requests": len(samples), "ttft_p50_ms": ms(statistics.median(ttft)),
            "ttft_mean_ms": ms(statistics.fmean(ttft)), "prompt_tokens": sum(n for n, _ in samples),
            "cached_tokens": sum(s.cached for s in timed),
            **{f"{tier}_tokens": sum(s.tier(tier) for s in timed) for tier in ("device", "host", "storage")},
            "ttft_ms": [ms(t) for t in ttft], "cached": [t.cached for t in timed],
            "storage": [t.tier("storage") for t in timed], "prompts": [n for n, _ in samples]}


class Workload:
    """The prompts, the same for every arm (seeded). The arms' fresh engines are alive together and take turns, one
    request at a time (alone, file, tiercache, alone, ...): each arm's samples see the same background load, which on
    a shared machine drifts more over a minute than the arms differ."""

    def __init__(self, args) -> None:
        self.args = args
        self.documents = [prompt(1000 + d, args.doc_tokens) for d in range(args.docs)]
        self.writer_questions = [prompt(2000 + d, QUESTION) for d in range(args.docs)]
        self.reader_questions = [prompt(3000 + d, QUESTION) for d in range(args.docs)]

    def write(self, engine: EngineProcess) -> list[tuple[int, Timed]]:
        """The writer engine: every document with a first question; then its backups are in storage."""
        samples = [timed(engine, doc + q) for doc, q in zip(self.documents, self.writer_questions)]
        engine.flush(timeout_s=300)
        return samples

    def shared_prefix(self, readers: dict[str, EngineProcess]) -> dict[str, list[tuple[int, Timed]]]:
        samples: dict[str, list] = {arm: [] for arm in readers}
        for doc, question in zip(self.documents, self.reader_questions):
            for arm, reader in readers.items():
                samples[arm].append(timed(reader, doc + question))
        return samples

    def chat(self, readers: dict[str, EngineProcess]) -> dict[str, list[tuple[int, Timed]]]:
        """Round-robin turns of `--chats` conversations; the samples are turns 2.. (turn 1 is cold everywhere)."""
        args = self.args
        for reader in readers.values():
            reader.flush(timeout_s=300)  # the chat starts with empty device and host pools in every arm
        history = {arm: [prompt(4000 + c, args.first_message) for c in range(args.chats)] for arm in readers}
        samples: dict[str, list] = {arm: [] for arm in readers}
        for turn in range(args.turns):
            for c in range(args.chats):
                for arm, reader in readers.items():
                    length, reply = timed(reader, history[arm][c], args.reply)
                    if turn:
                        samples[arm].append((length, reply))
                    history[arm][c] = history[arm][c] + reply.tokens + prompt(5000 + 100 * c + turn, args.message)
        return samples


def timed(engine: EngineProcess, tokens: list[int], max_new_tokens: int = 1) -> tuple[int, Timed]:
    return len(tokens), engine.timed(tokens, max_new_tokens=max_new_tokens)


def arm_settings(arm: str, model: str, args, scratch: Path, server_url: str | None) -> dict:
    common = dict(page_size=args.page_size, max_total_tokens=args.device_tokens,
                  chunked_prefill_size=args.device_tokens, max_running_requests=1)
    if arm == "alone":
        return engine_settings(model, storage="host", **common)
    if arm == "file":
        return engine_settings(model, storage="file", file_dir=str(scratch / "hicache-file"), **common)
    return engine_settings(model, storage="tiercache", url=server_url, extra={"interface_v1": 1}, **common)


def run(arms: list[str], model: str, workload: Workload, args, scratch: Path, server_url: str | None) -> dict:
    """Writers one after the other (their TTFT: a cold computation plus its backups), then every arm's fresh reader
    at once, taking turns."""
    settings = {arm: arm_settings(arm, model, args, scratch, server_url) for arm in arms}
    results: dict[str, dict] = {arm: {} for arm in arms}
    for arm in arms:
        if arm != "alone":
            writer = EngineProcess(settings[arm], scratch / f"{arm}-writer.log")
            try:
                warm_up(writer)
                results[arm]["writer"] = summary(workload.write(writer))
            finally:
                writer.close()
    readers = dict(zip(arms, start_together(*[(settings[arm], scratch / f"{arm}-reader.log") for arm in arms])))
    try:
        for reader in readers.values():
            warm_up(reader)
        for scenario, samples in (("shared_prefix", workload.shared_prefix(readers)),
                                  ("chat", workload.chat(readers))):
            for arm in arms:
                results[arm][scenario] = summary(samples[arm])
    finally:
        for reader in readers.values():
            reader.close()
    return results


def warm_up(engine: EngineProcess) -> None:
    """An engine's first request pays for lazy initialisation: not a sample."""
    engine.timed(prompt(9, 40))


def ratios(report: dict) -> dict:
    alone = report["arms"].get("alone")
    if alone is None:
        return {}
    out = {}
    for arm, result in report["arms"].items():
        if arm == "alone":
            continue
        out[arm] = {f"{scenario}_{stat}": round(result[scenario][f"ttft_{stat}_ms"] /
                                                alone[scenario][f"ttft_{stat}_ms"], 3)
                    for scenario in ("shared_prefix", "chat") for stat in ("p50", "mean")}
    return out


def print_table(report: dict) -> None:
    s = report["settings"]
    print(f"dense Qwen3, {s['layers']} layers, hidden {s['hidden']}, page {s['page_size']} tokens; "
          f"device pool {s['device_tokens']} tokens, host pool twice that")
    print(f"shared prefix: {s['docs']} documents of {s['doc_tokens']} tokens + a {QUESTION}-token question, "
          f"read by a fresh engine; chat: {s['chats']} conversations x {s['turns']} turns "
          f"({s['first_message']}-token first message, {s['message']}-token messages, {s['reply']}-token replies)")
    header = f"{'arm':<10}{'scenario':<15}{'TTFT p50 ms':>12}{'mean ms':>10}{'x alone p50':>12}{'x mean':>8}" \
             f"{'cached':>9}{'device':>8}{'host':>8}{'storage':>9}"
    print(header)
    for arm, result in report["arms"].items():
        for scenario in ("writer", "shared_prefix", "chat"):
            if scenario not in result:
                continue
            r = result[scenario]
            ratio = report["ratios"].get(arm, {})
            p50 = ratio.get(f"{scenario}_p50")
            mean = ratio.get(f"{scenario}_mean")
            print(f"{arm:<10}{scenario:<15}{r['ttft_p50_ms']:>12.1f}{r['ttft_mean_ms']:>10.1f}"
                  f"{'' if p50 is None else f'{p50:.2f}':>12}{'' if mean is None else f'{mean:.2f}':>8}"
                  f"{r['cached_tokens']:>9}{r['device_tokens']:>8}{r['host_tokens']:>8}{r['storage_tokens']:>9}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated, of " + ", ".join(ARMS))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--device-tokens", type=int, default=4096, help="SGLang's device pool (max_total_tokens)")
    parser.add_argument("--docs", type=int, default=5)
    parser.add_argument("--doc-tokens", type=int, default=3000)
    parser.add_argument("--chats", type=int, default=6)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--first-message", type=int, default=1200)
    parser.add_argument("--message", type=int, default=200)
    parser.add_argument("--reply", type=int, default=8)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: checks that every arm runs")
    parser.add_argument("--json", metavar="PATH", help="write the report here")
    parser.add_argument("--logs", metavar="DIR", help="keep the engines' logs here (default: a scratch folder)")
    args = parser.parse_args()
    if args.smoke:
        args.layers, args.hidden, args.device_tokens = 2, 256, 1024
        args.docs, args.doc_tokens, args.chats, args.turns, args.first_message, args.message, args.reply = \
            2, 200, 2, 2, 100, 40, 2
    arms = [a for a in args.arms.split(",") if a]
    unknown = set(arms) - set(ARMS)
    if unknown:
        parser.error(f"unknown arms {sorted(unknown)}")

    started = time.monotonic()
    workload = Workload(args)
    with tempfile.TemporaryDirectory(prefix="sglang-bench-") as scratch_name:
        scratch = Path(args.logs or scratch_name)
        scratch.mkdir(parents=True, exist_ok=True)
        model = TinyModel(f"qwen3-bench-{args.layers}l-{args.hidden}", "dense", layers=args.layers,
                          hidden=args.hidden).write(Path(scratch_name))
        report = {"settings": {k: v for k, v in vars(args).items() if k not in ("json", "logs", "arms")},
                  "arms": {}}
        server = ServerProcess("--host-mem", "2GiB", "--disk-size", "0").start() if "tiercache" in arms else None
        try:
            report["arms"] = run(arms, model, workload, args, scratch, server.url if server else None)
        finally:
            if server is not None:
                server.kill()
    report["ratios"] = ratios(report)
    report["seconds"] = round(time.monotonic() - started, 1)
    if args.json:
        write_report(report, args.json)
    print_table(report)
    print(f"({report['seconds']} s)")


if __name__ == "__main__":
    main()
