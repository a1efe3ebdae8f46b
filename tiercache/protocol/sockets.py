"""Reading and writing a stream socket (TCP, unix; TLS too) for the data channel's two ends
(tiercache.protocol.data_channel is its wire format): exact reads straight into a caller's buffer, sends in slices,
and the deadlines that bound what a peer that trickles bytes can hold. Errors are tiercache's: TimedOut when the peer
stalls or is too slow, ConnectionBroken when the connection ends or fails."""

from __future__ import annotations

import contextlib
import socket
import time

from tiercache.errors import ConnectionBroken, TimedOut

SEND_SLICE_BYTES = 1 << 20


def recv_exactly_into(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill `view` from the socket (the kernel copies straight into it); ConnectionBroken at an early end. Each read
    waits up to the socket's timeout, and not much past `deadline` (time.monotonic()), which bounds them all: a peer
    that trickles a byte now and then cannot hold the read (and what it holds) for longer."""
    idle_s = timeout_s = sock.gettimeout()
    try:
        while view:
            if deadline is not None:
                timeout_s = _wait_at_most(sock, timeout_s, deadline)
            try:
                n = sock.recv_into(view)
            except TimeoutError:
                raise TimedOut("data channel: the peer sent nothing within the timeout, or too little by the "
                               "deadline") from None
            except (OSError, ValueError) as exc:  # ValueError: the socket was closed under us (server shutdown)
                raise ConnectionBroken(f"data channel: {exc or type(exc).__name__}") from None
            if not n:
                raise ConnectionBroken("data channel closed by the peer")
            view = view[n:]
    finally:
        if timeout_s != idle_s:
            with contextlib.suppress(OSError):
                sock.settimeout(idle_s)


_DEADLINE_SLACK_S = 0.1  # how far past its deadline a read may wait (settimeout costs two fcntl calls: not per read)


def _wait_at_most(sock: socket.socket, timeout_s: float | None, deadline: float) -> float | None:
    """The socket's timeout for the next read, lowered to what is left before `deadline` once that is less (within
    _DEADLINE_SLACK_S); TimedOut when nothing is left."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimedOut("data channel: the peer sent too slowly")
    if timeout_s is None or left < timeout_s - _DEADLINE_SLACK_S:
        sock.settimeout(left)
        return left
    return timeout_s


def recv_exactly(sock: socket.socket, size: int, deadline: float | None = None) -> bytearray:
    buffer = bytearray(size)
    recv_exactly_into(sock, memoryview(buffer), deadline)
    return buffer


def send_all(sock: socket.socket, *parts) -> None:
    """Send every part, SEND_SLICE_BYTES per call: a socket timeout bounds one `sendall` as a whole, so slices keep
    it a bound on a stall (no progress for that long), not on how long a slow but moving reader may take."""
    try:
        for part in parts:
            view = memoryview(part).cast("B")
            for start in range(0, len(view), SEND_SLICE_BYTES):
                sock.sendall(view[start:start + SEND_SLICE_BYTES])
    except TimeoutError:
        raise TimedOut("data channel: the peer read nothing within the timeout") from None
    except (OSError, ValueError) as exc:
        raise ConnectionBroken(f"data channel: {exc or type(exc).__name__}") from None


def drain(sock: socket.socket, size: int, scratch: memoryview, deadline: float | None = None) -> None:
    """Read and drop `size` bytes (payloads of a refused request, so the connection stays in step), all of them by
    `deadline`: a peer that trickles them cannot hold the connection (and its thread) for longer."""
    while size:
        step = min(size, len(scratch))
        recv_exactly_into(sock, scratch[:step], deadline)
        size -= step


def recv_growing(sock: socket.socket, size: int, deadline: float, first_bytes: int = 64 << 10) -> bytearray:
    """`size` bytes in a buffer that grows as they arrive (`first_bytes`, then doubling): memory is committed for
    what a peer sends, never for what it declares (a declared 16 MiB header block sent a byte at a time used to hold
    a zero-filled 16 MiB buffer per connection; tests/server/test_data_channel.py, `test_hostile_clients_...`)."""
    buffer = bytearray(min(size, first_bytes))
    filled = 0
    while True:
        with memoryview(buffer) as view:
            recv_exactly_into(sock, view[filled:], deadline)
        filled = len(buffer)
        if filled == size:
            return buffer
        buffer += bytes(min(size - filled, filled))


def payload_deadline(size_bytes: int, idle_s: float) -> float:
    """When a payload of `size_bytes` (a chunk, or what a refused request drains) must have arrived: at least 1 MiB
    per idle timeout, and one idle timeout at the least. A client that trickles bytes cannot hold what the payload
    holds (a reservation in the arena, a record, a connection's thread) for long."""
    return time.monotonic() + idle_s * max(1.0, size_bytes / (1 << 20))
