"""The error hierarchy, and the one table of what each public error is called on the wire.

An error's class is its category, and the category alone decides what happens to it (never its message):
- `Unavailable` and below: trying the same call again may succeed. The client retries these and nothing else
  (`tiercache.client.client.Client._call`).
- `ConnectionBroken` and below: the server was not reached, or the connection failed mid-exchange, so nothing says
  the server saw the request. Only these open the client's circuit breaker: an UNAVAILABLE the server answered itself
  (a tier it needed is down) proves it is there.
- `Busy`: one of the server's paths is at its limits; the client sends that call by another path.
- Internal errors (`ChunkCorrupt`, `TierWriteFailed`, `TierDown`, ...) never leave the server.
"""

from typing import NamedTuple


class TierCacheError(Exception):
    """Base of every error tiercache raises on purpose."""


class InvalidArgument(TierCacheError):
    """Malformed key, namespace, size or config value: the caller must change the request."""


class NotFound(TierCacheError):
    """The requested chunk is in no tier."""


class CapacityExceeded(TierCacheError):
    """The chunk is larger than any tier can hold, or a quota is spent."""


class Busy(CapacityExceeded):
    """The server is at its data-connection limits: the client sends this call over gRPC instead. (Requests in flight
    are counted once for both transports, so over that limit the refusal is a plain CapacityExceeded.)"""


class Unavailable(TierCacheError):
    """A backend (or the server) cannot be reached right now; retrying later may succeed."""


class ConnectionBroken(Unavailable):
    """The server could not be reached, or the connection closed or failed mid-exchange (the peer went away, a
    timeout passed, malformed bytes). The connection is unusable; a client may retry on a new one."""


class ConnectFailed(ConnectionBroken):
    """No connection could be opened (refused, unreachable, TLS handshake failed)."""


class TimedOut(ConnectionBroken):
    """The peer made no progress within the socket's timeout, too little before a deadline, or a call's deadline
    passed without an answer."""


class CircuitOpen(Unavailable):
    """The client's circuit breaker is open: the server did not answer recently, so the call was not even tried
    (see tiercache.client.breaker). Client side only."""


class Unauthenticated(TierCacheError):
    """The call carries no bearer token, or one no tenant owns."""


class PermissionDenied(TierCacheError):
    """The caller's tenant may not do this: another tenant's namespace, or a path its tenant entry does not allow."""


class ConfigError(InvalidArgument):
    """A configuration value is unusable. The CLI prints its message on one line and exits non-zero."""


class StartCancelled(TierCacheError):
    """The server was asked to stop (SIGTERM) while it was still preparing its tiers. Internal to `tiercache serve`,
    which logs it and exits 0 without serving."""


class ChunkCorrupt(TierCacheError):
    """A stored record failed its checksum or header checks. Internal: the store turns it into a miss."""


class TierWriteFailed(TierCacheError):
    """The tier's medium refused a write it had room for on paper (ENOSPC from a shared filesystem, EIO).

    Internal: the record goes to the next tier, and the failure is counted as an error of the tier. (A tier with no
    room says so in the Room it answers, not with an error: tiercache.tiers.base.)
    """


class TierDown(TierCacheError):
    """A tier's backend is unreachable. Internal: reads become misses, writes fall through to other tiers."""


class WireCode(NamedTuple):
    """How one error is called on the wire: a gRPC status (by name: this module imports no gRPC), the data
    channel's u8 status code, and the HTTP status of the pod query's HTTP endpoint (server.query_http)."""

    error: type[TierCacheError]
    grpc_status: str
    data_code: int
    http_status: int


# The one mapping between errors and the codes that carry them; protocol.wire, protocol.data_channel and
# server.query_http only look codes up here (tests/test_architecture.py fails when another module names a code of this
# table). An error not listed goes by its nearest listed base class (ConnectionBroken is UNAVAILABLE, 4); a code names
# the first error listed with it (RESOURCE_EXHAUSTED is CapacityExceeded, UNAVAILABLE is Unavailable); anything else
# is INTERNAL. The data channel has no deadline status: a deadline that passes there closes the connection.
WIRE_CODES: tuple[WireCode, ...] = (
    WireCode(InvalidArgument, "INVALID_ARGUMENT", 1, 400),
    WireCode(NotFound, "NOT_FOUND", 2, 404),
    WireCode(CapacityExceeded, "RESOURCE_EXHAUSTED", 3, 429),
    WireCode(Busy, "RESOURCE_EXHAUSTED", 8, 503),
    WireCode(Unavailable, "UNAVAILABLE", 4, 503),
    WireCode(TimedOut, "DEADLINE_EXCEEDED", 4, 504),
    WireCode(Unauthenticated, "UNAUTHENTICATED", 5, 401),
    WireCode(PermissionDenied, "PERMISSION_DENIED", 6, 403),
)
_BY_ERROR = {row.error: row for row in WIRE_CODES}


def wire_code(error: BaseException) -> WireCode | None:
    """The codes of an error: its class's row, else its nearest listed base class's; None for an unexpected error
    (INTERNAL on either wire)."""
    return next((_BY_ERROR[kind] for kind in type(error).__mro__ if kind in _BY_ERROR), None)
