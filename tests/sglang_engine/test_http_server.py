"""SGLang's HTTP server (`python -m sglang.launch_server`, SGLang 0.5.23's CPU engine with testkit/sglang_site on
PYTHONPATH) with TierCacheStorage configured as a user would: `--hicache-storage-backend dynamic` and the backend's JSON
in `--hicache-storage-backend-extra-config`. A prompt computed, SGLang's own hit on it, `/flush_cache` (it waits for the
backups, then empties the device and host caches), and the prompt again: read from a real `tiercache serve`, with
SGLang's own hit's logprobs, bit for bit. The launch path's own parts run: argument parsing and resolution, the server's
warmup request, the tokenizer manager behind FastAPI, `/generate` with input ids and `/flush_cache`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path


from testkit.prompts import prompt
from testkit.sglang_engine import engine_env, engine_settings
from testkit.sglang_models import DENSE
from tests.sglang_engine.gates import OUTPUT_TOKENS
from tests.sglang_engine.stored import server_pages, wait_until
from tiercache.process import free_port

PAGE = 16
LENGTH = 200
HIT = LENGTH // PAGE * PAGE
TOKENS = prompt(31, LENGTH)


def command_line(settings: dict) -> list[str]:
    """sglang.Engine's keyword arguments as launch_server's flags (True: a bare flag)."""
    flags = []
    for name, value in settings.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is not False and value is not None:
            flags += [flag, str(value)]
    return flags


class HttpServer:
    """`python -m sglang.launch_server` in a process group of its own (its scheduler and detokenizer included)."""

    def __init__(self, settings: dict, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(log_path, "w")
        self.log_path = log_path
        self.process = subprocess.Popen(
            [sys.executable, "-m", "sglang.launch_server", "--host", "127.0.0.1", "--port", str(self.port),
             *command_line(settings)], env=engine_env(), stdout=self._log, stderr=subprocess.STDOUT,
            start_new_session=True)

    def ready(self) -> bool:
        """/health answers 200 once the server is up (after its own warmup request)."""
        if self.process.poll() is not None:
            raise RuntimeError(f"launch_server exited with {self.process.returncode}:\n{self.log_tail()}")
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as reply:
                return reply.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def post(self, path: str, body: dict | None = None, timeout_s: float = 300) -> bytes:
        request = urllib.request.Request(self.url + path, data=json.dumps(body or {}).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            return reply.read()

    def generate(self, tokens: list[int]) -> dict:
        """meta_info of a greedy request: OUTPUT_TOKENS tokens, their top-20 logprobs, and the prompt's logprobs from
        HIT."""
        return json.loads(self.post("/generate", {
            "input_ids": tokens, "return_logprob": True, "logprob_start_len": HIT, "top_logprobs_num": 20,
            "sampling_params": {"max_new_tokens": OUTPUT_TOKENS, "temperature": 0, "ignore_eos": True}}))["meta_info"]

    def flush(self) -> None:
        """SGLang's /flush_cache, waiting (up to its timeout) for the scheduler to be idle: backups done."""
        self.post("/flush_cache?timeout=60", timeout_s=90)

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def close(self) -> None:
        try:
            os.killpg(self.process.pid, 15)
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, 9)
            self.process.wait()
        except ProcessLookupError:
            pass
        self._log.close()


def computation(meta: dict) -> tuple:
    """What a hit must reproduce bit for bit, the outputs gate over HTTP (gates.py; the engine's bytes are read through
    sglang.Engine, which this test does not run): every token and logprob returned."""
    return (meta["output_token_logprobs"], meta["output_top_logprobs"], meta["input_token_logprobs"])


def test_launch_server_reads_a_prompt_back_from_tiercache_after_flush_cache(server, models_dir, logs):
    model = DENSE.write(models_dir)
    settings = engine_settings(model, page_size=PAGE, storage="tiercache", url=server.url,
                               extra={"interface_v1": 1})
    http = HttpServer(settings, logs / "http-server.log")
    try:
        wait_until(http.ready, "SGLang's HTTP server to answer /health", timeout_s=300)
        cold = http.generate(TOKENS)
        own = http.generate(TOKENS)
        assert own["cached_tokens"] == HIT and own["cached_tokens_details"]["device"] == HIT, own
        http.flush()
        assert server_pages(server.url, Path(model).name) >= HIT // PAGE  # the warmup's pages, if any, besides
        got = http.generate(TOKENS)
    finally:
        http.close()
    assert cold["cached_tokens"] == 0
    details = got["cached_tokens_details"]
    assert (details["storage"], details["storage_backend"]) == (HIT, "TierCacheStorage"), details
    assert computation(got) == computation(own) == computation(cold)
