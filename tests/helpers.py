"""Real processes for the tests: redis-server and tiercache servers on free ports, awaited for readiness."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from typing import Callable

import redis

from tiercache.process import ServerProcess, free_port

__all__ = ["RedisProcess", "ServerProcess", "free_port", "python_env", "wait_for"]

REDIS_SERVER = shutil.which("redis-server")


def wait_for(condition: Callable[[], bool], timeout_s: float = 10.0, what: str = "condition") -> None:
    """Poll until `condition()` is true; fail after timeout_s. The poll interval is short: this is not a sleep."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.01)


class RedisProcess:
    """A real redis-server on a free loopback port, in its own temp dir, with persistence off."""

    def __init__(self, *extra_args: str) -> None:
        if REDIS_SERVER is None:
            raise RuntimeError("redis-server is not installed: run scripts/install.sh")
        self.port = free_port()
        self.extra_args = extra_args
        self.dir = tempfile.mkdtemp(prefix="tiercache-redis-")
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisProcess":
        self.process = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.dir, *self.extra_args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(self.ready, what=f"redis-server on port {self.port}")
        return self

    def ready(self) -> bool:
        if self.process is not None and self.process.poll() is not None:
            raise RuntimeError(f"redis-server exited with {self.process.returncode}")
        try:
            return redis.Redis(port=self.port, socket_timeout=0.5).ping()
        except redis.ConnectionError:
            return False

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def stop(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port)


def python_env() -> dict:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    return env

