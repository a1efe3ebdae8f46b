"""The line protocol the real-engine drivers speak with their engine processes (testkit/vllm_engine.py,
tests/sglang_engine): one JSON command per line on the process's stdin, one JSON answer per line on its stdout."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from typing import Callable


def ask(process: subprocess.Popen, lock: threading.Lock, command: dict | None, timeout_s: float, *, engine: str,
        kill: Callable[[], None], log_tail: Callable[[], str]) -> dict:
    """Send `command` (None: nothing, read the line the engine writes once it has started) and return the answer.
    An engine that does not answer within `timeout_s` (hung, or dead) is killed with `kill` and the test fails with
    the end of its log."""
    with lock:
        if command is not None:
            process.stdin.write(json.dumps(command) + "\n")
            process.stdin.flush()
        result: list[str] = []
        reader = threading.Thread(target=lambda: result.append(process.stdout.readline()), daemon=True)
        reader.start()
        deadline = time.monotonic() + timeout_s
        while reader.is_alive() and time.monotonic() < deadline and process.poll() is None:
            reader.join(0.2)
        if not result or not result[0]:
            kill()
            raise RuntimeError(f"the {engine} engine did not answer in {timeout_s}s (exit {process.poll()}):\n"
                               f"{log_tail()}")
        return json.loads(result[0])


def ask_to_exit(process: subprocess.Popen, kill: Callable[[], None], timeout_s: float = 60) -> None:
    """Send the exit command and wait for the process to end; one that does not (hung, or its pipe gone) is killed
    with `kill`. An engine that exits cleanly removes what it holds (vLLM unlinks its offloading pool file)."""
    if process.poll() is not None:
        return
    try:
        process.stdin.write(json.dumps({"op": "exit"}) + "\n")
        process.stdin.flush()
        process.wait(timeout=timeout_s)
    except (BrokenPipeError, subprocess.TimeoutExpired):
        kill()
