"""The `tiercache` command: `serve` runs the cache server, `stats` shows a running server's tiers (its table:
`stats_table`), `layout` and `check-vllm` say what a vLLM engine will cache and refuse before it starts (`vllm`, over
vLLM's flags as `vllm_flags` reads them), `bench`, `demo`, `token-hash`."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from typing import Sequence

from tiercache.cli import vllm, vllm_tier
from tiercache.cli.stats_table import format_table
from tiercache.cli.values import port, positive, seconds
from tiercache.config import (Config, DiskTierConfig, HostTierConfig, ServerConfig, format_size, load_file, parse_size,
                              with_overrides)
from tiercache.errors import ConfigError, StartCancelled, TierCacheError


class _Parser(argparse.ArgumentParser):
    """Every error a command's arguments get is one line, `tiercache <command>: error: ...` (main prints the errors
    found later in the same shape), never usage + traceback."""

    def error(self, message: str) -> None:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")

    def parse_args(self, args=None, namespace=None) -> argparse.Namespace:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:  # argparse says these as the top parser (`tiercache: error:`), not as the command they went to
            self.exit(2, f"{getattr(parsed, 'command_prog', self.prog)}: error: unrecognized arguments: "
                         f"{' '.join(extras)} (see --help)\n")
        return parsed


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except TierCacheError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    # Cheap to import: no thread may start before `serve` blocks its signals (see serve; tests/test_cli.py checks).
    from tiercache import __version__
    from tiercache.prefix.presets import PRESETS

    parser = _Parser(prog="tiercache", description="Tiered cache service for LLM inference.")
    parser.add_argument("--version", action="version", version=f"tiercache {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    # The defaults --help states are the config's own (a default changed there cannot leave --help behind).
    server = ServerConfig()
    host_mem, disk_size = format_size(HostTierConfig.capacity_bytes), format_size(DiskTierConfig.capacity_bytes)
    disk_dir = "$XDG_CACHE_HOME/tiercache/chunks, else ~/.cache/tiercache/chunks"

    serve = _command(commands, "serve", help="run the cache server", description=(
        f"Run the cache server. Without flags: host tier {host_mem} in RAM, disk tier {disk_size} under "
        f"~/.cache/tiercache, no Redis, gRPC on {server.host}:{server.port}. Flags override the --config file."))
    serve.add_argument("--config", metavar="FILE", help="YAML config file (see README, 'Configuration')")
    serve.add_argument("--host", metavar="ADDR",
                       help=f"address to listen on (default {server.host}; 0.0.0.0 for all)")
    serve.add_argument("--port", type=port, metavar="PORT",
                       help=f"gRPC port (default {server.port}; 0 picks a free one)")
    serve.add_argument("--unix-socket", metavar="PATH", help="also listen on a unix socket (grpc+unix:///PATH)")
    serve.add_argument("--data-port", type=port, metavar="PORT", help="port of the data channel, remote clients' "
                       "payloads beside gRPC (default 0: a free one, announced to clients)")
    serve.add_argument("--no-data-channel", dest="data_channel", action="store_false", default=None,
                       help="no data channel: remote payloads are streamed over gRPC")
    serve.add_argument("--gpu-mem", type=_size, metavar="SIZE", help="GPU memory tier size, e.g. 8GiB (needs CUDA; "
                                                                      "default: off)")
    serve.add_argument("--host-mem", type=_size, metavar="SIZE",
                       help=f"host memory tier size, e.g. 4GiB (default {host_mem}; 0: off)")
    serve.add_argument("--disk-dir", metavar="DIR", help=f"disk tier directory (default {disk_dir})")
    serve.add_argument("--disk-size", type=_size, metavar="SIZE",
                       help=f"disk tier byte cap, e.g. 100GiB (default {disk_size}; 0: off)")
    serve.add_argument("--redis-url", metavar="URL", help="Redis tier, e.g. redis://host:6379/0 (default: none)")
    serve.add_argument("--redis-cluster", action="store_true", default=None,
                       help="--redis-url names a node of a Redis Cluster")
    serve.add_argument("--write-through", action="store_true", default=None,
                       help="also write every chunk to Redis at once (cross-node sharing)")
    serve.add_argument("--max-chunk-size", type=_size, metavar="SIZE",
                       help=f"largest chunk accepted (default {format_size(server.max_chunk_bytes)}: the largest "
                            f"state of the models docs/deploy.md sizes)")
    serve.add_argument("--metrics-port", type=port, metavar="PORT",
                       help="serve Prometheus /metrics on this port (default: off)")
    serve.add_argument("--metrics-host", metavar="ADDR",
                       help=f"address of the metrics endpoint (default {server.metrics_host})")
    serve.add_argument("--disk-fsync", action="store_true", default=None,
                       help="fsync each disk chunk before acknowledging its put (durable across crashes)")
    serve.add_argument("--redis-user", metavar="NAME", help="Redis ACL user")
    serve.add_argument("--redis-password-file", metavar="FILE", help="file holding the Redis password")
    serve.add_argument("--redis-tls-ca", metavar="FILE", help="CA of the Redis server's certificate (rediss://)")
    serve.add_argument("--tls-cert", metavar="FILE", help="serve gRPC over TLS with this certificate chain (PEM)")
    serve.add_argument("--tls-key", metavar="FILE", help="private key of --tls-cert (PEM)")
    serve.add_argument("--tls-client-ca", metavar="FILE", help="require client certificates from this CA (mTLS)")
    serve.add_argument("--tenants-file", metavar="FILE", help="bearer tokens -> tenants (YAML); turns on auth")
    serve.add_argument("--health-port", type=port, metavar="PORT",
                       help="plaintext grpc.health.v1 port for probes (default: off)")
    serve.add_argument("--events", dest="events", action="store_true", default=None,
                       help="publish KV events for routers, per registered pod (docs/events.md; default: off)")
    serve.add_argument("--events-host", metavar="ADDR", help="address of the pods' event sockets (default 127.0.0.1)")
    serve.add_argument("--events-query-port", type=port, metavar="PORT",
                       help="serve the pod query over HTTP (POST /query, /query_by_hash) on --events-host:PORT "
                            "(docs/events.md; default: off)")
    serve.add_argument("--events-encoding", choices=["map", "array"],
                       help="events as maps tagged 'type' (default, vLLM >= #42892) or positional arrays (older vLLMs)")
    serve.add_argument("--events-medium", metavar="MEDIUM",
                       help="label every advertised block with this medium (e.g. GPU, for routers that score only "
                            "device blocks; default: the tier's own, CPU or STORAGE)")
    serve.add_argument("--events-advertise", choices=["restorable", "attention"],
                       help="restorable (default): blocks a checkpoint makes restorable; attention: every saved "
                            "attention block (what an engine's own events say; for comparisons only)")
    serve.add_argument("--stats-log-interval", type=seconds, metavar="SECONDS",
                       help="log lookups and hit %% this often when there was traffic (default 60; 0: off)")
    serve.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                       help="least severe log lines shown (default INFO)")

    bench = _command(commands, "bench", help="benchmarks against a real server")
    benches = bench.add_subparsers(dest="bench", required=True, parser_class=_Parser)
    cliff = _command(benches, "cliff", help="prefix hit ratio of a hybrid model: repeated prompts, chat, long "
                     "context", description="Runs a simulated engine with objects of a preset's real sizes against a "
                                            "server (one it starts when --server is omitted).")
    cliff.add_argument("--server", metavar="URL", help="use a running server (default: start one with a 4 GiB host "
                                                       "tier, 1 GiB with --quick, and 16 GiB of disk in a temp dir)")
    cliff.add_argument("--preset", default="qwen3.5-0.8b", choices=sorted(PRESETS), type=str.lower,
                       help="the model whose object sizes are simulated (default qwen3.5-0.8b)")
    cliff.add_argument("--tp", type=positive, default=1, metavar="N",
                       help="tensor-parallel size: simulate one rank's objects (KV heads and recurrent state split N "
                            "ways; default 1)")
    cliff.add_argument("--repeats", type=positive, default=3, metavar="N",
                       help="times each repeated prompt is sent (default 3)")
    cliff.add_argument("--turns", type=positive, default=8, metavar="N",
                       help="turns of each multi-turn chat, each extending the previous conversation (default 8)")
    cliff.add_argument("--system-tokens", type=positive, default=4096, metavar="N",
                       help="system prompt that starts each chat, in tokens (default 4096)")
    cliff.add_argument("--document-tokens", type=positive, metavar="N",
                       help="long shared document, in tokens (default 262144; 16384 with --quick)")
    cliff.add_argument("--questions", type=positive, default=8, metavar="N",
                       help="questions asked after the long document (default 8)")
    cliff.add_argument("--seed", type=int, default=0, metavar="N",
                       help="seed of the random tokens and payloads (default 0)")
    cliff.add_argument("--quick", action="store_true", help="fewer lengths and a shorter document (CI smoke)")
    cliff.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    cliff.add_argument("--plot", metavar="FILE.png", help="also plot the repeated prompts' hit ratios to this PNG")
    cliff.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")

    demo = _command(commands, "demo", help="cold vs warm TTFT of a tiny Qwen3.5-architecture model (needs the "
                                             "hf extra)")
    demo.add_argument("--server", metavar="URL", help="use a running server (default: start one with a 512 MiB host "
                                                      "tier and a 2 GiB disk tier in a temp dir)")
    demo.add_argument("--turns", type=positive, default=4, metavar="N",
                      help="chat turns after the single prompts (default 4)")
    demo.add_argument("--repeats", type=positive, default=3, metavar="R",
                      help="each cold and warm request R times on prompts of its own; medians printed (default 3)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")

    stats = _command(commands, "stats", help="show a running server's tiers and namespaces")
    stats.add_argument("--server", metavar="URL",
                       help=f"grpc://, grpcs:// or grpc+unix:// URL (default: $TIERCACHE_URL, else "
                            f"grpc://{server.host}:{server.port}, as for every client); token and TLS files from "
                            f"$TIERCACHE_TOKEN(_FILE), $TIERCACHE_TLS_CA_FILE, ...")
    stats.add_argument("--json", action="store_true", help="print JSON instead of a table (full namespace names)")

    _command(commands, "token-hash", help="print the token_sha256 of a token for the tenants file",
             description="Reads a bearer token from stdin (or asks for it, without echo, on a terminal) and prints "
                         "the token_sha256 a tenants file names it by (README, 'Security').")
    vllm.add_commands(commands, _command)
    vllm_tier.add_command(commands, _command)
    return parser


def _command(commands: argparse._SubParsersAction, name: str, **kwargs) -> argparse.ArgumentParser:
    """A command's parser, which leaves its prog in the parsed arguments: what main and _Parser name an error by
    (`tiercache serve: error: ...`; a nested command's own parser runs last, so `tiercache bench cliff` wins)."""
    command = commands.add_parser(name, **kwargs)
    command.set_defaults(command_prog=command.prog)
    return command


def config_from_args(args: argparse.Namespace) -> Config:
    base = load_file(args.config) if args.config else Config()
    return with_overrides(base, {
        "server.host": args.host, "server.port": args.port, "server.unix_socket": args.unix_socket,
        "server.data_port": args.data_port, "server.data_channel": args.data_channel,
        "server.max_chunk_bytes": args.max_chunk_size,
        "server.metrics_port": args.metrics_port, "gpu.capacity_bytes": args.gpu_mem,
        "host.capacity_bytes": args.host_mem, "disk.path": args.disk_dir,
        "disk.capacity_bytes": args.disk_size, "redis.url": args.redis_url, "redis.cluster": args.redis_cluster,
        "redis.write_through": args.write_through, "server.metrics_host": args.metrics_host,
        "disk.fsync": args.disk_fsync, "redis.username": args.redis_user,
        "redis.password_file": args.redis_password_file, "redis.tls_ca_file": args.redis_tls_ca,
        "security.tls_cert_file": args.tls_cert, "security.tls_key_file": args.tls_key,
        "security.tls_client_ca_file": args.tls_client_ca, "security.tenants_file": args.tenants_file,
        "security.health_port": args.health_port, "server.stats_log_interval_s": args.stats_log_interval,
        "events.enabled": args.events, "events.host": args.events_host, "events.query_port": args.events_query_port,
        "events.encoding": args.events_encoding,
        "events.medium_override": args.events_medium, "events.advertise": args.events_advertise,
    })


def serve(args: argparse.Namespace) -> int:
    # SIGTERM / SIGINT are blocked in every thread and taken synchronously with sigwait, so no handler ever runs
    # inside a lock the main thread holds. The mask is inherited by new threads: block before grpc is even imported
    # (its core starts threads), or a second signal lands on one of them and kills the process. A handler that called
    # stop() deadlocked in Event.wait's condition (seen with `make serve` under `timeout`); one that raised left the
    # condition half-released when signals came in quick succession (tests/test_cli.py covers both).
    signals = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    # grpc's C core logs some failures itself (a taken port: `E1124 ... add_port.cc:83] Failed to add port`) before the
    # exception we turn into one line; it reads this before its first import. GRPC_VERBOSITY=ERROR brings them back.
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    from tiercache.malloc import tune_allocator
    from tiercache.server.app import CacheServer

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("tiercache")
    tune_allocator()
    config = config_from_args(args)
    try:
        # A signal that arrives while the tiers are prepared stays pending (blocked above): preparing a host arena of
        # many GiB asks between pieces whether one is, and stops (it used to finish first, minutes later). The test is
        # `test_sigterm_while_the_host_tier_is_committed_stops_the_server` in tests/server/test_startup.py.
        server = CacheServer(config, cancelled=lambda: bool(signal.sigpending() & signals)).start()
    except StartCancelled as exc:
        received = min(signal.sigpending() & signals)
        log.info("%s: %s; exiting without serving", signal.Signals(received).name, exc)
        return 0
    tiers = ", ".join(f"{t.name}" for t in server.store.tiers)
    log.info(
        "serving on %s (tiers: %s; max chunk %s)%s", server.url, tiers, format_size(config.server.max_chunk_bytes),
        (f"; metrics on :{server.metrics_port}" if server.metrics_port is not None else "")
        + (f"; data channel on :{server.data_port}" if server.data_port else "")
        + (f"; health on :{server.health_port}" if server.health_port is not None else "")
        + (f"; pod query (HTTP) on :{server.query_port}" if server.query_port is not None else "")
        + (f"; {len(server.tenants.tenants)} tenants" if server.tenants.enabled else ""))
    received = signal.sigwait(signals)
    log.info("%s: stopping (running RPCs get 5 s)", signal.Signals(received).name)
    server.stop()  # further signals stay blocked and pending: they cannot cut the graceful stop short
    log.info("stopped")
    return 0


def show_stats(args: argparse.Namespace) -> int:
    from tiercache.client.probe import require_server
    from tiercache.client.settings import ConnectionSettings

    url = ConnectionSettings.from_env(url=args.server).url  # --server, else $TIERCACHE_URL, else the default
    stats = require_server(url)
    if args.json:
        print(json.dumps(stats, indent=2))
        return 0
    print(f"tiercache {stats['version']} at {url}, up {stats['uptime_s']:.0f} s, "
          f"max chunk {format_size(stats['max_chunk_bytes'])}")
    print(format_table(stats))
    return 0


def token_hash(args: argparse.Namespace) -> int:
    """The digest a tenants file holds instead of the token (what the server compares a bearer token against).
    Read from stdin, not argv: a token on the command line lands in shell history and `ps`."""
    import getpass

    from tiercache.server.auth import MIN_TOKEN_CHARS, token_digest

    token = (getpass.getpass("token: ") if sys.stdin.isatty() else sys.stdin.read()).strip()
    if len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(f"a token must be at least {MIN_TOKEN_CHARS} characters (e.g. python3 -c "
                          f"'import secrets; print(secrets.token_urlsafe(32))')")
    print(token_digest(token).hex())
    return 0


def demo(args: argparse.Namespace) -> int:
    from tiercache.demo import run_demo

    return run_demo(args.server, args.turns, show_progress=not args.no_progress, repeats=args.repeats)


def run_bench(args: argparse.Namespace) -> int:
    from tiercache.bench import cliff_command

    return cliff_command(args)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return {"serve": serve, "stats": show_stats, "bench": run_bench, "demo": demo, "token-hash": token_hash,
                "layout": vllm.layout, "check-vllm": vllm.check,
                "vllm-tier": vllm_tier.vllm_tier}[args.command](args)
    except TierCacheError as exc:  # the shape of _Parser's errors: which command failed, on one line
        print(f"{args.command_prog}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
