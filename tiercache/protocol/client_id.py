"""What a client calls itself on every request, so the server can count its requests in flight apart from those of
the other clients on its host (server.limits: several engines of one node share one address).

A Client picks a random id when it is made and sends it as `tiercache-client` gRPC metadata on every call and in its
data-channel hello. It is a name for counting, not a credential: the bearer token says who may call; a client that
gives itself many names is still bounded by its host's and its tenant's limits.
"""

from __future__ import annotations

import secrets
from typing import Sequence

from tiercache.errors import InvalidArgument

METADATA_KEY = "tiercache-client"
MAX_BYTES = 64


def new_client_id() -> str:
    return secrets.token_hex(8)


def checked(value: str | bytes) -> str:
    """The id, or InvalidArgument when it is not at most MAX_BYTES printable ASCII characters."""
    text = value.decode("ascii", errors="replace") if isinstance(value, bytes) else value
    if len(text) > MAX_BYTES or not text.isascii() or not text.isprintable():
        raise InvalidArgument(f"{METADATA_KEY}: a client id is at most {MAX_BYTES} printable ASCII characters")
    return text


def client_id_of(metadata: Sequence[tuple[str, str | bytes]] | None) -> str:
    """The id a gRPC call's metadata names ('' when none: the call is counted by its connection)."""
    value = next((v for k, v in metadata or () if k == METADATA_KEY), "")
    return checked(value)
