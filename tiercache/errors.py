"""The error hierarchy. Each class names one gRPC status code; the mapping lives in `tiercache.protocol.wire` alone."""


class TierCacheError(Exception):
    """Base of every error tiercache raises on purpose."""


class InvalidArgument(TierCacheError):
    """Malformed key, namespace, size or config value: the caller must change the request."""


class NotFound(TierCacheError):
    """The requested chunk is in no tier."""


class CapacityExceeded(TierCacheError):
    """The chunk is larger than any tier can hold, or a quota is spent."""


class Unavailable(TierCacheError):
    """A backend (or the server) cannot be reached right now; retrying later may succeed."""


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


class TierFull(TierCacheError):
    """A tier cannot make room for one record (too large for it, or every victim is pinned).

    Internal: the store then tries the next tier, and raises CapacityExceeded only when none can take it.
    `evicted` lists what the tier gave up while trying, so the store can still demote it.
    """

    def __init__(self, message: str, evicted: list | None = None) -> None:
        super().__init__(message)
        self.evicted = evicted or []


class TierWriteFailed(TierFull):
    """The tier's medium refused a write it had room for on paper (ENOSPC from a shared filesystem, EIO).

    Internal: handled like TierFull (the record goes to the next tier), and counted as an error of the tier.
    """


class TierDown(TierCacheError):
    """A tier's backend is unreachable. Internal: reads become misses, writes fall through to other tiers."""
