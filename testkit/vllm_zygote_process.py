"""The process testkit/vllm_zygote.py forks vLLM engines from: it imports vLLM (and what an engine process loads
before its engine starts) once, then forks one child per engine it is asked for. A child runs
testkit/vllm_engine_process.py's main() as a process started from scratch would, with the stdin, stdout and stderr
it was sent; importing vLLM takes an engine process about 13 s of its start on one core, a fork a few milliseconds.
vLLM forks its own workers from a process that has imported it in the same way (its default multiprocessing method).

Usage: vllm_zygote_process.py SOCKET EXITS. It prints {"ready": true, "set_at_import": {...}} on stdout once it
listens on the Unix socket SOCKET (with what importing vLLM set in its environment), and exits when its stdin ends
(the test process that started it closed it, or died). A request is one JSON line, {"argv": [...], "env": {...}},
sent with three file descriptors (the child's stdin, stdout and stderr); the answer is {"pid": n}. When a child
exits, its exit status is written to EXITS/<pid> (a child is not the test
process's own, so the test process cannot wait for it)."""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import sys
from pathlib import Path

STARTED_WITH = dict(os.environ)

import testkit.vllm_engine_process as engine_process  # noqa: E402 (it sets what vLLM reads in the environment)


def preload() -> None:
    """What every engine process imports before it starts its engine (vllm_engine_process.make_engine)."""
    import vllm  # noqa: F401
    import vllm.config  # noqa: F401
    import vllm.distributed.kv_transfer  # noqa: F401
    import vllm.v1.worker.cpu_model_runner  # noqa: F401
    from vllm import LLM, SamplingParams, TokensPrompt  # noqa: F401


def set_at_import() -> dict:
    """What importing the engine's modules set in the environment (vllm_engine_process.py: vLLM's CPU target, its
    engine core in the same process): an engine process started from scratch has it on top of the one it got."""
    return {k: v for k, v in os.environ.items() if STARTED_WITH.get(k) != v}


def serve(path: str, exits: Path) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(8)
    signal.signal(signal.SIGCHLD, lambda *_: _reap(exits))
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(sys.stdin, selectors.EVENT_READ)
    print(json.dumps({"ready": True, "set_at_import": set_at_import()}), flush=True)
    while True:
        for key, _ in selector.select():
            if key.fileobj is sys.stdin:
                if not sys.stdin.readline():
                    return  # the test process is done (or gone): so is this one
                continue
            connection, _ = listener.accept()
            with connection:
                _fork_one(connection, listener)


def _fork_one(connection: socket.socket, listener: socket.socket) -> None:
    message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
    request = json.loads(message)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        listener.close()
        connection.close()
        _become_engine(request, fds)  # never returns: the child exits as a process would
    for fd in fds:
        os.close(fd)
    connection.sendall(json.dumps({"pid": pid}).encode() + b"\n")


def _become_engine(request: dict, fds: list[int]) -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the engine waits for its own children (vLLM's subprocesses)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 (the process's own stdin, for its life)
    imported = set_at_import()
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ.update(imported)
    sys.argv = [engine_process.__file__, *request["argv"]]
    engine_process.main()
    sys.exit(0)  # through the interpreter's own exit, as an engine process started from scratch ends (atexit)


def _reap(exits: Path) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = os.waitstatus_to_exitcode(status)
        (exits / f"{pid}.tmp").write_text(str(code))
        (exits / f"{pid}.tmp").rename(exits / str(pid))


if __name__ == "__main__":
    preload()
    serve(sys.argv[1], Path(sys.argv[2]))
