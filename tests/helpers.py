"""Real processes for the tests: redis-server and tiercache servers on free ports, awaited for readiness."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from typing import Callable

import redis

REDIS_SERVER = shutil.which("redis-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


class ServerProcess:
    """`tiercache serve` as a real subprocess on a free port, awaited through the gRPC health service."""

    def __init__(self, *args: str, env: dict | None = None) -> None:
        self.port = free_port()
        self.args = ["--port", str(self.port), *args]
        self.env = env or python_env()
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"grpc://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> "ServerProcess":
        import sys

        self.process = subprocess.Popen([sys.executable, "-m", "tiercache", "serve", *self.args], env=self.env,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_for(self.serving, timeout_s, what=f"tiercache serve on port {self.port}")
        return self

    def serving(self) -> bool:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        if self.process.poll() is not None:
            raise RuntimeError(f"tiercache serve exited with {self.process.returncode}: {self.process.stderr.read()}")
        with grpc.insecure_channel(f"127.0.0.1:{self.port}") as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=0.5)
            except grpc.RpcError:
                return False
            return reply.status == health_pb2.HealthCheckResponse.SERVING

    def terminate(self, timeout_s: float = 15.0) -> tuple[int, str]:
        """SIGTERM, wait for a graceful exit; returns (exit code, stderr)."""
        self.process.terminate()
        _, err = self.process.communicate(timeout=timeout_s)
        return self.process.returncode, err

    def kill(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.communicate()
