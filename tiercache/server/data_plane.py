"""The data channel's server side: remote clients' chunk payloads over a plain TCP (or unix) socket, received into
and sent from the arena's pages in place (wire format and the reasons for it: tiercache.protocol.data).

One thread per connection, blocking I/O: a thread waits in `recv_into` / `sendall` with the GIL released, which is
what moves bytes fastest from Python. A client that stalls holds only its own connection's thread, never a shared
worker: a read or write mid-request that makes no progress for `server.stream_idle_timeout_s` ends the connection,
and a chunk's payload must arrive at 1 MiB per idle timeout at least (what a trickling client holds in the arena is
bounded in time); between requests a connection may idle DATA_KEEPALIVE_S. Connections are bounded in all
(`server.max_data_connections`) and per peer host (`server.max_data_connections_per_peer`), so threads are too;
requests in flight count against the stream limits of their peer and tenant, like gRPC streams (a refused one is
answered RESOURCE_EXHAUSTED, and the client sends it over gRPC instead).

Requests are checked exactly like their gRPC twins (servicer.TierCacheServicer.Put / Get): the caller's tenant from
the same bearer token, the namespace it owns, key and size limits, its quota.
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
from typing import NamedTuple, NoReturn

from tiercache.config import Config
from tiercache.errors import Busy, CapacityExceeded, TierCacheError
from tiercache.protocol import data
from tiercache.protocol.wire import AUTHORIZATION, checked_meta, status_for
from tiercache.record import encoding
from tiercache.record.keys import ChunkKey
from tiercache.server.auth import Tenant, TenantTable
from tiercache.server.limits import Counts, StreamLimits, check_chunk_size
from tiercache.server.metrics import Metrics
from tiercache.store.same_host import WriteGrant
from tiercache.store.tiered import TieredStore

log = logging.getLogger("tiercache.server")

DATA_KEEPALIVE_S = 300.0  # an idle connection between requests is closed after this (clients pool connections)
_SCRATCH_BYTES = 1 << 20  # for draining the payloads of a refused request
_ACCEPT_BACKLOG = 128


class _Incoming(NamedTuple):
    """Where one put chunk's payload is received: arena pages reserved for it, or a record buffer of its own."""

    views: list[memoryview]
    grant: WriteGrant | None
    record: bytearray | None


class DataPlane:
    def __init__(self, config: Config, store: TieredStore, metrics: Metrics, tenants: TenantTable,
                 tls: ssl.SSLContext | None) -> None:
        cfg = config.server
        self.store = store
        self.metrics = metrics
        self.tenants = tenants
        self._tls = tls
        self._max_chunk_bytes = cfg.max_chunk_bytes
        self._idle_s = cfg.stream_idle_timeout_s
        # Over a limit the refusal is Busy: the client sends that call over gRPC instead.
        self._all = Counts(cfg.max_data_connections, "data connections open (server.max_data_connections)",
                           Busy)
        self._connections_per_peer = Counts(cfg.max_data_connections_per_peer,
                                            "data connections open (server.max_data_connections_per_peer)", Busy)
        self._streams = StreamLimits(cfg.max_streams_per_peer, cfg.max_streams_per_tenant, Busy)  # in flight
        self._listeners: list[socket.socket] = []
        self._connections: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self.port = 0
        self.unix_socket: str | None = None

    # -- listening --------------------------------------------------------------------------------------------------

    def start(self, host: str, port: int, unix_socket: str | None) -> "DataPlane":
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
                    sock = self._tls.wrap_socket(conn, server_side=True)  # the handshake, within the idle time
                    self._track(conn, sock)
                token = data.read_hello(sock, deadline=time.monotonic() + self._idle_s)
                tenant = self.tenants.authenticate([(AUTHORIZATION, f"Bearer {token}")] if token else [])
                data.send_all(sock, data.status(data.OK))
                self._requests(sock, tenant, peer)
        except _OutOfStep as exc:  # failed after answering OK: nothing more can be said on this connection
            log.log(logging.WARNING if isinstance(exc.__cause__, TierCacheError) else logging.ERROR,
                    "data connection from %s: a get failed half-way", peer, exc_info=exc.__cause__)
        except data.ConnectionBroken as exc:
            log.debug("data connection from %s ended: %s", peer, exc)
        except (ssl.SSLError, OSError) as exc:
            log.debug("data connection from %s failed: %s", peer, exc)
        except TierCacheError as exc:  # refused before any request (token, limits) or malformed: answer, then close
            self._answer_and_close(sock, data.code_for(exc), str(exc))
        except Exception:  # noqa: BLE001 - one connection's bug must not take the server's others down
            log.exception("data connection from %s failed", peer)
            self._answer_and_close(sock, data.INTERNAL, "internal error")
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
            data.send_all(sock, data.status(code, message))
        except data.ConnectionBroken:
            pass

    def _requests(self, sock: socket.socket, tenant: Tenant, peer: str) -> None:
        scratch = memoryview(bytearray(_SCRATCH_BYTES))
        while not self._stopping.is_set():
            sock.settimeout(DATA_KEEPALIVE_S)
            request = data.read_request(sock, idle_s=self._idle_s)
            if request is None:
                return
            started = time.perf_counter()
            name = "DataPut" if request.op == data.OP_PUT else "DataGet"
            code = "OK"
            try:
                with self._in_flight(sock, request, peer, tenant, scratch):
                    if request.op == data.OP_PUT:
                        self._put(sock, tenant, request, scratch)
                    else:
                        self._get(sock, tenant, request)
            except _Refused as refused:
                code = status_for(refused.error).name
            except BaseException as exc:
                code = "CANCELLED" if isinstance(exc, data.ConnectionBroken) else status_for(exc).name
                raise
            finally:
                self.metrics.rpc_seconds.labels(name, code).observe(time.perf_counter() - started)

    @contextlib.contextmanager
    def _in_flight(self, sock, request: data.Request, peer: str, tenant: Tenant, scratch: memoryview):
        """Count the request against its peer's and tenant's stream limits while it runs; over them, refuse it."""
        with contextlib.ExitStack() as held:
            try:
                held.enter_context(self._streams.stream(peer, tenant.name))
            except Busy as refused:
                if request.op == data.OP_PUT:
                    data.drain(sock, sum(entry.size for entry in request.entries), scratch)
                self._refuse(sock, refused)
            yield

    def _refuse(self, sock: socket.socket, error: TierCacheError) -> NoReturn:
        data.send_all(sock, data.status(data.code_for(error), str(error)))
        raise _Refused(error)

    # -- PUT --------------------------------------------------------------------------------------------------------

    def _put(self, sock: socket.socket, tenant: Tenant, request: data.Request, scratch: memoryview) -> None:
        entries = request.entries
        sizes = [entry.size for entry in entries]
        # Not drained when it fails: the announced bytes could be anything. Malformed input closes the connection.
        check_chunk_size(max(sizes, default=0), self._max_chunk_bytes)
        try:
            keys = tenant.checked_keys(request.namespace, request.keys)
            metas = [checked_meta(entry.meta) for entry in entries]
            tenant.check_room(self.store, sum(sizes))
        except TierCacheError as refused:
            data.drain(sock, sum(sizes), scratch)
            self._refuse(sock, refused)
        tiers = []
        for index, (key, meta, size) in enumerate(zip(keys, metas, sizes)):
            try:
                incoming = self._incoming(key, meta, size)
            except TierCacheError as refused:  # nothing of this chunk read yet
                data.drain(sock, sum(sizes[index:]), scratch)
                self._refuse(sock, refused)
            # At least 1 MiB per idle timeout: a client that trickles bytes cannot hold the reservation for long.
            deadline = time.monotonic() + self._idle_s * max(1.0, size / (1 << 20))
            try:
                for view in incoming.views:
                    data.recv_exactly_into(sock, view, deadline)
            except BaseException:
                if incoming.grant is not None:
                    self.store.same_host.abort(incoming.grant)
                raise
            try:
                tiers.append(self._store(key, meta, incoming))
            except TierCacheError as refused:  # this chunk was read whole
                data.drain(sock, sum(sizes[index + 1:]), scratch)
                self._refuse(sock, refused)
        data.send_all(sock, data.status(data.OK), data.tiers_answer(tiers))

    def _incoming(self, key: ChunkKey, meta: encoding.ChunkMeta, size: int) -> _Incoming:
        """Room for a chunk's payload: reserved arena pages when the arena takes it (received in place, no copy),
        else a record buffer of its own that the store places in any tier."""
        same_host = self.store.same_host
        if same_host is not None:
            try:
                grant = same_host.reserve(key, size, meta)
            except CapacityExceeded:
                pass
            else:
                return _Incoming(same_host.views(grant.payload), grant, None)
        record = bytearray(encoding.header_bytes(key, meta) + size)
        return _Incoming([memoryview(record)[len(record) - size:]], None, record)

    def _store(self, key: ChunkKey, meta: encoding.ChunkMeta, incoming: _Incoming) -> str:
        if incoming.grant is not None:
            return self.store.same_host.commit(incoming.grant)
        encoding.seal(incoming.record, key, meta)
        return self.store.put_record(key, incoming.record)

    # -- GET --------------------------------------------------------------------------------------------------------

    def _get(self, sock: socket.socket, tenant: Tenant, request: data.Request) -> None:
        try:
            keys = tenant.checked_keys(request.namespace, request.keys)
        except TierCacheError as refused:
            self._refuse(sock, refused)
        data.send_all(sock, data.status(data.OK))
        try:
            for key in keys:
                self._send_chunk(sock, key)
        except data.ConnectionBroken:
            raise
        except Exception as exc:  # a tier failed half-way: the client expects an item, so only closing is left
            raise _OutOfStep() from exc

    def _send_chunk(self, sock: socket.socket, key: ChunkKey) -> None:
        """One ITEM: from the arena's pages in place when the chunk is (or is promoted) there, else from the copy the
        store read."""
        same_host = self.store.same_host
        if same_host is None:
            found = self.store.get(key)
            if found is None:
                data.send_all(sock, data.item(False))
            else:
                data.send_all(sock, data.item(True, len(found.payload), found.tier), found.payload)
            return
        read = same_host.pin(key)
        if read is None:
            data.send_all(sock, data.item(False))
        elif not read.pinned:
            data.send_all(sock, data.item(True, read.size_bytes, read.tier), read.copy)
        else:
            try:
                data.send_all(sock, data.item(True, read.size_bytes, read.tier), *same_host.views(read.payload))
            finally:
                same_host.unpin(read)


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
