"""`tiercache serve` and `tiercache stats` as a user runs them: real subprocesses."""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys

import pytest

from tests.helpers import ServerProcess, free_port, python_env
from tiercache.cli import build_parser
from tiercache.client import DEFAULT_URL, Client


def run_cli(*args: str, timeout_s: float = 30, env: dict | None = None) -> subprocess.CompletedProcess:
    """`tiercache *args`, with `env` added to the test's environment."""
    return subprocess.run([sys.executable, "-m", "tiercache", *args], capture_output=True, text=True,
                          timeout=timeout_s, env={**python_env(), **(env or {})})


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


def test_stats_asks_the_server_in_tiercache_url_unless_told_another(served):
    # Before: stats always asked grpc://127.0.0.1:50051 without --server, while every client and connector honoured
    # $TIERCACHE_URL (client.settings). Now the flag, else the variable, else the default, as everywhere.
    dead = f"grpc://127.0.0.1:{free_port()}"
    from_env = run_cli("stats", env={"TIERCACHE_URL": served.url})
    assert from_env.returncode == 0, from_env.stderr
    assert from_env.stdout.startswith("tiercache ") and f" at {served.url}, up " in from_env.stdout.splitlines()[0]
    flag_first = run_cli("stats", "--json", "--server", served.url, env={"TIERCACHE_URL": dead})
    assert flag_first.returncode == 0 and json.loads(flag_first.stdout)["tiers"], flag_first.stderr
    env_dead = run_cli("stats", env={"TIERCACHE_URL": dead})
    assert env_dead.returncode == 2 and f"no tiercache server at {dead}" in env_dead.stderr
    help_text = " ".join(run_cli("stats", "--help").stdout.split())
    assert f"(default: $TIERCACHE_URL, else {DEFAULT_URL}" in help_text


def test_stats_shortens_long_namespaces_and_its_json_keeps_them(served):
    # Before: the namespace column was as wide as the longest namespace: 256 characters made every row 260 wide.
    long_name, short_name = "qwen3.5-0.8b@main#" + "f" * 200 + "~tail-0123456789", "ns"
    with Client.from_url(served.url) as client:
        client.put(long_name, b"k", b"x" * 1000)
        client.put(short_name, b"k", b"y")
    table = run_cli("stats", "--server", served.url)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    rows = lines[lines.index(next(line for line in lines if line.startswith("namespace "))):]
    assert max(len(line) for line in rows) < 100, rows
    shortened = next(line for line in rows if line.startswith("qwen3.5-0.8b@main#ff"))
    assert "..." in shortened and shortened.split()[0].endswith("~tail-0123456789")
    assert "--json has them in full" in rows[-1]
    as_json = json.loads(run_cli("stats", "--server", served.url, "--json").stdout)
    assert {n["namespace"] for n in as_json["namespaces"]} == {long_name, short_name}


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
    # Before, the first two were said as `tiercache: error:` and `tiercache serve: error:`, and --port as the config
    # key `server.port`: every error of a command is now said in one shape, by that command, naming the flag.
    (["serve", "--bogus"], "unrecognized arguments: --bogus (see --help)"),
    (["serve", "--host-mem", "lots"], "argument --host-mem: not a size"),
    (["serve", "--port", "99999", "--disk-size", "0"], "argument --port: expected a port 0..65535, got '99999'"),
    (["serve", "--metrics-port", "http"], "argument --metrics-port: expected a port 0..65535, got 'http'"),
    (["serve", "--port", "0", "--disk-dir", "/proc/tiercache-cannot-exist"], "is not usable"),
    (["serve", "--config", "/nonexistent/tiercache.yaml"], "cannot read config file"),
    (["serve", "--redis-url", "http://x"], "redis.url"),
    (["serve", "--gpu-mem", "1GiB", "--port", "0"], "CUDA"),
    (["stats", "--server", "nonsense://x"], "grpc://host:port"),
    (["stats", "--json", "--bogus"], "unrecognized arguments: --bogus"),
])
def test_bad_input_is_one_clear_line(args, needle):
    result = run_cli(*args)
    assert result.returncode == 2
    assert result.stderr.startswith(f"tiercache {args[0]}: error: "), result.stderr
    assert needle in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "Traceback" not in result.stderr


def test_a_bad_size_in_the_config_file_is_one_line_naming_file_and_key(tmp_path):
    config = tmp_path / "tiercache.yaml"
    config.write_text("host:\n  capacity_bytes: lots\n")
    result = run_cli("serve", "--config", str(config))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"tiercache serve: error: config file {config}: host.capacity_bytes: not a size: 'lots' (use e.g. 512MiB, "
        f"4GiB or a byte count)"], result.stderr


def test_a_config_file_that_is_not_yaml_is_one_line_naming_file_line_and_column(tmp_path):
    config = tmp_path / "tiercache.yaml"
    config.write_text("server:\n  port: [1\nhost: {\n")
    result = run_cli("serve", "--config", str(config))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"tiercache serve: error: config file {config} is not valid YAML: line 3, column 5: expected ',' or ']', but "
        f"got ':' (while parsing a flow sequence that starts at line 2, column 9)"], result.stderr


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
        f"tiercache serve: error: cannot listen on 127.0.0.1:{port} for "
        f"{'gRPC' if flag == '--port' else 'the data channel'} ({flag}): Address already in use"], result.stderr


@pytest.mark.parametrize("command", [["stats"], ["demo", "--no-progress"],
                                     ["bench", "cliff", "--quick", "--no-progress"]])
def test_a_command_pointed_at_a_dead_server_says_so_in_one_line(command):
    # Before: stats printed gRPC's raw text; demo exited 0 after ~20 warnings with "warm ... 0" rows; bench cliff ran
    # ~50 s through ~110 warnings before failing. Now one probe, before any work (no model, no requests).
    url = f"grpc://127.0.0.1:{free_port()}"  # nobody listens there
    result = run_cli(*command, "--server", url)
    assert result.returncode != 0
    prog = " ".join(["tiercache", *(a for a in command if not a.startswith("-"))])  # e.g. tiercache bench cliff
    assert result.stderr.strip().splitlines() == [
        f"{prog}: error: no tiercache server at {url}: is `tiercache serve` running?"], result.stderr
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


# -- the command line itself ------------------------------------------------------------------------------------------

def test_version():
    import tiercache

    result = run_cli("--version")
    assert result.returncode == 0 and result.stdout == f"tiercache {tiercache.__version__}\n"


def _parsers(parser: argparse.ArgumentParser, path: str = "tiercache"):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{path} {name}")


def test_every_flag_says_what_it_does():
    missing = [f"{path} {'/'.join(action.option_strings) or action.dest}" for path, parser in _parsers(build_parser())
               for action in parser._actions
               if not isinstance(action, argparse._SubParsersAction) and not action.help]
    assert missing == []


def test_serve_help_states_each_default_and_calls_every_port_port():
    # Before: --host-mem, --disk-dir and --disk-size had no default in --help, and ports were METRICS_PORT,
    # HEALTH_PORT, DATA_PORT or PORT by flag.
    text = " ".join(run_cli("serve", "--help").stdout.split())
    for flag, default in (("--host-mem SIZE", "default 1.0 GiB; 0: off"), ("--disk-size SIZE", "default 4.0 GiB"),
                          ("--disk-dir DIR", "default $XDG_CACHE_HOME/tiercache/chunks, else ~/.cache/tiercache"),
                          ("--port PORT", "default 50051"), ("--host ADDR", "default 127.0.0.1")):
        assert f"{flag} " in text and default in text.split(f"{flag} ", 1)[1].split(" --", 1)[0], flag
    serve = dict(_parsers(build_parser()))["tiercache serve"]
    ports = {a.option_strings[0]: a.metavar for a in serve._actions if a.option_strings[0].endswith("-port")}
    assert len(ports) == 5 and set(ports.values()) == {"PORT"}, ports


def test_bench_cliff_lists_its_presets_and_takes_a_tp_size():
    from tiercache.prefix.presets import PRESETS

    text = run_cli("bench", "cliff", "--help").stdout
    assert all(name in text for name in PRESETS) and "--tp N" in text
    wrong = run_cli("bench", "cliff", "--preset", "llama-7b")
    assert wrong.returncode == 2 and "invalid choice: 'llama-7b'" in wrong.stderr
    assert len(wrong.stderr.strip().splitlines()) == 1, wrong.stderr
    # Checked before a server is started or asked for (none listens at this URL).
    uneven = run_cli("bench", "cliff", "--tp", "3", "--server", f"grpc://127.0.0.1:{free_port()}")
    assert uneven.returncode == 2
    assert uneven.stderr.strip().splitlines() == ["tiercache bench cliff: error: kv_heads=2 does not split "
                                                  "over tp_size=3"]


def test_bench_cliff_simulates_one_tp_rank_and_plots_only_when_asked(tmp_path):
    """--tp 2: objects of one rank (half the state); no PNG in the working directory unless --plot names one (it
    used to write tiercache-cliff.png unasked)."""
    small = ["bench", "cliff", "--quick", "--repeats", "1", "--turns", "1", "--system-tokens", "64",
             "--document-tokens", "1100", "--questions", "1", "--no-progress", "--json"]
    with ServerProcess("--host-mem", "256MiB", "--disk-size", "0") as server:
        reports = {}
        for tp in (1, 2):
            result = subprocess.run([sys.executable, "-m", "tiercache", *small, "--tp", str(tp), "--server",
                                     server.url], capture_output=True, text=True, timeout=300, env=python_env(),
                                    cwd=tmp_path)
            assert result.returncode == 0, result.stderr
            reports[tp] = json.loads(result.stdout)
        assert list(tmp_path.iterdir()) == []
    assert reports[2]["tp_size"] == 2 and reports[2]["state_bytes"] * 2 == reports[1]["state_bytes"]
    assert reports[2]["kv_chunk_bytes"] * 2 == reports[1]["kv_chunk_bytes"]
    assert reports[1]["namespace"] != reports[2]["namespace"]


def test_building_the_parser_starts_no_thread():
    """`serve` blocks SIGTERM before it imports what starts threads; a thread started earlier (numpy's BLAS pool,
    say, through an import build_parser needs) would take the signal and kill the process without a graceful stop."""
    script = "import os, tiercache.cli as c; c.build_parser(); print(len(os.listdir('/proc/self/task')))"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, env=python_env())
    assert out.stdout.strip() == "1"


def test_token_hash_makes_the_digest_a_server_accepts(tmp_path):
    token = "a-token-of-team-a-0123456789"
    made = subprocess.run([sys.executable, "-m", "tiercache", "token-hash"], input=token + "\n", capture_output=True,
                          text=True, timeout=30, env=python_env())
    assert made.returncode == 0, made.stderr
    digest = made.stdout.strip()
    assert len(digest) == 64 and token not in made.stdout + made.stderr
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(f"tenants:\n  ops:\n    token_sha256: {digest}\n    admin: true\n")
    with ServerProcess("--host-mem", "8MiB", "--disk-size", "0", "--tenants-file", str(tenants)) as server:
        with Client.from_url(server.url, token=token) as client:
            assert client.stats()["tiers"][0]["name"] == "host"
    short = subprocess.run([sys.executable, "-m", "tiercache", "token-hash"], input="short\n", capture_output=True,
                           text=True, timeout=30, env=python_env())
    assert short.returncode == 2 and "at least 16 characters" in short.stderr and short.stdout == ""


def test_stats_show_what_engines_loaded_apart_from_what_lookups_found():
    from tiercache.cli import format_table

    stats = {"tiers": [], "namespaces": [],
             "lookups": {"lookups": 2, "requested_tokens": 600, "found_tokens_by_tier": {"host": 576}},
             "delivered": {"loads": 0, "loaded_tokens_by_tier": {}, "failed_loads": 0, "failed_load_tokens": 0,
                           "saves_dropped_by_reason": {"unreachable": 4}}}
    lines = format_table(stats).splitlines()
    # The same prompt twice in one engine: found by both lookups, loaded by neither (vLLM's own cache served it).
    assert "loaded by engines: 0 of 600 prompt tokens (0.0%) (none) in 0 loads, 0 failed (0 tokens recomputed)" in lines
    assert "found by lookups:  576 of 600 prompt tokens (96.0%) (host 576) in 2 lookups, with what the engines " \
           "held themselves" in lines
    assert "saves dropped:     4 objects (unreachable 4)" in lines
