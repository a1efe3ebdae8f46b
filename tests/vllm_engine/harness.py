"""Drive real vLLM engines (tests/vllm_engine/engine_process.py) from the tests, and compare what they return."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from tests.engine_lines import ask

ENGINE_SCRIPT = Path(__file__).with_name("engine_process.py")
ROOT = ENGINE_SCRIPT.parents[2]
# `make test-wheel` (scripts/test_wheel.sh) runs these tests from a copy outside the checkout, with tiercache installed
# from its wheel into this site-packages directory: every engine with the connector must have loaded it from there.
WHEEL_SITE = os.environ.get("TIERCACHE_WHEEL_SITE")

# bf16 logprobs of the same computation are bit-identical on vLLM's CPU engine (issue 14 measured 0.0), and a
# difference in the computation shows as a whole multiple of 2^-8 (the logits are bf16): this bound asks for identical
# logits; the smallest wrong restore measured was 0.04. A yardstick engine therefore runs the same settings as the
# engine it judges (step size included).
LOGPROB_TOLERANCE = 1e-3


@dataclass(frozen=True)
class Completion:
    cached: int  # prompt tokens the engine did not compute (vLLM's own prefix cache plus what the connector loaded)
    tokens: list[int]
    logprobs: list[dict[int, float]]  # top-20 per generated token
    finish: str

    def first(self, count: int) -> "Completion":
        """The completion as it stood after `count` generated tokens (to compare with one that stopped there)."""
        return Completion(self.cached, self.tokens[:count], self.logprobs[:count], self.finish)

    @classmethod
    def from_json(cls, data: dict) -> "Completion":
        return cls(data["cached"], data["tokens"], [{int(k): v for k, v in step.items()} for step in data["logprobs"]],
                   data["finish"])


class EngineProcess:
    """One vLLM engine in a process of its own; `url` None runs vLLM alone (no connector)."""

    def __init__(self, model_dir: str, url: str | None, log_path: Path, timeout_s: float = 30.0,
                 **options) -> None:
        extra = options.pop("connector_extra", {})
        settings = {"model": model_dir, **options}
        if url is not None:
            settings["connector"] = {"url": url, "timeout_s": timeout_s, **extra}
        self.log_path = log_path
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
        self._log = open(log_path, "w")
        self.process = subprocess.Popen([sys.executable, str(ENGINE_SCRIPT), json.dumps(settings)], env=env,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True)
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

    def _generate(self, prompts: list[list[int]], max_tokens: int = 1, stop_token_ids: list[int] | None = None,
                  ignore_eos: bool = True, timeout_s: float = 600, settle: bool = True) -> dict:
        """`settle=False`: return as soon as vLLM's generate does, as a script would before it exits."""
        return self._call({"op": "generate", "prompts": prompts, "max_tokens": max_tokens,
                           "stop_token_ids": stop_token_ids, "ignore_eos": ignore_eos, "settle": settle}, timeout_s)

    def one(self, prompt: list[int], **options) -> Completion:
        return self.generate([prompt], **options)[0]

    def timed(self, prompt: list[int], **options) -> tuple[Completion, float]:
        """One prompt and the seconds vLLM's generate took for it (with max_tokens=1: the time to first token)."""
        answer = self._generate([prompt], **options)
        return Completion.from_json(answer["results"][0]), answer["seconds"]

    def one_from_embeddings(self, seed: int, length: int, max_tokens: int = 1) -> Completion:
        answer = self._call({"op": "generate_embeds", "seed": seed, "length": length, "max_tokens": max_tokens}, 600)
        return Completion.from_json(answer["results"][0])

    def stats(self) -> dict | None:
        return self._call({"op": "stats"}, 60)["connector"]

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.process.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.process.stdin.flush()
                self.process.wait(timeout=60)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.process.kill()
        self._log.close()

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def _call(self, command: dict | None, timeout_s: float) -> dict:
        return ask(self.process, self._lock, command, timeout_s, engine="vLLM", kill=self.process.kill,
                   log_tail=self.log_tail)


def assert_same_computation(got: Completion, reference: Completion, what: str) -> None:
    """Same cached prefix, same tokens, and top-20 logprobs equal to rounding at every generated position."""
    assert got.cached == reference.cached, f"{what}: hit {got.cached} tokens, vLLM's own hit is {reference.cached}"
    assert got.tokens == reference.tokens, f"{what}: generated {got.tokens}, vLLM generated {reference.tokens}"
    for step, (mine, theirs) in enumerate(zip(got.logprobs, reference.logprobs)):
        assert all(math.isfinite(v) for v in mine.values()), f"{what}: non-finite logprobs at output {step}"
        top = sorted(theirs, key=theirs.get, reverse=True)[:5]
        assert all(token in mine for token in top), f"{what}: top-5 tokens {top} of vLLM missing at output {step}"
        worst = max(abs(mine[t] - theirs[t]) for t in set(mine) & set(theirs))
        assert worst <= LOGPROB_TOLERANCE, f"{what}: logprobs differ by {worst:.4f} at output {step}"


def assert_finite(completion: Completion, what: str) -> None:
    for step, logprobs in enumerate(completion.logprobs):
        assert all(math.isfinite(v) for v in logprobs.values()), f"{what}: non-finite logprobs at output {step}"
