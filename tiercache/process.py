"""`tiercache serve` as a real child process on a free loopback port, awaited for readiness through the gRPC health
service (never a fixed sleep). Used by `tiercache bench`, `tiercache demo`, the benchmarks and the tests (their
redis-server and Redis Cluster processes are in testkit/redis_processes.py, not in the package).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`tiercache serve *args` on a free port. Without --disk-dir (or a --config naming one) its disk tier lives in
    a scratch folder of its own, removed when the process is killed or terminated: benchmarks and tests leave no
    gigabytes behind, and never share the default ~/.cache/tiercache (`scratch_disk=False`: the server's default).
    `port`: a given gRPC port instead of a free one (a server restarted where its clients already point)."""

    def __init__(self, *args: str, env: dict | None = None, scratch_disk: bool = True,
                 port: int | None = None) -> None:
        self.port = port if port is not None else free_port()
        self.args = ["--port", str(self.port), *args]
        self._scratch: str | None = None
        named = any(a == flag or a.startswith(flag + "=") for a in args for flag in ("--disk-dir", "--config"))
        if scratch_disk and not named:
            self._scratch = tempfile.mkdtemp(prefix="tiercache-serve-")
            self.args += ["--disk-dir", self._scratch]
        self.env = env if env is not None else {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.process: subprocess.Popen | None = None
        # The server's output goes to a file, not a pipe: a pipe nobody reads fills up (64 KiB) and then blocks the
        # server in its next log line. Opened for appending: the server shares the file's offset, which reading it
        # here moves back to the start, and a line it wrote then would overwrite the first ones.
        self._output = tempfile.TemporaryFile("a+", prefix="tiercache-serve-", suffix=".log")

    @property
    def url(self) -> str:
        return f"grpc://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> "ServerProcess":
        self.process = subprocess.Popen([sys.executable, "-m", "tiercache", "serve", *self.args], env=self.env,
                                        stdout=self._output, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + timeout_s
        try:
            while not self.serving():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"tiercache serve did not become ready on port {self.port} in {timeout_s}s")
                time.sleep(0.02)
        except BaseException:
            self.kill()  # and its scratch folder
            raise
        return self

    def serving(self) -> bool:
        if self.process.poll() is not None:
            raise RuntimeError(f"tiercache serve exited with {self.process.returncode}: {self.output()}")
        with grpc.insecure_channel(f"127.0.0.1:{self.port}") as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=0.5)
            except grpc.RpcError:
                return False
            return reply.status == health_pb2.HealthCheckResponse.SERVING

    def output(self) -> str:
        """What the server has printed so far (its log)."""
        self._output.seek(0)
        return self._output.read()

    def wait(self, timeout_s: float = 15.0) -> tuple[int, str]:
        """Wait for the server to exit; returns (exit code, its output)."""
        self.process.wait(timeout=timeout_s)
        self._remove_scratch()
        return self.process.returncode, self.output()

    def terminate(self, timeout_s: float = 15.0) -> tuple[int, str]:
        """SIGTERM, wait for a graceful exit; returns (exit code, its output)."""
        self.process.terminate()
        return self.wait(timeout_s)

    def stop(self, grace_s: float = 15.0) -> None:
        """Stop the server the way that cleans up (SIGTERM: it unlinks its /dev/shm arena and closes its tiers), or
        kill it if it has not exited after `grace_s`. `kill` is for a crash."""
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def kill(self) -> None:
        """SIGKILL, as a crash or the OOM killer would; what the server would have cleaned up (its scratch disk
        folder, its host arena in /dev/shm) is removed here once the process is gone."""
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        if self.process:
            from tiercache.tiers.host import remove_arenas_of  # here: engine processes import this module too

            remove_arenas_of(self.process.pid)
        self._remove_scratch()

    def _remove_scratch(self) -> None:
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
