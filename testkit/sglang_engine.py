"""Real SGLang engines (SGLang 0.5.23's CPU engine), each in a process of its own (testkit/sglang_engine_process.py),
driven from the tests and the lab (benchmarks/sglang_backend.py): their settings (HiCache with a storage backend:
tiercache's or SGLang's own file backend) and what they return. Every engine process, and every process SGLang spawns
from it, has testkit/sglang_site on PYTHONPATH: what SGLang needs to run on this CPU, loaded at interpreter start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from testkit.engine_lines import ask, ask_to_exit

HERE = Path(__file__).parent
SITE = HERE / "sglang_site"  # sitecustomize.py + the sgl_kernel stand-in: on PYTHONPATH of every engine process
ENGINE_SCRIPT = HERE / "sglang_engine_process.py"
ROOT = HERE.parent

TIERCACHE_BACKEND = {"backend_name": "tiercache", "module_path": "tiercache.connector.sglang",
                     "class_name": "TierCacheStorage"}
# SGLang prefetches from storage only a hit of at least this many tokens (its default, 256, is above these prompts).
PREFETCH_THRESHOLD = 16


@dataclass(frozen=True)
class Completion:
    cached: int  # prompt tokens SGLang did not compute (device, host and storage hits)
    details: dict | None  # SGLang's cached_tokens_details: {"device", "host", "storage", "storage_backend"}
    tokens: list[int]
    output: list[list]  # [logprob, token id] per generated token
    top: list[dict[str, float]]  # top-20 logprobs per generated token
    input: list[list]  # [logprob, token id] per prompt token from logprob_start_len (None for the first)
    seconds: float
    # when asked for: hashes of the request's KV pages and Mamba state in SGLang's device pools
    # (sglang_site/probe.py), which the byte gate compares (tests/sglang_engine/gates.py)
    engine_bytes: dict | None = None

    @property
    def storage(self) -> int:
        return int((self.details or {}).get("storage") or 0)

    @property
    def storage_backend(self) -> str | None:
        return (self.details or {}).get("storage_backend")


@dataclass(frozen=True)
class Timed:
    cached: int
    details: dict | None  # SGLang's cached_tokens_details: {"device", "host", "storage", "storage_backend"}
    tokens: list[int]
    ttft: float  # seconds to the first streamed token, measured in the engine's process
    seconds: float  # to the request's end

    def tier(self, name: str) -> int:
        return int((self.details or {}).get(name) or 0)


def engine_settings(model_dir: str, *, page_size: int, storage: str | None = None, url: str | None = None,
                    file_dir: str | None = None, hybrid: bool = False, extra: dict | None = None,
                    **overrides) -> dict:
    """sglang.Engine arguments for SGLang's CPU engine on a tiny model; `storage`: None (no HiCache), "tiercache"
    (TierCacheStorage on the server at `url`), "file" (SGLang's HiCacheFile in `file_dir`) or "host" (HiCache's
    host pool, L2, and no storage backend: SGLang alone)."""
    settings = dict(model_path=model_dir, device="cpu", dtype="bfloat16", log_level="warning", random_seed=0,
                    page_size=page_size, max_total_tokens=4096, chunked_prefill_size=1024,
                    # On the CPU SGLang checks that the memory free after loading the weights is above
                    # (1 - mem_fraction_static) of what was free before: other processes' allocations meanwhile count
                    # against it. The pools are sized by max_total_tokens (and max_mamba_cache_size), not by this.
                    mem_fraction_static=0.5,
                    max_running_requests=2, disable_cuda_graph=True, watchdog_timeout=600,
                    # An idle scheduler otherwise polls its sockets in a busy loop, a core each: with two or three
                    # engines alive on 2 cores they starved the one working. Asleep, it waits on the sockets
                    # (a request wakes it at once); not while a request waits for a prefetch (not idle then).
                    sleep_on_idle=True)
    if hybrid:
        # SGLang refuses the extra_buffer strategy on the CPU: states are cached at a request's end (no_buffer),
        # which SGLang runs without its overlap scheduler only; 16 state slots are plenty here (default: thousands).
        settings.update(mamba_radix_cache_strategy="no_buffer", disable_overlap_schedule=True,
                        max_mamba_cache_size=16)
    if storage is not None:
        settings.update(enable_hierarchical_cache=True, hicache_ratio=2.0, hicache_io_backend="direct",
                        hicache_mem_layout="page_first_direct", hicache_write_policy="write_through")
    if storage is not None and storage != "host":
        if storage == "tiercache":
            config = {**TIERCACHE_BACKEND, "url": url, "timeout_s": 30}
            backend = "dynamic"
        elif storage == "file":
            config = {"file_storage_path": file_dir}
            backend = "file"
        else:
            raise ValueError(storage)
        config = {**config, "prefetch_threshold": PREFETCH_THRESHOLD, **(extra or {})}
        settings.update(hicache_storage_prefetch_policy="wait_complete", hicache_storage_backend=backend,
                        hicache_storage_backend_extra_config=json.dumps(config))
    settings.update(overrides)
    return settings


def engine_env() -> dict:
    """The environment of an SGLang process (an engine's, or `python -m sglang.launch_server`): this checkout's
    tiercache and testkit/sglang_site on PYTHONPATH, SGLang's CPU engine; in a test session, a temp dir in its home."""
    pythonpath = os.pathsep.join([str(SITE), str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": pythonpath, "SGLANG_USE_CPU_ENGINE": "1"}
    home = os.environ.get("TIERCACHE_TEST_HOME")  # a test session's (testkit/pytest_session.py)
    if home:
        # SGLang names its ZeroMQ sockets by temp files it never removes: in a test, under the session's home.
        env["TMPDIR"] = os.path.join(home, "sglang-tmp")
        os.makedirs(env["TMPDIR"], exist_ok=True)
    return env


class EngineProcess:
    """One SGLang engine (sglang.Engine) in a process of its own, with testkit/sglang_site loaded at every
    interpreter start (PYTHONPATH), SGLang's spawned scheduler included."""

    def __init__(self, settings: dict, log_path: Path, start_timeout_s: float = 300.0, wait: bool = True) -> None:
        """`wait=False`: return once the process is started; `ready()` waits for the engine (start_together)."""
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.process = subprocess.Popen([sys.executable, str(ENGINE_SCRIPT), json.dumps(settings)], env=engine_env(),
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
                                        start_new_session=True)
        self._lock = threading.Lock()
        self._start_timeout_s = start_timeout_s
        if wait:
            self.ready()

    def ready(self) -> "EngineProcess":
        """Wait for the engine's {"ready": true} (it has loaded the model and started its scheduler)."""
        self._call(None, self._start_timeout_s)
        return self

    def generate(self, prompt: list[int], max_new_tokens: int = 4, logprob_start_len: int = -1,
                 engine_bytes: bool = False, timeout_s: float = 300) -> Completion:
        """A greedy request; `engine_bytes`: with the hashes of its KV pages and Mamba state as SGLang's device pools
        held them at its end (sglang_site/probe.py)."""
        answer = self._call({"op": "generate", "prompt": prompt, "max_new_tokens": max_new_tokens,
                             "logprob_start_len": logprob_start_len, "engine_bytes": engine_bytes}, timeout_s)
        return Completion(**answer)

    def plant(self, fault: str) -> None:
        """A fault (sglang_site/faults.py) for the engine's next load of its kind from storage; it fires once."""
        self._call({"op": "plant", "fault": fault}, 60)

    def fired(self) -> list[str]:
        """The faults that fired since the last call (a fault still planted is removed)."""
        return self._call({"op": "fired"}, 60)["fired"]

    def timed(self, prompt: list[int], max_new_tokens: int = 1, timeout_s: float = 300) -> "Timed":
        """A greedy request streamed: its time to first token and its cached tokens (benchmarks)."""
        return Timed(**self._call({"op": "timed", "prompt": prompt, "max_new_tokens": max_new_tokens}, timeout_s))

    def flush(self, timeout_s: float = 60) -> None:
        """SGLang's flush_cache once the engine is idle: every backup it started is in storage when this returns,
        and its device and host caches are empty (its next prompt is read from storage)."""
        answer = self._call({"op": "flush", "timeout_s": timeout_s}, timeout_s + 30)
        assert answer["success"], f"SGLang's flush_cache did not succeed in {timeout_s}s:\n{self.log_tail()}"

    def close(self) -> None:
        ask_to_exit(self.process, self._kill_group)
        self._kill_group()  # SGLang's scheduler and detokenizer, should one outlive the engine's process
        self._log.close()

    def _kill_group(self) -> None:
        try:
            os.killpg(self.process.pid, 9)
        except (ProcessLookupError, PermissionError):
            pass
        self.process.wait()

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def _call(self, command: dict | None, timeout_s: float) -> dict:
        answer = ask(self.process, self._lock, command, timeout_s, engine="SGLang", kill=self._kill_group,
                     log_tail=self.log_tail)
        if "error" in answer:
            raise RuntimeError(answer["error"])
        return answer


def start_together(*engines: tuple[dict, Path]) -> list[EngineProcess]:
    """Engines (settings, log path) started at once: most of a start is importing SGLang in two processes, which
    overlaps well with another engine's."""
    started = [EngineProcess(settings, log, wait=False) for settings, log in engines]
    try:
        return [engine.ready() for engine in started]
    except BaseException:
        for engine in started:
            engine.close()
        raise
