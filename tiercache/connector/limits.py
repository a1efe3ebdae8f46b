"""The check every connector makes at startup: its largest object must fit the server's chunk limit.

A recurrent state is one object holding every recurrent layer, and it can be large (Qwen3.6-27B: 146.8 MiB on one
rank). A server whose `server.max_chunk_bytes` is smaller refuses every such put: with the old 64 MiB default,
`tiercache bench cliff --preset qwen3.6-27b` failed after 5 s and an engine saved no state at all, every request
logging the refusal. So each connector asks the server its limit once (Attach says it) and refuses to start with one
line naming the flag (tests/connector/test_limits.py). A server that cannot be asked (down, or too old to say) is not
a reason to keep an engine from starting: the check is skipped with a warning, and a refused put is then logged when
it happens.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from tiercache.client import Client
from tiercache.config import MiB, format_size
from tiercache.errors import InvalidArgument, TierCacheError, Unavailable
from tiercache.prefix.objects import CacheSpec

log = logging.getLogger(__name__)


class Largest(NamedTuple):
    size_bytes: int
    kind: str  # "state" or "kv chunk"


def largest_object(spec: CacheSpec) -> Largest:
    """The largest object this rank writes: its state (every recurrent layer), or one group's kv chunk (N tokens of
    all that group's layers; a tail is never larger)."""
    chunk = max((g.kv_bytes_per_token * spec.chunk_tokens for g in spec.layout.attention_groups), default=0)
    state = spec.layout.state_bytes
    return Largest(state, "state") if state >= chunk else Largest(chunk, "kv chunk")


def check_spec(client: Client, spec: CacheSpec, engine: str) -> None:
    """check_fits for the largest object of a CacheSpec; `engine` names the connector in the message."""
    largest = largest_object(spec)
    rank = f", one rank of TP {spec.layout.tp_size}" if spec.layout.tp_size > 1 else ""
    check_fits(client, largest.size_bytes, f"{engine}: a {largest.kind} of {spec.layout.model} (N={spec.chunk_tokens}"
                                           f"{rank})")


def check_fits(client: Client, largest_bytes: int, what: str) -> None:
    """InvalidArgument when the server's chunk limit is below `largest_bytes`; `what` names the object and the engine
    ("TierCacheConnector: a state of Qwen/Qwen3.6-27B")."""
    try:
        limit = client.server_max_chunk_bytes()
    except TierCacheError as exc:
        # An unreachable server is reported once per outage by the client's breaker: not a second warning here.
        (log.info if isinstance(exc, Unavailable) else log.warning)(
            "%s: could not ask the tiercache server at %s for its chunk limit (%s); objects above it will be refused "
            "when saved", what, client.target, exc)
        return
    if limit and largest_bytes > limit:
        raise InvalidArgument(
            f"{what} is {format_size(largest_bytes)} ({largest_bytes} bytes), above the {format_size(limit)} chunk "
            f"limit of the tiercache server at {client.target}: start it with `tiercache serve --max-chunk-size "
            f"{suggested_limit(largest_bytes)}` (server.max_chunk_bytes)")


def suggested_limit(size_bytes: int) -> str:
    """The smallest power-of-two MiB that holds `size_bytes`, as a size the CLI and the config take."""
    mib = 1
    while mib * MiB < size_bytes:
        mib *= 2
    return f"{mib}MiB" if mib < 1024 else f"{mib // 1024}GiB"
