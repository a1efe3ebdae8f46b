"""How many Put / Get streams one host and one tenant may hold open at once.

The server is asyncio: a stream whose client stops reading or writing holds no thread, only its connection and the
chunk it was assembling (up to server.max_chunk_bytes), until its idle timeout ends it. These limits bound that memory
per host and per tenant, so one misbehaving engine or tenant cannot take what the others need: over a limit a new
stream is refused at once (RESOURCE_EXHAUSTED), everyone else is still served.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from typing import Iterator

from tiercache.config import format_size
from tiercache.errors import CapacityExceeded, InvalidArgument


def check_chunk_size(size_bytes: int, max_chunk_bytes: int) -> None:
    """InvalidArgument for a chunk past server.max_chunk_bytes, saying how to raise the limit: a model's state can be
    larger than the default (a Qwen3.6-27B state is 147 MiB), and the bare numbers did not say where the limit is set
    (issue 24)."""
    if size_bytes > max_chunk_bytes:
        raise InvalidArgument(f"chunk of {size_bytes} bytes ({format_size(size_bytes)}) exceeds the server's maximum "
                              f"of {max_chunk_bytes} ({format_size(max_chunk_bytes)}): raise it with `tiercache serve "
                              f"--max-chunk-size` (server.max_chunk_bytes)")


def peer_host(peer: str) -> str:
    """The host of a gRPC peer string ('ipv4:127.0.0.1:5000', 'ipv6:[::1]:5000', 'unix:/path'): its port is not
    part of it (an engine opens many connections)."""
    kind, _, address = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return address.rsplit(":", 1)[0]
    return peer


class Counts:
    """How many things each name holds open, at most `limit` per name. Thread-safe: the gRPC handlers count from the
    event loop, the data plane (server.data_plane) from its connection threads."""

    def __init__(self, limit: int, what: str, refusal: type[CapacityExceeded] = CapacityExceeded) -> None:
        self.limit = limit
        self._what = what  # how a refusal names the limit, e.g. "streams open (server.max_streams_per_peer)"
        self._refusal = refusal
        self._open: Counter[str] = Counter()
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def hold(self, name: str, label: str) -> Iterator[None]:
        """Count one more for `name` while the block runs; CapacityExceeded when it already holds `limit`."""
        with self._lock:
            if self._open[name] >= self.limit:
                raise self._refusal(f"{label} has {self._open[name]} {self._what}")
            self._open[name] += 1
        try:
            yield
        finally:
            with self._lock:
                self._open[name] -= 1
                if not self._open[name]:
                    del self._open[name]


class StreamLimits:
    """Open Put / Get streams per peer host and per tenant."""

    def __init__(self, per_peer: int, per_tenant: int, refusal: type[CapacityExceeded] = CapacityExceeded) -> None:
        self.peers = Counts(per_peer, "streams open (server.max_streams_per_peer)", refusal)
        self.tenants = Counts(per_tenant, "streams open (server.max_streams_per_tenant)", refusal)

    @contextlib.contextmanager
    def stream(self, peer: str, tenant: str) -> Iterator[None]:
        host = peer_host(peer)
        with self.peers.hold(host, host), self.tenants.hold(tenant, f"tenant {tenant!r}"):
            yield
