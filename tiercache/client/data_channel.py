"""The data channel's client end, a payload path (client.payload): remote puts and gets over pooled sockets to the
server's data port (its end: tiercache.server.data_channel; wire format: tiercache.protocol.data_channel), payloads
sent from and received into the caller's buffers with no copy in Python.

A connection opens with the client's bearer token and, when the gRPC channel uses TLS, the same TLS (CA, client
certificate, server name). One request at a time per connection; the client keeps up to `pool_size` idle ones.
"""

from __future__ import annotations

import ctypes
import functools
import socket
import ssl
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

from tiercache.client.payload import Chunk, Fetched
from tiercache.config import DEFAULT_MAX_CHUNK_BYTES
from tiercache.errors import ConnectFailed, ConnectionBroken, InvalidArgument, TierCacheError, TimedOut
from tiercache.protocol import data_channel, sockets

IDLE_CLOSE_S = 0.8 * data_channel.KEEPALIVE_S  # a pooled connection idle this long is closed before the server does
# One TCP stream tops out below what the cores can move (loopback, 2-vCPU machine: ~4.3 GB/s for one, ~6 for two):
# a batch is cut into up to DEFAULT_STREAMS stripes of at least STRIPE_MIN_BYTES, each on its own connection. Four
# beat two and one there (4 MiB chunks against redis-py in the same rounds: ~1.6x, ~1.4x, ~1.1x).
DEFAULT_STREAMS = 4
STRIPE_MIN_BYTES = 4 << 20


class DataChannelPath:
    """The client end of the data channel (the server's is DataChannelListener): a PayloadPath."""

    def __init__(self, address: str | tuple[str, int], *, token: str | None, client_id: str = "",
                 tls: ssl.SSLContext | None = None, server_name: str | None = None,
                 streams: int = DEFAULT_STREAMS, max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
                 engine_blocks: bool = True) -> None:
        """`address`: (host, port), or a unix socket path. `streams`: connections one batch may use at once.
        `engine_blocks`: the server takes chunks' tokens and engine hashes (its Attach says so); else they are left
        out, since a server older than them refuses the whole put."""
        self.address = address
        self.max_chunk_bytes = max_chunk_bytes
        self.engine_blocks = engine_blocks
        self._hello = data_channel.hello(token, client_id)
        self._tls = tls
        self._server_name = server_name
        self._streams = max(streams, 1)
        self._pool_size = self._streams  # idle connections kept (each holds a thread on the server)
        self._executor: ThreadPoolExecutor | None = None
        self._idle: list[tuple[socket.socket, float]] = []
        self._lock = threading.Lock()

    def put(self, namespace: str, chunks: Sequence[Chunk], deadline: float) -> list[str]:
        """Store chunks; per chunk, the tier that holds it. A large batch is striped over parallel connections (the
        deadline bounds every stripe, however long it waits for a thread)."""
        stripes = _stripes([len(payload) for _, payload, _ in chunks], self._streams)
        return self._in_parallel([functools.partial(self._put_stripe, namespace, chunks[s], deadline)
                                  for s in stripes])

    def get(self, namespace: str, keys: Sequence[bytes], outs: Sequence[memoryview | None],
            deadline: float) -> list[Fetched | None]:
        """Per key: its bytes (in `outs[i]` when given, else new bytes) and tier, or None for a miss. Several
        keys are striped over parallel connections."""
        stripes = _stripes([STRIPE_MIN_BYTES] * len(keys), self._streams)
        return self._in_parallel([functools.partial(self._get_stripe, namespace, keys[s], outs[s], deadline)
                                  for s in stripes])

    def _in_parallel(self, calls: list[Callable[[], list]]) -> list:
        """Run each stripe on its own connection, the first on the caller's thread; results in order. Every stripe
        finishes before the first error is raised (no connection is left mid-request)."""
        if len(calls) == 1:
            return calls[0]()
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=self._streams - 1,
                                                    thread_name_prefix="tiercache-data")
            executor = self._executor
        others = [_submitted(executor, call) for call in calls[1:]]
        outcomes: list = []
        for step in [calls[0], *others]:
            try:
                outcomes.append(step())
            except BaseException as exc:  # noqa: BLE001 - raised below, once every stripe is done
                outcomes.append(exc)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        return [item for stripe in outcomes for item in stripe]

    def _put_stripe(self, namespace: str, chunks, deadline: float) -> list[str]:
        """One stripe: one request per MAX_BATCH chunks."""
        if len(chunks) > data_channel.MAX_BATCH:
            return [tier for start in range(0, len(chunks), data_channel.MAX_BATCH)
                    for tier in self._put_stripe(namespace, chunks[start:start + data_channel.MAX_BATCH], deadline)]
        entries = [data_channel.PutEntry(key, len(payload), meta if self.engine_blocks or not meta.tokens
                                         else meta._replace(tokens=b"", engine_hash=0))
                   for key, payload, meta in chunks]
        request = data_channel.put_request(namespace, entries)

        def exchange(sock: socket.socket) -> list[str]:
            try:
                sockets.send_all(sock, request, *(payload for _, payload, _ in chunks))
            except ConnectionBroken:
                _raise_answer(sock)  # a server that refused and closed may have said why
                raise
            data_channel.read_status(sock)
            return data_channel.read_tiers(sock, len(chunks))
        return self._exchange(exchange, deadline)

    def _get_stripe(self, namespace: str, keys: Sequence[bytes], outs: Sequence[memoryview | None],
                    deadline: float) -> list[Fetched | None]:
        if len(keys) > data_channel.MAX_BATCH:
            return [item for start in range(0, len(keys), data_channel.MAX_BATCH)
                    for item in self._get_stripe(namespace, keys[start:start + data_channel.MAX_BATCH],
                                                 outs[start:start + data_channel.MAX_BATCH], deadline)]
        request = data_channel.get_request(namespace, keys)

        def exchange(sock: socket.socket) -> list[Fetched | None]:
            sockets.send_all(sock, request)
            data_channel.read_status(sock)
            results: list[Fetched | None] = []
            too_small = None
            for out in outs:
                sock.settimeout(max(deadline - time.monotonic(), 0.001))
                found, size, tier = data_channel.read_item(sock, self.max_chunk_bytes)
                if not found:
                    results.append(None)
                elif out is not None and len(out) < size:
                    sockets.drain(sock, size, memoryview(bytearray(min(size, 1 << 20))))
                    too_small = InvalidArgument(f"a {len(out)}-byte buffer cannot hold a {size}-byte chunk")
                    results.append(None)
                elif out is not None:
                    sockets.recv_exactly_into(sock, out[:size])
                    results.append(Fetched(out[:size], tier))
                else:
                    chunk, view = _new_bytes(size)
                    sockets.recv_exactly_into(sock, view)
                    view.release()
                    results.append(Fetched(chunk, tier))
            if too_small is not None:
                raise too_small
            return results
        return self._exchange(exchange, deadline)

    def pooled(self) -> list[socket.socket]:
        """The idle connections kept for the next request, most recent last (operators, tests)."""
        with self._lock:
            return [sock for sock, _ in self._idle]

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
        for sock, _ in idle:
            sock.close()

    # -- connections ------------------------------------------------------------------------------------------------

    def _exchange(self, exchange: Callable[[socket.socket], object], deadline: float):
        """Run one request on a pooled connection (or a new one). A pooled connection that turns out closed (the
        server ended it while idle, or restarted) is replaced once at no cost to the caller; one that timed out is
        not (the server is slow or hung: a new connection would only wait again)."""
        sock = self._pooled()
        if sock is not None:
            try:
                return self._on(sock, exchange, deadline)
            except TimedOut:
                raise
            except ConnectionBroken:
                pass
        return self._on(self._connect(deadline), exchange, deadline)

    def _on(self, sock: socket.socket, exchange, deadline: float):
        try:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            result = exchange(sock)
        except ConnectionBroken:
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
            sockets.send_all(sock, self._hello)
            data_channel.read_status(sock)  # Unauthenticated, or a connection limit: the server's own words
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
        data_channel.read_status(sock)
    except ConnectionBroken:
        return
    except TierCacheError:
        raise


def _submitted(executor: ThreadPoolExecutor, call: Callable[[], list]) -> Callable[[], list]:
    """The call running on the executor (its result, when asked); or, once close() has shut the executor down (the
    client dropped a channel another thread is still using), the call itself, run inline when asked."""
    try:
        return executor.submit(call).result
    except RuntimeError:
        return call


def _stripes(sizes: Sequence[int], streams: int) -> list[slice]:
    """Contiguous slices of a batch, balanced by bytes: at most `streams`, each of at least STRIPE_MIN_BYTES (a
    small batch is one stripe: a thread handoff costs more than it saves)."""
    total = sum(sizes)
    count = max(min(streams, len(sizes), total // STRIPE_MIN_BYTES), 1)
    stripes, start, done = [], 0, 0
    for index, size in enumerate(sizes):
        done += size
        if len(stripes) < count - 1 and index + 1 < len(sizes) and done * count >= total * (len(stripes) + 1):
            stripes.append(slice(start, index + 1))
            start = index + 1
    stripes.append(slice(start, len(sizes)))
    return stripes


# Prototypes of our own (setting argtypes on ctypes.pythonapi's shared function objects would change them for everyone).
_bytes_of_size = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_ssize_t)(
    ("PyBytes_FromStringAndSize", ctypes.pythonapi))
_bytes_buffer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object)(("PyBytes_AsString", ctypes.pythonapi))


def _new_bytes(size: int) -> tuple[bytes, memoryview]:
    """A new, uninitialized `bytes` of `size` and a writable view of its buffer, to receive a chunk straight into (as
    CPython's own socket.recv fills the bytes it returns): `bytearray(size)` would zero the memory first, a pass over
    every byte that costs a quarter of a receive. Documented C API only (PyBytes_FromStringAndSize with NULL leaves
    the contents for the caller to fill). The view must be released before the bytes are handed on."""
    chunk = _bytes_of_size(None, size)
    if not size:
        return chunk, memoryview(bytearray())
    return chunk, memoryview((ctypes.c_char * size).from_address(_bytes_buffer(chunk))).cast("B")
