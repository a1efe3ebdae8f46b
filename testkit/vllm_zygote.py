"""vLLM engines forked from one process that imported vLLM once (testkit/vllm_zygote_process.py), for a test session
that starts dozens of engines: each engine process started from scratch spends about 13 s of one core importing vLLM
before its engine starts.

`forking(env)` starts that process for the session (tests/vllm_engine/conftest.py); while it runs, `spawn` forks an
engine whose environment is exactly the one the process was started with, and starts any other (a CPU stood in for
one engine, a test's own variables) as a process of its own. A forked engine is the same program as one started from
scratch (testkit/vllm_engine_process.py's main, its stdin, stdout and stderr, its environment, its exit through the
interpreter's); tests/vllm_engine/test_forked_engines.py holds its answers `==` to those of an engine started from
scratch."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Iterator

ZYGOTE_SCRIPT = Path(__file__).with_name("vllm_zygote_process.py")
ENGINE_SCRIPT = Path(__file__).with_name("vllm_engine_process.py")


class ForkedProcess:
    """An engine forked by the zygote, with what the tests use of a `subprocess.Popen`: it is not this process's
    child, so it is followed through a pidfd, and its exit status comes from the zygote, which reaps it."""

    def __init__(self, pid: int, stdin: IO[str], stdout: IO[str], exits: Path) -> None:
        self.pid, self.stdin, self.stdout = pid, stdin, stdout
        self._pidfd = os.pidfd_open(pid)
        self._exit_file = exits / str(pid)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._pidfd], [], [], 0)[0]:
            self.returncode = self._exit_status()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._pidfd], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(str(ENGINE_SCRIPT), timeout)
            self.returncode = self._exit_status()
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)

    def _exit_status(self, timeout_s: float = 5) -> int:
        """The status the zygote recorded when it reaped the engine (-1 if it has not within `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while not self._exit_file.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        status = int(self._exit_file.read_text()) if self._exit_file.exists() else -1
        os.close(self._pidfd)
        return status


class Zygote:
    """The forking process of one test session (or pytest-xdist worker)."""

    def __init__(self, env: dict, log_path: Path, timeout_s: float = 180) -> None:
        self.env = env
        self._dir = Path(tempfile.mkdtemp(prefix="tiercache-zygote-"))  # short: a Unix socket path has 107 bytes
        self._exits = self._dir / "exits"
        self._exits.mkdir()
        self._socket = str(self._dir / "socket")
        self._log = open(log_path, "w")  # noqa: SIM115 (for the zygote's life)
        self.process = subprocess.Popen([sys.executable, str(ZYGOTE_SCRIPT), self._socket, str(self._exits)],
                                        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                        text=True)
        ready, _, _ = select.select([self.process.stdout], [], [], timeout_s)
        line = self.process.stdout.readline() if ready else ""
        if not line or not json.loads(line).get("ready"):
            self.close()
            raise RuntimeError(f"the engine zygote did not start in {timeout_s}s:\n{log_path.read_text()[-3000:]}")
        self.set_at_import: dict[str, str] = json.loads(line)["set_at_import"]

    def differences(self, env: dict) -> list[str]:
        """The variables by which an engine's environment differs from the one the zygote imported vLLM in, but
        those it makes no difference to fork with: set by pytest as the test process runs (_SET_AT_RUN_TIME),
        or by importing vLLM (in the test process too, once a test imports it) to what the zygote's import set."""
        return sorted(k for k in set(env) | set(self.env) if env.get(k) != self.env.get(k)
                      and k not in _SET_AT_RUN_TIME and self.set_at_import.get(k) != env.get(k))

    def fork(self, argv: list[str], env: dict, stderr: IO) -> ForkedProcess:
        child_stdin, to_child = os.pipe()
        from_child, child_stdout = os.pipe()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
                connection.connect(self._socket)
                request = json.dumps({"argv": argv, "env": env}).encode() + b"\n"
                socket.send_fds(connection, [request], [child_stdin, child_stdout, stderr.fileno()])
                with connection.makefile() as answers:
                    answer = json.loads(answers.readline())
        finally:
            os.close(child_stdin)  # the child holds its own ends now: its exit ends our reads
            os.close(child_stdout)
        return ForkedProcess(answer["pid"], os.fdopen(to_child, "w"), os.fdopen(from_child, "r"), self._exits)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()  # the zygote's cue to exit
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        for path in sorted(self._dir.rglob("*"), reverse=True):
            path.unlink() if not path.is_dir() else path.rmdir()
        self._dir.rmdir()


_zygote: Zygote | None = None
# Set in the test process as it runs, read by nothing an engine imports: pytest's name of the test running now (torch's
# cache directory, which the test process sets once it writes a model, vLLM's import sets too: `set_at_import`). A
# forked engine gets it all the same: its environment is the one it is sent.
_SET_AT_RUN_TIME = ("PYTEST_CURRENT_TEST",)


@contextlib.contextmanager
def forking(env: dict, log_path: Path) -> Iterator[Zygote]:
    """Engines whose environment is `env` are forked from one zygote while this lasts."""
    global _zygote
    _zygote = Zygote(env, log_path)
    try:
        yield _zygote
    finally:
        zygote, _zygote = _zygote, None
        zygote.close()


def spawn(settings: str, env: dict, stderr: IO) -> subprocess.Popen | ForkedProcess:
    """An engine process (testkit/vllm_engine_process.py with `settings`): forked from the session's zygote where
    one runs with this environment, else started from scratch, saying why in its log."""
    if _zygote is not None and _zygote.process.poll() is None:
        differences = _zygote.differences(env)
        if not differences:
            return _zygote.fork([settings], env, stderr)
        stderr.write(f"testkit.vllm_zygote: started from scratch, not forked: its environment differs from the "
                     f"zygote's in {', '.join(differences)}\n")
        stderr.flush()
    return subprocess.Popen([sys.executable, str(ENGINE_SCRIPT), settings], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=stderr, text=True)
