"""Tenants: bearer tokens mapped to the namespaces a caller may touch, and the bytes it may hold.

KV bytes reveal the prompt that produced them, so one tenant must never read another's chunks. Every namespace a
salted connector builds ends with `record.keys.salt_suffix(salt)`; the server knows each tenant's salt and accepts a
namespace only when it carries the suffix of the tenant the call's token belongs to. A client therefore cannot forge
another tenant's keys: knowing the other namespace is not enough, it would need the other tenant's token.

The tenants file (YAML, mounted from a Secret) is the only place tokens live; the server never logs them:

    tenants:
      team-a:
        token_sha256: 9f86d0...     # `tiercache token-hash < token-file`; or `token: <plain text>` (the digest keeps
                                    # the file free of the secret)
        salt: a-long-random-string  # the same salt team-a's connectors are configured with
        quota_bytes: 20GiB          # optional: most bytes team-a may hold in this server's local tiers
        same_host: false            # optional: may map the shared-memory arena (it holds every tenant's chunks)
      ops:
        token_sha256: 2c26b4...
        admin: true                 # every namespace, every stat: for operators and the cache's own tools

Without a tenants file the server is open: every caller is the built-in `open` tenant (no checks, no quota).
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import yaml

from tiercache.config import parse_size, read_file, refuse_unknown
from tiercache.errors import CapacityExceeded, ConfigError, PermissionDenied, Unauthenticated
from tiercache.protocol.wire import AUTHORIZATION
from tiercache.record.keys import ChunkKey, salt_suffix, validate_key, validate_namespace

_BEARER = "bearer "
MIN_TOKEN_CHARS = 16
_TENANT_KEYS = {"token", "token_sha256", "salt", "quota_bytes", "same_host", "admin"}


@dataclass(frozen=True)
class Tenant:
    name: str
    suffix: str | None = None  # the namespace suffix its salt gives; None only for admin and open tenants
    quota_bytes: int | None = None
    same_host: bool = False
    admin: bool = False

    def owns(self, namespace: str) -> bool:
        return self.admin or (self.suffix is not None and namespace.endswith(self.suffix))

    def check_namespace(self, namespace: str) -> None:
        if not self.owns(namespace):
            # The namespace is the caller's own input, but the message stays vague about whose it might be.
            raise PermissionDenied(f"tenant {self.name!r} may not use this namespace: it must carry the tenant's "
                                   "salt (configure the connector with the tenant's salt)")

    def check_same_host(self) -> None:
        if not self.same_host:
            raise PermissionDenied(f"tenant {self.name!r} may not use the shared-memory path (same_host: false)")

    def checked_namespace(self, namespace: object) -> str:
        """A namespace from a request: valid, and this tenant's (checked once per request, not per key)."""
        validate_namespace(namespace)
        self.check_namespace(namespace)
        return namespace

    def checked_keys(self, namespace: object, keys: Iterable[object]) -> list[ChunkKey]:
        namespace = self.checked_namespace(namespace)
        return [ChunkKey(namespace, validate_key(k)) for k in keys]

    def check_room(self, store, adding_bytes: int) -> None:
        """Before storing `adding_bytes` more: within the tenant's quota? (`store` counts what the tenant holds:
        TieredStore.held_bytes; a store call.) Concurrent puts of one tenant may overshoot by their own sizes."""
        if self.quota_bytes is not None:
            self.check_quota(store.held_bytes(self.owns), adding_bytes)

    def check_quota(self, held_bytes: int, adding_bytes: int) -> None:
        """Raise when storing `adding_bytes` more would take the tenant past its quota."""
        if self.quota_bytes is not None and held_bytes + adding_bytes > self.quota_bytes:
            raise CapacityExceeded(f"tenant {self.name!r} holds {held_bytes} bytes; {adding_bytes} more would "
                                   f"exceed its quota of {self.quota_bytes} (delete chunks or wait for eviction)")


OPEN = Tenant("open", admin=True, same_host=True)


def token_digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class TenantTable:
    """Token digest -> tenant. Empty means authentication is off and every caller is the OPEN tenant."""

    def __init__(self, tenants: Mapping[bytes, Tenant] | None = None) -> None:
        self._by_digest = dict(tenants or {})

    @property
    def enabled(self) -> bool:
        return bool(self._by_digest)

    @property
    def tenants(self) -> list[Tenant]:
        return list(self._by_digest.values())

    @classmethod
    def load(cls, path: str | None) -> "TenantTable":
        if not path:
            return cls()
        text = read_file(path, "tenants file")
        try:
            values = yaml.safe_load(text) or {}
        except yaml.YAMLError:
            # Not the parser's message: it quotes the offending line, which may hold a token.
            raise ConfigError(f"tenants file {path} is not valid YAML") from None
        tenants = values.get("tenants") if isinstance(values, dict) else None
        if not isinstance(tenants, dict) or not tenants:
            raise ConfigError(f"tenants file {path} must hold a non-empty mapping under 'tenants:'")
        table: dict[bytes, Tenant] = {}
        try:
            for name, entry in tenants.items():
                digest, tenant = _tenant(str(name), entry)
                if digest in table:
                    raise ConfigError(f"tenants {table[digest].name!r} and {name!r} share a token")
                table[digest] = tenant
        except ConfigError as exc:  # say which file: a server may be given several YAML files
            raise ConfigError(f"tenants file {path}: {exc}") from None
        return cls(table)

    def tenant(self, token: str | None) -> Tenant:
        """The tenant a bearer token belongs to: the one lookup, whatever carried the token (gRPC metadata, the data
        channel's hello). Unauthenticated without a known token, unless the server is open."""
        if not self._by_digest:
            return OPEN
        if not token:
            raise Unauthenticated("this server requires a bearer token (authorization: Bearer <token>)")
        digest = token_digest(token)
        for known, tenant in self._by_digest.items():  # constant-time compare; tenants are few
            if hmac.compare_digest(known, digest):
                return tenant
        raise Unauthenticated("unknown bearer token")


def bearer_token(metadata: Sequence[tuple[str, str | bytes]]) -> str | None:
    """The token of a gRPC call's `authorization: Bearer <token>` metadata, None when it carries none."""
    value = next((v for k, v in metadata if k == AUTHORIZATION), None)
    if not isinstance(value, str) or not value.lower().startswith(_BEARER):
        return None
    return value[len(_BEARER):].strip()


def _tenant(name: str, entry: object) -> tuple[bytes, Tenant]:
    if not isinstance(entry, dict):
        raise ConfigError(f"tenant {name!r}: expected a mapping")
    refuse_unknown(entry, _TENANT_KEYS, f"tenant {name!r}: unknown key")
    if ("token" in entry) == ("token_sha256" in entry):
        raise ConfigError(f"tenant {name!r}: give exactly one of token or token_sha256")
    if "token" in entry:
        if not isinstance(entry["token"], str) or len(entry["token"]) < MIN_TOKEN_CHARS:
            raise ConfigError(f"tenant {name!r}: token must be a string of at least {MIN_TOKEN_CHARS} characters")
        digest = token_digest(entry["token"])
    else:
        try:
            digest = bytes.fromhex(str(entry["token_sha256"]))
        except ValueError:
            digest = b""
        if len(digest) != 32:
            raise ConfigError(f"tenant {name!r}: token_sha256 must be 64 hex digits (sha256 of the token)")
    admin = entry.get("admin", False) is True
    salt = entry.get("salt")
    if not admin and (not isinstance(salt, str) or not salt):
        raise ConfigError(f"tenant {name!r}: a salt is required unless admin: true")
    try:
        quota = None if entry.get("quota_bytes") is None else parse_size(entry["quota_bytes"])
    except ConfigError as exc:
        raise ConfigError(f"tenant {name!r}: quota_bytes: {exc}") from None
    return digest, Tenant(name, salt_suffix(salt) if salt else None, quota,
                          same_host=entry.get("same_host", False) is True, admin=admin)
