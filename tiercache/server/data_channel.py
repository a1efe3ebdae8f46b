"""The data channel's server end (the client's: tiercache.client.data_channel): remote clients' chunk payloads over
a plain TCP (or unix) socket, received into and sent from the arena's pages in place (wire format and the reasons for
it: tiercache.protocol.data_channel).

One thread per connection, blocking I/O: a thread waits in `recv_into` / `sendall` with the GIL released, which is
what moves bytes fastest from Python. A client that stalls or trickles holds only its own connection's thread, and
not for long: every part of a request has a deadline — a read or write that makes no progress for
`server.stream_idle_timeout_s`, a request's header and header block within one idle timeout of its first byte, a
chunk's payload (or a refused request's, drained) at 1 MiB per idle timeout at least — and memory follows the bytes
that arrive, not the sizes declared (a header block's buffer and a record the arena cannot take grow as they fill).
Between requests a connection may idle DATA_KEEPALIVE_S. Connections are bounded in all
(`server.max_data_connections`) and per peer host (`server.max_data_connections_per_peer`), so threads are too; over
those the refusal is Busy, and the client sends that call over gRPC instead.

This is a transport: it frames bytes, and the rest is the intake's (server.intake), as for gRPC — the tenant of the
hello's token, the one count of requests in flight per client, host and tenant (shared with gRPC streams), the one
admission
rule of a put, where its payload is received, and the one serve path of a get.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import ssl
import stat
import threading
import time
from typing import NoReturn, Sequence

from tiercache.config import Config
from tiercache.errors import Busy, TierCacheError
from tiercache.protocol import data_channel, sockets
from tiercache.protocol.wire import status_for
from tiercache.server.auth import Tenant
from tiercache.server.intake import Intake, Served, batches
from tiercache.server.limits import Counts
from tiercache.server.metrics import Metrics

log = logging.getLogger("tiercache.server")

DATA_KEEPALIVE_S = data_channel.KEEPALIVE_S  # an idle connection between requests is closed after this
# Draining a refused request's payloads reads into a buffer made for that drain: a connection holds none while idle.
_DRAIN_BYTES = 256 << 10
_ACCEPT_BACKLOG = 128


class DataChannelListener:
    """The server end of the data channel (the client's is tiercache.client.data_channel.DataChannelPath): accepts
    connections and frames bytes around the intake's calls."""

    def __init__(self, config: Config, intake: Intake, metrics: Metrics, tls: ssl.SSLContext | None) -> None:
        cfg = config.server
        self.intake = intake
        self.metrics = metrics
        self._tls = tls
        self._idle_s = cfg.stream_idle_timeout_s
        # Over a limit the refusal is Busy: the client sends that call over gRPC instead.
        self._all = Counts(cfg.max_data_connections, "data connections open (server.max_data_connections)",
                           Busy)
        self._connections_per_peer = Counts(cfg.max_data_connections_per_peer,
                                            "data connections open (server.max_data_connections_per_peer)", Busy)
        self._listeners: list[socket.socket] = []
        self._connections: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self.port = 0
        self.unix_socket: str | None = None

    # -- listening --------------------------------------------------------------------------------------------------

    def start(self, host: str, port: int, unix_socket: str | None) -> "DataChannelListener":
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.create_server((host, port), family=family, backlog=_ACCEPT_BACKLOG)
        self.port = listener.getsockname()[1]
        self._listen(listener, "tcp")
        if unix_socket:
            self.unix_socket = unix_socket + ".data"
            _remove_stale_socket(self.unix_socket)
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(self.unix_socket)
            listener.listen(_ACCEPT_BACKLOG)
            self._listen(listener, "unix")
        return self

    def _listen(self, listener: socket.socket, kind: str) -> None:
        self._listeners.append(listener)
        self._spawn(self._accept, listener, kind, name=f"tiercache-data-accept-{kind}")

    def _spawn(self, target, *args, name: str) -> None:
        thread = threading.Thread(target=self._tracked, args=(target, *args), name=name, daemon=True)
        with self._lock:
            self._threads.add(thread)
        thread.start()

    def _tracked(self, target, *args) -> None:
        try:
            target(*args)
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())

    def _accept(self, listener: socket.socket, kind: str) -> None:
        while not self._stopping.is_set():
            try:
                conn, address = listener.accept()
            except OSError as exc:
                if self._stopping.is_set():
                    return  # closed by stop()
                # Out of file descriptors (EMFILE), or a connection reset before it was accepted: keep listening.
                log.warning("data channel: accept failed (%s); retrying", exc)
                time.sleep(0.1)
                continue
            if self._stopping.is_set():
                conn.close()
                return
            peer = address[0] if kind == "tcp" else "unix"
            if kind == "tcp":
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._connections.add(conn)
            try:
                # TLS on TCP only: the unix socket is reachable by local processes alone (like gRPC's, plaintext).
                self._spawn(self._connection, conn, peer, kind == "tcp", name="tiercache-data")
            except RuntimeError:  # no thread to be had: refuse this one, keep serving the others
                log.warning("data channel: cannot start a thread for a connection from %s", peer)
                self._forget(conn)
                conn.close()

    def open_connections(self) -> int:
        """Connections open now (operators, tests)."""
        with self._lock:
            return len(self._connections)

    def serving_threads(self) -> int:
        """Threads accepting or serving connections now."""
        with self._lock:
            return len(self._threads)

    def stop(self, grace_s: float = 5.0) -> None:
        """Close the listeners and every connection (a request in progress ends: its reservation is aborted)."""
        self._stopping.set()
        for listener in self._listeners:
            try:
                listener.shutdown(socket.SHUT_RDWR)  # wakes the thread in accept(); close() alone leaves it listening
            except OSError:
                pass
            listener.close()
        if self.unix_socket:
            _remove_stale_socket(self.unix_socket)
        with self._lock:
            connections, threads = list(self._connections), list(self._threads)
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv / send
            except OSError:
                pass
        deadline = time.monotonic() + grace_s
        for thread in threads:
            thread.join(max(deadline - time.monotonic(), 0.01))

    # -- one connection ---------------------------------------------------------------------------------------------

    def _connection(self, conn: socket.socket, peer: str, tls: bool) -> None:
        sock = conn
        try:
            with self._all.hold("*", "the server"), self._connections_per_peer.hold(peer, peer):
                sock.settimeout(self._idle_s)
                if tls and self._tls is not None:
                    # The whole handshake within the idle time: CPython's ssl takes a socket's timeout as the
                    # handshake's deadline, not each read's (tests/server/test_data_channel.py trickles a ClientHello).
                    sock = self._tls.wrap_socket(conn, server_side=True)
                    self._track(conn, sock)
                hello = data_channel.read_hello(sock, deadline=time.monotonic() + self._idle_s)
                tenant = self.intake.tenant(hello.token)
                sockets.send_all(sock, data_channel.status(data_channel.OK))
                # A client that names itself has its requests counted with its gRPC streams; one that does not, as
                # the connection's own (server.limits).
                client = hello.client_id or f"data connection {id(sock):x}"
                self._requests(sock, tenant, peer, client)
        except _OutOfStep as exc:  # failed after answering OK: nothing more can be said on this connection
            log.log(logging.WARNING if isinstance(exc.__cause__, TierCacheError) else logging.ERROR,
                    "data connection from %s: a get failed half-way", peer, exc_info=exc.__cause__)
        except data_channel.ConnectionBroken as exc:
            log.debug("data connection from %s ended: %s", peer, exc)
        except (ssl.SSLError, OSError) as exc:
            log.debug("data connection from %s failed: %s", peer, exc)
        except TierCacheError as exc:  # refused before any request (token, limits) or malformed: answer, then close
            self._answer_and_close(sock, data_channel.code_for(exc), str(exc))
        except Exception:  # noqa: BLE001 - one connection's bug must not take the server's others down
            log.exception("data connection from %s failed", peer)
            self._answer_and_close(sock, data_channel.INTERNAL, "internal error")
        finally:
            sock.close()
            self._forget(sock)

    def _track(self, raw: socket.socket, wrapped: socket.socket) -> None:
        """Stop shuts down what the connection's thread blocks in: after TLS wraps it, that is the TLS socket."""
        with self._lock:
            self._connections.discard(raw)
            self._connections.add(wrapped)

    def _forget(self, sock: socket.socket) -> None:
        with self._lock:
            self._connections.discard(sock)

    def _answer_and_close(self, sock: socket.socket, code: int, message: str) -> None:
        try:
            sockets.send_all(sock, data_channel.status(code, message))
        except data_channel.ConnectionBroken:
            pass

    def _requests(self, sock: socket.socket, tenant: Tenant, peer: str, client: str) -> None:
        while not self._stopping.is_set():
            sock.settimeout(DATA_KEEPALIVE_S)
            request = data_channel.read_request(sock, idle_s=self._idle_s)
            if request is None:
                return
            started = time.perf_counter()
            name = "DataPut" if request.op == data_channel.OP_PUT else "DataGet"
            code = "OK"
            try:
                with self._in_flight(sock, request, peer, tenant, client):
                    if request.op == data_channel.OP_PUT:
                        self._put(sock, tenant, request)
                    else:
                        self._get(sock, tenant, request)
            except _Refused as refused:
                code = status_for(refused.error).name
            except BaseException as exc:
                code = "CANCELLED" if isinstance(exc, data_channel.ConnectionBroken) else status_for(exc).name
                raise
            finally:
                self.metrics.rpc_seconds.labels(name, code).observe(time.perf_counter() - started)

    @contextlib.contextmanager
    def _in_flight(self, sock: socket.socket, request: data_channel.Request, peer: str, tenant: Tenant,
                   client: str):
        """Count the request as one in flight of its client, peer host and tenant (with their gRPC streams) while it
        runs; over a limit, refuse it."""
        with contextlib.ExitStack() as held:
            try:
                held.enter_context(self.intake.in_flight(peer, tenant, client))
            except TierCacheError as refused:
                self._refuse(sock, refused, request.entries)
            yield

    def _refuse(self, sock: socket.socket, error: TierCacheError,
                unread: Sequence[data_channel.PutEntry] = ()) -> NoReturn:
        """Answer a request with its error, after draining the payloads of `unread` chunks (already on their way),
        so the connection stays in step for the next request."""
        size = sum(entry.size for entry in unread)
        if size:
            sockets.drain(sock, size, memoryview(bytearray(min(size, _DRAIN_BYTES))),
                       sockets.payload_deadline(size, self._idle_s))
        sockets.send_all(sock, data_channel.status(data_channel.code_for(error), str(error)))
        raise _Refused(error)

    # -- PUT --------------------------------------------------------------------------------------------------------

    def _put(self, sock: socket.socket, tenant: Tenant, request: data_channel.Request) -> None:
        entries = request.entries
        try:
            chunks = self.intake.admit(tenant, request.namespace, entries)
        except TierCacheError as refused:
            if any(entry.size > self.intake.max_chunk_bytes for entry in entries):
                raise  # not drained: the announced bytes could be anything. The connection is closed.
            self._refuse(sock, refused, entries)
        tiers = []
        for index, chunk in enumerate(chunks):
            try:
                incoming = self.intake.receive(chunk)
            except TierCacheError as refused:  # nothing of this chunk read yet
                self._refuse(sock, refused, entries[index:])
            deadline = sockets.payload_deadline(chunk.size_bytes, self._idle_s)
            try:
                incoming.fill(lambda view: sockets.recv_exactly_into(sock, view, deadline))
            except BaseException:
                incoming.abort()
                raise
            try:
                tiers.append(incoming.store())
            except TierCacheError as refused:  # this chunk was read whole
                self._refuse(sock, refused, entries[index + 1:])
        sockets.send_all(sock, data_channel.status(data_channel.OK), data_channel.tiers_answer(tiers))

    # -- GET --------------------------------------------------------------------------------------------------------

    def _get(self, sock: socket.socket, tenant: Tenant, request: data_channel.Request) -> None:
        try:
            keys = self.intake.checked_keys(tenant, request.namespace, request.keys)
        except TierCacheError as refused:
            self._refuse(sock, refused)
        sockets.send_all(sock, data_channel.status(data_channel.OK))
        try:
            for batch in batches(keys):
                served = self.intake.serve(batch)
                try:
                    for item in served:
                        _send_item(sock, item)
                finally:
                    Served.release_all(served)
        except data_channel.ConnectionBroken:
            raise
        except Exception as exc:  # a tier failed half-way: the client expects an item, so only closing is left
            raise _OutOfStep() from exc


def _send_item(sock: socket.socket, served: Served | None) -> None:
    """One ITEM, its payload sent from where it lies (the arena's pages in place, or the store's copy)."""
    if served is None:
        sockets.send_all(sock, data_channel.item(False))
        return
    try:
        sockets.send_all(sock, data_channel.item(True, served.size_bytes, served.tier), *served.views())
    finally:
        served.release()


class _OutOfStep(Exception):
    """A get failed after its OK status: the connection must close without another word."""


class _Refused(Exception):
    """A request answered with an error status; the connection stays open for the next one."""

    def __init__(self, error: TierCacheError) -> None:
        super().__init__(str(error))
        self.error = error


def _remove_stale_socket(path: str) -> None:
    """A socket file left by an earlier server at this path (never any other kind of file)."""
    try:
        if stat.S_ISSOCK(os.stat(path).st_mode):
            os.unlink(path)
    except FileNotFoundError:
        pass
