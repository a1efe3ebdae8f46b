"""The data channel's client half: remote puts and gets over pooled sockets to the server's data port (wire format:
tiercache.protocol.data), payloads sent from and received into the caller's buffers with no copy in Python.

A connection opens with the client's bearer token and, when the gRPC channel uses TLS, the same TLS (CA, client
certificate, server name). One request at a time per connection; the client keeps up to `pool_size` idle ones.
"""

from __future__ import annotations

import socket
import ssl
import threading
import time
from typing import Callable, NamedTuple, Sequence

from tiercache.errors import InvalidArgument, TierCacheError
from tiercache.protocol import data
from tiercache.record.encoding import ChunkMeta

IDLE_CLOSE_S = 240.0  # a pooled connection idle this long is closed before the server's keepalive (300 s) does


class ConnectFailed(data.ConnectionBroken):
    """No connection could be opened (refused, unreachable, TLS handshake failed)."""


class Received(NamedTuple):
    data: memoryview | bytearray  # the caller's buffer, filled, or a new bytearray
    tier: str


class DataChannel:
    def __init__(self, address: str | tuple[str, int], *, token: str | None,
                 tls: ssl.SSLContext | None = None, server_name: str | None = None, pool_size: int = 4) -> None:
        """`address`: (host, port), or a unix socket path."""
        self.address = address
        self._hello = data.hello(token)
        self._tls = tls
        self._server_name = server_name
        self._pool_size = pool_size
        self._idle: list[tuple[socket.socket, float]] = []
        self._lock = threading.Lock()

    def put(self, namespace: str, chunks: Sequence[tuple[bytes, memoryview, ChunkMeta]], timeout_s: float) -> list[str]:
        """Store chunks; per chunk, the tier that holds it."""
        request = data.put_request(namespace, [data.PutEntry(key, len(payload), meta) for key, payload, meta in chunks])

        def exchange(sock: socket.socket) -> list[str]:
            try:
                data.send_all(sock, request, *(payload for _, payload, _ in chunks))
            except data.ConnectionBroken:
                _raise_answer(sock)  # a server that refused and closed may have said why
                raise
            data.read_status(sock)
            return data.read_tiers(sock, len(chunks))
        return self._exchange(exchange, timeout_s)

    def get(self, namespace: str, keys: Sequence[bytes], outs: Sequence[memoryview | None],
            timeout_s: float) -> list[Received | None]:
        """Per key: its bytes (in `outs[i]` when given, else a new bytearray) and tier, or None for a miss."""
        request = data.get_request(namespace, keys)
        deadline = time.monotonic() + timeout_s

        def exchange(sock: socket.socket) -> list[Received | None]:
            data.send_all(sock, request)
            data.read_status(sock)
            results: list[Received | None] = []
            too_small = None
            for out in outs:
                sock.settimeout(max(deadline - time.monotonic(), 0.001))
                found, size, tier_bytes = data.ITEM.unpack(data.recv_exactly(sock, data.ITEM.size))
                tier = bytes(data.recv_exactly(sock, tier_bytes)).decode()
                if not found:
                    results.append(None)
                elif out is not None and len(out) < size:
                    data.drain(sock, size, memoryview(bytearray(min(size, 1 << 20))))
                    too_small = InvalidArgument(f"a {len(out)}-byte buffer cannot hold a {size}-byte chunk")
                    results.append(None)
                else:
                    target = out[:size] if out is not None else bytearray(size)
                    data.recv_exactly_into(sock, memoryview(target))
                    results.append(Received(target, tier))
            if too_small is not None:
                raise too_small
            return results
        return self._exchange(exchange, timeout_s)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for sock, _ in idle:
            sock.close()

    # -- connections ------------------------------------------------------------------------------------------------

    def _exchange(self, exchange: Callable[[socket.socket], object], timeout_s: float):
        """Run one request on a pooled connection (or a new one). A pooled connection that turns out closed (the
        server ended it while idle, or restarted) is replaced once at no cost to the caller."""
        deadline = time.monotonic() + timeout_s
        sock = self._pooled()
        if sock is not None:
            try:
                return self._on(sock, exchange, deadline)
            except data.ConnectionBroken:
                pass
        return self._on(self._connect(deadline), exchange, deadline)

    def _on(self, sock: socket.socket, exchange, deadline: float):
        try:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            result = exchange(sock)
        except data.ConnectionBroken:
            sock.close()
            raise
        except TierCacheError:
            # The server answered the request with an error (or a too-small buffer was drained): the connection is
            # still in step. (One the server closed after answering malformed input is replaced on its next use.)
            self._give_back(sock)
            raise
        except BaseException:
            sock.close()
            raise
        self._give_back(sock)
        return result

    def _pooled(self) -> socket.socket | None:
        now = time.monotonic()
        with self._lock:
            while self._idle:
                sock, since = self._idle.pop()
                if now - since < IDLE_CLOSE_S:
                    return sock
                sock.close()
        return None

    def _give_back(self, sock: socket.socket) -> None:
        with self._lock:
            if len(self._idle) < self._pool_size:
                self._idle.append((sock, time.monotonic()))
                return
        sock.close()

    def _connect(self, deadline: float) -> socket.socket:
        timeout = max(deadline - time.monotonic(), 0.001)
        try:
            if isinstance(self.address, str):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(timeout)
                try:
                    sock.connect(self.address)
                except BaseException:
                    sock.close()
                    raise
            else:
                sock = socket.create_connection(self.address, timeout=timeout)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:
                sock = self._tls.wrap_socket(sock, server_hostname=self._server_name or self.address[0])
        except (OSError, ssl.SSLError) as exc:
            raise ConnectFailed(f"cannot open the data channel to {self._where()}: {exc}") from None
        try:
            data.send_all(sock, self._hello)
            data.read_status(sock)  # Unauthenticated, or a connection limit: the server's own words
        except BaseException:
            sock.close()
            raise
        return sock

    def _where(self) -> str:
        return self.address if isinstance(self.address, str) else f"{self.address[0]}:{self.address[1]}"


def _raise_answer(sock: socket.socket) -> None:
    """After a failed send: raise the error status the server sent before closing, if it sent one."""
    try:
        sock.settimeout(0.5)
        data.read_status(sock)
    except data.ConnectionBroken:
        return
    except TierCacheError:
        raise
