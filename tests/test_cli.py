"""`tiercache serve` and `tiercache stats` as a user runs them: real subprocesses."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from tests.helpers import ServerProcess, free_port, python_env
from tiercache.client import Client


def run_cli(*args: str, timeout_s: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tiercache", *args], capture_output=True, text=True,
                          timeout=timeout_s, env=python_env())


@pytest.fixture
def served(tmp_path):
    server = ServerProcess("--host-mem", "32MiB", "--disk-dir", str(tmp_path / "disk"), "--disk-size", "64MiB")
    yield server.start()
    server.kill()


def test_serve_round_trip_stats_and_graceful_sigterm(served):
    with Client.from_url(served.url) as client:
        client.put("ns", b"k", b"hello")
        assert client.get("ns", b"k") == b"hello"
    table = run_cli("stats", "--server", served.url)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[1].split()[:2] == ["tier", "up"]
    assert lines[2].split()[:3] == ["host", "yes", "1"] and "32.0 MiB" in lines[2]
    assert lines[3].split()[:3] == ["disk", "yes", "0"]
    assert any(line.startswith("ns ") for line in lines)
    as_json = json.loads(run_cli("stats", "--server", served.url, "--json").stdout)
    assert [t["name"] for t in as_json["tiers"]] == ["host", "disk"]
    code, err = served.terminate()
    assert code == 0 and "stopped" in err


def test_config_file_with_flag_override(tmp_path):
    config = tmp_path / "tiercache.yaml"
    config.write_text(f"server:\n  port: {free_port()}\nhost:\n  capacity_bytes: 8MiB\n"
                      f"disk:\n  path: {tmp_path / 'd'}\n  capacity_bytes: 16MiB\n")
    server = ServerProcess("--config", str(config), "--host-mem", "4MiB").start()  # --port overrides the file
    try:
        with Client.from_url(server.url) as client:
            tiers = client.stats()["tiers"]
        assert tiers[0]["capacity_bytes"] == 4 << 20 and tiers[1]["capacity_bytes"] == 16 << 20
    finally:
        server.kill()


@pytest.mark.parametrize("args,needle", [
    (["serve", "--bogus"], "unrecognized arguments: --bogus"),
    (["serve", "--host-mem", "lots"], "not a size"),
    (["serve", "--port", "99999", "--disk-size", "0"], "server.port"),
    (["serve", "--disk-dir", "/proc/tiercache-cannot-exist"], "is not usable"),
    (["serve", "--config", "/nonexistent/tiercache.yaml"], "cannot read config file"),
    (["serve", "--redis-url", "http://x"], "redis.url"),
    (["serve", "--gpu-mem", "1GiB", "--port", "0"], "CUDA"),
    (["stats", "--server", "nonsense://x"], "grpc://host:port"),
])
def test_bad_input_is_one_clear_line(args, needle):
    result = run_cli(*args)
    assert result.returncode == 2
    assert needle in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "Traceback" not in result.stderr


def test_a_bad_size_in_the_config_file_is_one_line_naming_file_and_key(tmp_path):
    config = tmp_path / "tiercache.yaml"
    config.write_text("host:\n  capacity_bytes: lots\n")
    result = run_cli("serve", "--config", str(config))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"tiercache: error: config file {config}: host.capacity_bytes: not a size: 'lots' (use e.g. 512MiB, 4GiB or "
        f"a byte count)"], result.stderr


@pytest.mark.parametrize("flag", ["--port", "--data-port"])
def test_port_in_use_is_one_clear_line(tmp_path, flag):
    # Before: grpc's own `E1124 ... add_port.cc:83] Failed to add port` line came first, and only after the tiers
    # were built (minutes for a large host tier). Now the ports are checked before anything is built.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = ["--port", str(port)] if flag == "--port" else ["--port", "0", "--data-port", str(port)]
        result = run_cli("serve", *args, "--disk-dir", str(tmp_path / "d2"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"tiercache: error: cannot listen on 127.0.0.1:{port} for {'gRPC' if flag == '--port' else 'the data channel'} "
        f"({flag}): Address already in use"], result.stderr


@pytest.mark.parametrize("command", [["stats"], ["demo", "--no-progress"],
                                     ["bench", "cliff", "--quick", "--no-progress"]])
def test_a_command_pointed_at_a_dead_server_says_so_in_one_line(command):
    # Before: stats printed gRPC's raw text; demo exited 0 after ~20 warnings with "warm ... 0" rows; bench cliff ran
    # ~50 s through ~110 warnings before failing. Now one probe, before any work (no model, no requests).
    url = f"grpc://127.0.0.1:{free_port()}"  # nobody listens there
    result = run_cli(*command, "--server", url)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [
        f"tiercache: error: no tiercache server at {url}: is `tiercache serve` running?"], result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize("signals", [("SIGTERM",), ("SIGINT",), ("SIGTERM", "SIGTERM", "SIGINT")])
def test_signals_stop_the_server_gracefully(tmp_path, signals):
    import signal as signal_module

    server = ServerProcess("--disk-dir", str(tmp_path / "d"), "--host-mem", "8MiB").start()
    try:
        for name in signals:
            server.process.send_signal(getattr(signal_module, name))
        code, err = server.wait(timeout_s=20)
        assert code == 0 and "stopped" in err
    finally:
        server.kill()
