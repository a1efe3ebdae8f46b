"""One real SGLang engine (`sglang.Engine`, SGLang 0.5.23's CPU engine) in a process of its own, driven by
testkit/sglang_engine.py. SGLang's scheduler and detokenizer run in processes it spawns; what SGLang needs on this CPU
(testkit/sglang_site/sitecustomize.py) is on PYTHONPATH, so it loads at the start of every one of them.

Protocol: one JSON object per line on stdin, one answer per line on stdout ({"ready": true} first). Commands:
  {"op": "generate", "prompt": [ids], "max_new_tokens": n, "logprob_start_len": k (-1: output logprobs only),
   "engine_bytes": bool}
      -> {"cached": n, "details": {...} | null, "tokens": [..], "output": [[logprob, id], ..],
          "top": [{id: logprob}, ..], "input": [[logprob, id], ..], "seconds": s, "engine_bytes": {...} | null}:
         with "engine_bytes", the request's KV pages and Mamba state as SGLang's device pools held them
         (sglang_site/probe.py: the request gets a rid it records, read back through a Scheduler RPC)
  {"op": "plant", "fault": name} -> {}: a fault (sglang_site/faults.py) for the engine's next load of its kind
  {"op": "fired"} -> {"fired": [names]}: the faults that fired since the last "fired" (any still planted is removed)
  {"op": "timed", "prompt": [ids], "max_new_tokens": n}
      -> {"cached": n, "details": {...} | null, "tokens": [..], "ttft": s, "seconds": s}: the request streamed,
         "ttft" the time until its first chunk (the first token), "seconds" until its last, both measured here
  {"op": "flush", "timeout_s": t}
      -> {"success": bool}: SGLang's flush_cache with a timeout: it waits until the scheduler is fully idle (no
         write-through, load-back, prefetch or storage backup in flight), then drops the device and host caches.
         After it, everything the engine backed up is in storage, and the engine reads its next prompt from there.
  {"op": "exit"}
Everything SGLang prints goes to stderr.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import tempfile
import time

TOP_LOGPROBS = 20
PROBED = "probe-"  # sglang_site/probe.py records the requests whose rid starts so
_probed = itertools.count()


def rpc(engine, method: str, **parameters) -> None:
    """A harness method on SGLang's scheduler (sglang_site/probe.py, faults.py), through Engine.collective_rpc."""
    try:
        engine.collective_rpc(method, **parameters)
    except AssertionError as exc:  # collective_rpc asserts the RPC's success; its message is the scheduler's error
        raise RuntimeError(f"scheduler RPC {method} failed: {exc}") from None


def scheduler_answer(engine, method: str, **parameters):
    """rpc() to a method that writes its answer as JSON to the file `path` names."""
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "answer.json")
        rpc(engine, method, path=path, **parameters)
        with open(path) as answer:
            return json.load(answer)


def generate(engine, command: dict) -> dict:
    logprob_start_len = command.get("logprob_start_len", -1)
    rid = f"{PROBED}{os.getpid()}-{next(_probed)}" if command.get("engine_bytes") else None
    started = time.perf_counter()
    out = engine.generate(input_ids=command["prompt"], rid=rid,
                          sampling_params={"max_new_tokens": command.get("max_new_tokens", 1), "temperature": 0,
                                           "ignore_eos": True},
                          return_logprob=True, logprob_start_len=logprob_start_len, top_logprobs_num=TOP_LOGPROBS)
    seconds = time.perf_counter() - started
    meta = out["meta_info"]
    return {"cached": meta["cached_tokens"], "details": meta.get("cached_tokens_details"),
            "tokens": [token for _, token, _ in meta["output_token_logprobs"]],
            "output": [[logprob, token] for logprob, token, _ in meta["output_token_logprobs"]],
            "top": [{str(token): logprob for logprob, token, _ in step} for step in meta["output_top_logprobs"]],
            "input": [[logprob, token] for logprob, token, _ in meta.get("input_token_logprobs") or []],
            "seconds": seconds,
            "engine_bytes": scheduler_answer(engine, "harness_probe", rid=rid) if rid is not None else None}


def timed(engine, command: dict) -> dict:
    """A greedy request streamed: the time to its first token (TTFT) and to its end, in the engine's process."""
    started = time.perf_counter()
    first = None
    chunk = None
    for chunk in engine.generate(input_ids=command["prompt"], stream=True,
                                 sampling_params={"max_new_tokens": command.get("max_new_tokens", 1),
                                                  "temperature": 0, "ignore_eos": True}):
        if first is None:
            first = time.perf_counter() - started
    seconds = time.perf_counter() - started
    meta = chunk["meta_info"]
    return {"cached": meta["cached_tokens"], "details": meta.get("cached_tokens_details"),
            "tokens": list(chunk["output_ids"]), "ttft": first, "seconds": seconds}


def run(engine, command: dict) -> dict:
    if command["op"] == "generate":
        return generate(engine, command)
    if command["op"] == "timed":
        return timed(engine, command)
    if command["op"] == "plant":
        rpc(engine, "harness_plant", fault=command["fault"])
        return {}
    if command["op"] == "fired":
        return {"fired": scheduler_answer(engine, "harness_fired")}
    if command["op"] == "flush":
        result = engine.loop.run_until_complete(engine.tokenizer_manager.flush_cache(
            timeout_s=command.get("timeout_s", 60)))
        return {"success": bool(result.success)}
    return {"error": f"unknown op {command['op']}"}


def main() -> None:
    settings = json.loads(sys.argv[1])
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    import sglang

    engine = sglang.Engine(**settings)
    reply.write(json.dumps({"ready": True}) + "\n")
    reply.flush()
    try:
        for line in sys.stdin:
            command = json.loads(line)
            if command["op"] == "exit":
                break
            try:
                answer = run(engine, command)
            except RuntimeError as exc:  # a failed scheduler RPC: the test sees it, the engine keeps running
                answer = {"error": str(exc)}
            reply.write(json.dumps(answer) + "\n")
            reply.flush()
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
