"""How many Put / Get streams one host and one tenant may hold open at once.

The server is asyncio: a stream whose client stops reading or writing holds no thread, only its connection and the
chunk it was assembling (up to server.max_chunk_bytes), until its idle timeout ends it. These limits bound that memory
per host and per tenant, so one misbehaving engine or tenant cannot take what the others need: over a limit a new
stream is refused at once (RESOURCE_EXHAUSTED), everyone else is still served.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Iterator

from tiercache.errors import CapacityExceeded


def peer_host(peer: str) -> str:
    """The host of a gRPC peer string ('ipv4:127.0.0.1:5000', 'ipv6:[::1]:5000', 'unix:/path'): its port is not
    part of it (an engine opens many connections)."""
    kind, _, address = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return address.rsplit(":", 1)[0]
    return peer


class StreamLimits:
    """Counts of open streams per peer host and per tenant. Used from the server's event loop only (no lock)."""

    def __init__(self, per_peer: int, per_tenant: int) -> None:
        self.per_peer = per_peer
        self.per_tenant = per_tenant
        self._peers: Counter[str] = Counter()
        self._tenants: Counter[str] = Counter()

    @contextlib.contextmanager
    def stream(self, peer: str, tenant: str) -> Iterator[None]:
        host = peer_host(peer)
        if self._peers[host] >= self.per_peer:
            raise CapacityExceeded(f"{host} has {self._peers[host]} streams open (server.max_streams_per_peer)")
        if self._tenants[tenant] >= self.per_tenant:
            raise CapacityExceeded(f"tenant {tenant!r} has {self._tenants[tenant]} streams open "
                                   f"(server.max_streams_per_tenant)")
        self._peers[host] += 1
        self._tenants[tenant] += 1
        try:
            yield
        finally:
            self._peers[host] -= 1
            self._tenants[tenant] -= 1
            if not self._peers[host]:
                del self._peers[host]
            if not self._tenants[tenant]:
                del self._tenants[tenant]
