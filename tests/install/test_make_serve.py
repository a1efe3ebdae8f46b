"""`make serve` on a machine where nothing is installed yet: it says what it installs, installs the package alone (no
torch, no test tools) into the venv it is given, then serves with the flags in ARGS; a second `make serve` installs
nothing."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from tests.helpers import free_port, wait_for
from tests.install.conftest import run, serving
from tiercache.client import Client

ROOT = Path(__file__).resolve().parents[2]


def make_serve(venv: Path, port: int, tmp_path: Path, log: Path) -> str:
    """Run `make serve` until it serves on `port`, then SIGTERM its process group (as Ctrl-C would) and return its
    output once the server has stopped."""
    args = f"--port {port} --host-mem 32MiB --disk-dir {tmp_path / 'disk'} --disk-size 64MiB"
    with open(log, "w") as output:
        make = subprocess.Popen(["make", "-C", str(ROOT), "serve", f"VENV={venv}", f"ARGS={args}"], stdout=output,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: make.poll() is not None or serving(port), timeout_s=600, what="make serve",
                 interval_s=0.2)
        assert make.poll() is None, log.read_text()
        with Client.from_url(f"grpc://127.0.0.1:{port}") as client:
            host = client.stats()["tiers"][0]
        assert host["name"] == "host" and host["capacity_bytes"] == 32 << 20  # ARGS reached the server
    finally:
        os.killpg(make.pid, signal.SIGTERM)
        make.wait(timeout=30)
    wait_for(lambda: "stopped" in log.read_text(), timeout_s=30, what="the server's graceful stop")
    return log.read_text()


def test_make_serve_installs_the_server_alone_and_passes_args(work, tmp_path):
    venv = work / "serve-venv"
    first = make_serve(venv, free_port(), tmp_path, tmp_path / "first.log")
    steps = ["tiercache install: creating the virtual environment",
             "tiercache install: installing tiercache and what `tiercache serve` needs",
             "tiercache install: building it generates the protobuf stubs", "serving on grpc://"]
    at = [first.find(step) for step in steps]
    assert -1 not in at and at == sorted(at), first
    assert "redis-server" not in first
    found = run(venv / "bin" / "python", "-c", "import importlib.util as u; "
                "print([u.find_spec(m) is not None for m in ('tiercache', 'torch', 'transformers', 'pytest', 'ruff')])",
                cwd=tmp_path).stdout
    assert found.strip() == "[True, False, False, False, False]"

    again = make_serve(venv, free_port(), tmp_path, tmp_path / "again.log")
    assert "tiercache install:" not in again and "serving on grpc://" in again
