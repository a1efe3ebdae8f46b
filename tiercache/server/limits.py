"""How many requests one client, one host and one tenant may have in flight at once, whatever carries them.

A request in flight — a gRPC Put or Get stream, a data-channel request — holds its connection, a pin or a
reservation in the arena, or the record it is receiving, until it ends or its idle timeout ends it (a gRPC stream
whose client stops holds no thread; a data-channel request holds its connection's). These limits bound that, so one
misbehaving engine or tenant cannot take what the others need: over a limit a new request is refused at once
(RESOURCE_EXHAUSTED), everyone else is still served. One StreamLimits counts both transports (server.intake).

Three limits, nested. A *client* (one tiercache Client: an engine's worker, a CLI) may have
server.max_streams_per_client in flight: that is what keeps one stuck engine from locking out the other engines of
its node, which share its host address (tests/server/test_client_limits.py). A *host* may have
server.max_streams_per_peer, well above one client's, a bound on a node whatever its clients call themselves; a
*tenant* server.max_streams_per_tenant over all its hosts. A client names itself on every call (the `tiercache-client`
gRPC metadata, the data channel's hello); a caller that does not (grpcurl, an older client) is one client per
connection, its gRPC channel or its data connection.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from typing import Iterator

from tiercache.errors import CapacityExceeded


def client_of(peer: str, client_id: str) -> str:
    """The client a request is counted against: the id it names itself by on its host, else its connection (a gRPC
    peer string keeps the channel's port; the data channel passes a name for the connection)."""
    return f"{peer_host(peer)} {client_id}" if client_id else peer


def peer_host(peer: str) -> str:
    """The host of a peer, as both transports name it: a gRPC peer string ('ipv4:127.0.0.1:5000',
    'ipv6:[::1]:5000', 'unix:/path') or a data-channel peer's address ('127.0.0.1', '::1', 'unix'). Its port is not
    part of it (an engine opens many connections), and every unix-socket client is the one local host 'unix'."""
    kind, _, address = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return address.rsplit(":", 1)[0].strip("[]")
    if kind == "unix":
        return "unix"
    return peer


class Counts:
    """How many things each name holds open, at most `limit` per name. Thread-safe: the gRPC handlers count from the
    event loop, the data channel's listener (server.data_channel) from its connection threads."""

    def __init__(self, limit: int, what: str, refusal: type[CapacityExceeded] = CapacityExceeded) -> None:
        self.limit = limit
        self._what = what  # how a refusal names the limit, e.g. "requests in flight (server.max_streams_per_peer)"
        self._refusal = refusal
        self._open: Counter[str] = Counter()
        self._lock = threading.Lock()

    def held(self, name: str) -> int:
        """How many `name` holds open now."""
        with self._lock:
            return self._open[name]

    def snapshot(self) -> dict[str, int]:
        """How many each name holds open now (names holding none are absent)."""
        with self._lock:
            return dict(self._open)

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
    """Requests in flight (gRPC Put / Get streams and data-channel requests together) per client, per peer host and
    per tenant."""

    def __init__(self, per_client: int, per_peer: int, per_tenant: int) -> None:
        self.clients = Counts(per_client, "requests in flight (server.max_streams_per_client)")
        self.peers = Counts(per_peer, "requests in flight (server.max_streams_per_peer)")
        self.tenants = Counts(per_tenant, "requests in flight (server.max_streams_per_tenant)")

    @contextlib.contextmanager
    def stream(self, peer: str, tenant: str, client_id: str = "") -> Iterator[None]:
        """Count one request against its client (client_of: `client_id` on its host, else `peer` itself), its host
        and its tenant while the block runs; a refusal names the first limit it met and takes no slot of any."""
        host, client = peer_host(peer), client_of(peer, client_id)
        with self.clients.hold(client, f"client {client_id or peer!r} of {host}"), self.peers.hold(host, host), \
                self.tenants.hold(tenant, f"tenant {tenant!r}"):
            yield
