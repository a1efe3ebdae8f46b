"""A running tiercache server: the store, the gRPC service (with health checking) on TCP and a unix socket, the data
channel beside it, TLS, and the Prometheus endpoint; started and stopped as one."""

from __future__ import annotations

import asyncio
import socket
import ssl
import threading
from concurrent import futures
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tiercache.config import Config, SecurityConfig, read_file
from tiercache.errors import ConfigError
from tiercache.events.pods import PodRegistry
from tiercache.protocol.wire import SERVICE_NAME, max_message_bytes
from tiercache.server.auth import OPEN, TenantTable
from tiercache.server.data_channel import DataChannelListener
from tiercache.server.intake import Intake
from tiercache.server.leases import LeaseTable
from tiercache.server.limits import StreamLimits
from tiercache.server.metrics import Metrics
from tiercache.server.query_http import QueryHttpServer
from tiercache.server.rpc import service_handler
from tiercache.server.servicer import TierCacheServicer
from tiercache.server.stats_log import StatsLog
from tiercache.store.same_host import SameHostPath
from tiercache.store.tiered import TieredStore


def _grpc_options(max_chunk_bytes: int) -> list[tuple[str, int]]:
    # grpc's default 4 MiB receive limit would reject a client that sends a whole chunk in one frame.
    limit = max_message_bytes(max_chunk_bytes)
    # grpc sets SO_REUSEPORT by default: a second server on the same port would silently share its traffic.
    return [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit),
            ("grpc.so_reuseport", 0)]


def server_credentials(security: SecurityConfig) -> grpc.ServerCredentials | None:
    """TLS credentials for the gRPC port (None: plaintext); with a client CA, clients must present certificates."""
    if not security.tls:
        return None
    cert = read_file(security.tls_cert_file, "TLS certificate")
    key = read_file(security.tls_key_file, "TLS key")
    client_ca = read_file(security.tls_client_ca_file, "TLS client CA") if security.tls_client_ca_file else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=client_ca,
                                       require_client_auth=client_ca is not None)


def data_tls_context(security: SecurityConfig) -> ssl.SSLContext | None:
    """The data channel's TLS: the gRPC port's certificate and client CA, so it is reachable on exactly its terms."""
    if not security.tls:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(security.tls_cert_file, security.tls_key_file)
    if security.tls_client_ca_file:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(cafile=security.tls_client_ca_file)
    return context


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _listen(server: grpc.Server, address: str, credentials: grpc.ServerCredentials | None) -> int:
    """Bind one address; the bound port (a unix socket gives 1), or a ConfigError saying why not."""
    try:
        port = (server.add_insecure_port(address) if credentials is None
                else server.add_secure_port(address, credentials))
    except RuntimeError:
        port = 0
    if not port:
        raise ConfigError(f"cannot listen on {address.removeprefix('unix:')} (address in use or not available)")
    return port


def check_addresses(config: Config) -> None:
    """ConfigError, in one line naming the flag to change, if an address the server is told to listen on cannot be
    bound: a host that does not resolve or is no address of this machine, a port that is taken (0: any port, so only
    the host is checked). Checked before anything is built: grpc would find it too, but only after the tiers (minutes
    for a large host arena), with a log line of its own before ours (`E1124 ... add_port.cc`); and a bad --host with
    --port 0 was blamed on the data channel, after the host tier was committed (tests/server/test_startup.py)."""
    cfg, events = config.server, config.events
    for what, host_flag, host, port_flag, port in (
            ("gRPC", "--host", cfg.host, "--port", cfg.port),
            ("the data channel", "--host", cfg.host, "--data-port", cfg.data_port if cfg.data_channel else None),
            ("health", "--host", cfg.host, "--health-port", config.security.health_port),
            ("metrics", "--metrics-host", cfg.metrics_host, "--metrics-port", cfg.metrics_port),
            ("the pods' event sockets", "--events-host", events.host, "", 0 if events.enabled else None),
            ("the pod query", "--events-host", events.host, "--events-query-port", events.query_port)):
        if port is not None:
            _check_bind(what, host, host_flag, 0)  # the host alone: a failure here is never the port's
            if port:
                _check_bind(what, host, port_flag, port)


def _check_bind(what: str, host: str, flag: str, port: int) -> None:
    where = _address(host, port) if port else host
    try:
        addresses = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"cannot listen on {where} for {what} ({flag}): {exc.strerror}") from None
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as grpc does: TIME_WAIT is no obstacle
            try:
                probe.bind(address)
            except OSError as exc:
                raise ConfigError(f"cannot listen on {where} for {what} ({flag}): {exc.strerror or exc}") from None


class CacheServer:
    """A running tiercache server: the store, the gRPC service with health checking, and the metrics endpoint.

    The gRPC servers are asyncio (grpc.aio) on one event loop in a thread of their own: a stream whose client stops
    reading or writing waits there without holding a thread. The store's blocking work runs on `server.workers`
    threads (`blocking`)."""

    def __init__(self, config: Config, store: TieredStore | None = None,
                 cancelled: Callable[[], bool] | None = None) -> None:
        """`cancelled`: asked while the tiers are prepared (a large host arena takes a while); true stops that with
        StartCancelled."""
        self.config = config
        # What can refuse a start in milliseconds comes before the store, whose host arena may take minutes to commit.
        self.tenants = TenantTable.load(config.security.tenants_file)
        self._credentials = server_credentials(config.security)
        check_addresses(config)
        self.store = store or TieredStore.from_config(config, cancelled)
        self.metrics = Metrics(self.store)
        self.leases = LeaseTable(config.server.lease_ttl_s)
        # One intake for every transport: one tenant lookup, one admission rule, one serve path, one count of requests
        # in flight per client, host and tenant.
        limits = StreamLimits(config.server.max_streams_per_client, config.server.max_streams_per_peer,
                              config.server.max_streams_per_tenant)
        # The same-host path over the store (writes and reads in place in the arena clients map), or None.
        self.same_host = SameHostPath.over(self.store)
        self.intake = Intake(self.store, self.tenants, limits, config.server.max_chunk_bytes,
                             engine_blocks=config.events.enabled, same_host=self.same_host)
        self.metrics.watch_requests(self.intake.limits, [t.name for t in self.tenants.tenants] or [OPEN.name])
        self._blocking = futures.ThreadPoolExecutor(max_workers=config.server.workers,
                                                    thread_name_prefix="tiercache-rpc")
        self._loop: asyncio.AbstractEventLoop | None = None  # made by start()
        self._loop_thread: threading.Thread | None = None
        self._server: grpc.aio.Server | None = None
        self._health_server: grpc.aio.Server | None = None
        self._health: health.aio.HealthServicer | None = None
        self._stopped = threading.Event()
        self.data_listener: DataChannelListener | None = None
        self.port = 0
        self.health_port: int | None = None
        self.metrics_port: int | None = None
        self.query_port: int | None = None  # the pod query's HTTP port (events.query_port), once serving
        self.query_http: QueryHttpServer | None = None
        self.stats_log: StatsLog | None = None
        self.events = None  # tiercache.events.publisher.EventStreams, made by start() when events.enabled

    def start(self) -> "CacheServer":
        cfg = self.config.server
        if cfg.stats_log_interval_s:  # its first snapshot before any RPC is served: every lookup is in a line
            self.stats_log = StatsLog(self.store, cfg.stats_log_interval_s).start()
        if self.config.events.enabled:
            # Imported here: pyzmq and msgpack load only in servers that publish events.
            from tiercache.events.publisher import EventStreams
            from tiercache.events.restorable import RestorableIndex

            self.events = EventStreams(RestorableIndex(self.store, advertise=self.config.events.advertise,
                                                       medium_override=self.config.events.medium_override),
                                      self.config.events)
        # A pod's rules, for the gRPC handlers and the HTTP query alike (every pod call is NotFound without events).
        self.pods = PodRegistry(self.store, self.events)
        try:
            return self._start_serving()
        except BaseException:
            if self.stats_log is not None:
                self.stats_log.stop()
            if self.events is not None:
                self.events.close()
            raise

    def _start_serving(self) -> "CacheServer":
        cfg = self.config.server
        if cfg.data_channel:  # before gRPC: an Attach answered during start must already name its port
            self.data_listener = DataChannelListener(self.config, self.intake, self.metrics,
                                                     data_tls_context(self.config.security))
            try:
                self.data_listener.start(cfg.host, cfg.data_port, cfg.unix_socket)
            except OSError as exc:
                self.data_listener.stop(grace_s=0)
                self.store.close()
                raise ConfigError(f"cannot serve the data channel on {cfg.host}:{cfg.data_port}: "
                                  f"{exc.strerror or exc}") from None
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._loop.run_forever, name="tiercache-server", daemon=True)
        self._loop_thread.start()
        try:
            self._on_loop(self._start())
        except BaseException:
            if self.query_http is not None:
                self.query_http.stop()
            self._stop_loop()
            if self.data_listener is not None:
                self.data_listener.stop(grace_s=0)
            raise
        if cfg.metrics_port is not None:
            try:
                self.metrics_port = self.metrics.serve(cfg.metrics_host, cfg.metrics_port)
            except OSError as exc:
                self.stop(grace_s=0)
                raise ConfigError(f"cannot serve metrics on {cfg.metrics_host}:{cfg.metrics_port}: "
                                  f"{exc.strerror}") from None
        return self

    async def _start(self) -> None:
        cfg = self.config.server
        self._health = health.aio.HealthServicer()
        server = grpc.aio.server(options=_grpc_options(cfg.max_chunk_bytes))
        servicer = TierCacheServicer(self.intake, self.config, self.metrics, self.leases, self._blocking, self.pods,
                                     data_channel=self._data_channel)
        server.add_generic_rpc_handlers((service_handler(servicer),))
        self._serve_query()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        self.port = _listen(server, _address(cfg.host, cfg.port), self._credentials)
        if cfg.unix_socket:
            # Only local processes reach a unix socket (file permissions guard it); tokens are still checked.
            _listen(server, f"unix:{cfg.unix_socket}", None)
        health_port = self.config.security.health_port
        if health_port is not None:
            self._health_server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
            health_pb2_grpc.add_HealthServicer_to_server(self._health, self._health_server)
            self.health_port = _listen(self._health_server, _address(cfg.host, health_port), None)
        await server.start()
        self._server = server
        if self._health_server is not None:
            await self._health_server.start()
        for service in ("", SERVICE_NAME):
            await self._health.set(service, health_pb2.HealthCheckResponse.SERVING)

    def _serve_query(self) -> None:
        """The pod query over HTTP (events.query_port), before gRPC listens: a server reported ready answers both."""
        events = self.config.events
        if self.events is None or events.query_port is None:
            return
        self.query_http = QueryHttpServer(self.intake.tenant, self.pods.query)
        try:
            self.query_port = self.query_http.start(events.host, events.query_port)
        except OSError as exc:
            raise ConfigError(f"cannot serve the pod query on {events.host}:{events.query_port}: "
                              f"{exc.strerror}") from None

    def _data_channel(self) -> tuple[int, str]:
        """(port, unix socket path) of the data channel for Attach; (0, "") when there is none."""
        listener = self.data_listener
        return (listener.port, listener.unix_socket or "") if listener is not None else (0, "")

    @property
    def data_port(self) -> int:
        return self._data_channel()[0]

    @property
    def url(self) -> str:
        host = self.config.server.host
        host = "127.0.0.1" if host in ("0.0.0.0", "") else ("localhost" if host == "::" else host)
        return f"{'grpcs' if self.config.security.tls else 'grpc'}://{host}:{self.port}"

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop accepting RPCs, let running ones finish within `grace_s`, then close the tiers."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self.stats_log is not None:
            self.stats_log.stop()
        if self.query_http is not None:
            self.query_http.stop()
        if self._loop_thread is not None and self._loop_thread.is_alive():
            self._on_loop(self._stop(grace_s))
            self._stop_loop()
        if self.data_listener is not None:
            self.data_listener.stop(grace_s)
        self._blocking.shutdown(wait=True)
        if self.events is not None:
            self.events.close()
        self.metrics.close()
        self.leases.close()  # takes back every reservation and read pin before the arena goes away
        self.store.close()

    async def _stop(self, grace_s: float) -> None:
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        if self._server is not None:
            await self._server.stop(grace_s)
        if self._health_server is not None:
            await self._health_server.stop(0)

    def _on_loop(self, coroutine):
        """Run a coroutine on the server's loop from another thread, and wait for it."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop_thread.join()
        self._loop.close()

    def wait(self) -> None:
        self._stopped.wait()

    def __enter__(self) -> "CacheServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
