"""The registry of pods: a pod's rules in one place, for every transport that serves them.

Which tenant a pod belongs to (its first registrant's: another tenant can neither take over its stream nor end it,
and sees it in no query, not even as registered), what a registration must name, what a lookup made for a pod is
told of it, and the pod query (tiercache.events.query: Lookup's hit for each pod the caller may see). Built once by
the server (server.app) and handed to the gRPC handlers (server.servicer: decode, registry, encode) and to the HTTP
query (server.query_http). It calls no transport; its calls block (the store, the event thread).
"""

from __future__ import annotations

import dataclasses
import enum
import threading
from typing import TYPE_CHECKING, Protocol, Sequence

from tiercache.errors import InvalidArgument, NotFound, PermissionDenied
from tiercache.events.query import PodHit, query_hashes, query_tokens
from tiercache.events.blocks import Pod
from tiercache.store.tiered import TieredStore

if TYPE_CHECKING:  # pyzmq and msgpack load only in servers that publish events
    from tiercache.events.publisher import Endpoints, EventStreams


class Caller(Protocol):
    """Who is asking (server.auth.Tenant)."""

    name: str
    admin: bool

    def checked_namespace(self, namespace: str) -> str: ...


class Known(enum.Enum):
    """What a lookup made for a pod is told of its registration."""

    UNSPECIFIED = 0  # no pod named, or no events (where registering would be refused)
    REGISTERED = 1
    NOT_REGISTERED = 2  # unknown here (the server restarted), or another tenant's: the engine registers again


class PodRegistry:
    def __init__(self, store: TieredStore, streams: "EventStreams | None") -> None:
        """`streams`: the server's KV event streams; None when it publishes none (every pod call is then NotFound)."""
        self._store = store
        self._streams = streams
        self._owners: dict[str, str] = {}  # pod id -> the tenant that registered it
        self._lock = threading.Lock()

    def register(self, caller: Caller, pod: Pod, ports: tuple[int, int] | None = None) -> Endpoints:
        """Start (or restart) the pod's event stream, as the engine asked for it (decoded, nothing checked yet; its
        match unit 0 for the default: 16 when it divides N, else N); the endpoints a router subscribes to. `ports`:
        the (pub, replay) ports it had before this server restarted."""
        streams = self._events()
        shape = pod.shape
        namespaces = tuple(caller.checked_namespace(ns) for ns in pod.namespaces)
        if not pod.pod_id or not pod.model_name or not namespaces or not shape.kinds or shape.chunk_tokens <= 0 \
                or len(pod.engine_groups) != len(shape.kinds):
            raise InvalidArgument("a pod names its id, model, namespaces, N, and an engine group for each layer group")
        self._claim(caller, pod.pod_id)
        unit = pod.match_unit or (16 if shape.chunk_tokens % 16 == 0 else shape.chunk_tokens)
        if shape.chunk_tokens % unit:
            raise InvalidArgument(f"the match unit u={unit} must divide N={shape.chunk_tokens}")
        if ports is not None and not all(0 < port < 65536 for port in ports):
            raise InvalidArgument(f"ports {ports} are not TCP ports")
        return streams.register(dataclasses.replace(pod, namespaces=namespaces, match_unit=unit), ports=ports)

    def unregister(self, caller: Caller, pod_id: str) -> None:
        """End the pod's stream (a last AllBlocksCleared); it is nobody's afterwards."""
        streams = self._events()
        self._claim(caller, pod_id)
        streams.unregister(pod_id)
        with self._lock:
            self._owners.pop(pod_id, None)

    def known(self, caller: Caller, pod_id: str) -> Known:
        """What a lookup made for `pod_id` is told: another tenant's pod is NOT_REGISTERED, as one nobody registered,
        so the answer reveals nothing of other tenants."""
        if not pod_id or self._streams is None:
            return Known.UNSPECIFIED
        mine = self._streams.registered(pod_id) and (caller.admin or self._owner(pod_id) == caller.name)
        return Known.REGISTERED if mine else Known.NOT_REGISTERED

    def query(self, caller: Caller, model_name: str, token_ids: Sequence[int],
              block_hashes: Sequence[int] | None = None, pod_ids: Sequence[str] = (),
              owner: str | None = None) -> list[tuple[str, PodHit]]:
        """(owning tenant, answer) for each pod the caller may see (its tenant's; every pod for an admin) of the model
        ("": any), among `pod_ids` and of `owner`'s when given: the hit of the prompt `token_ids`, or of the prompt
        starting with the blocks `block_hashes` name."""
        streams = self._events()
        wanted = set(pod_ids)
        with self._lock:
            owners = dict(self._owners)
        pods = [pod for pod in streams.index.pods()
                if (caller.admin or owners.get(pod.pod_id) == caller.name)
                and (owner is None or owners.get(pod.pod_id) == owner)
                and (not model_name or pod.model_name == model_name) and (not wanted or pod.pod_id in wanted)]
        pods.sort(key=lambda pod: pod.pod_id)
        if block_hashes is None:
            hits = query_tokens(self._store, pods, token_ids)
        else:
            hits = query_hashes(self._store, streams.index, pods, block_hashes)
        return [(owners.get(hit.pod.pod_id, ""), hit) for hit in hits]

    def _events(self) -> EventStreams:
        if self._streams is None:
            raise NotFound("this server publishes no KV events (start it with events.enabled)")
        return self._streams

    def _owner(self, pod_id: str) -> str | None:
        with self._lock:
            return self._owners.get(pod_id)

    def _claim(self, caller: Caller, pod_id: str) -> None:
        """A pod id is its first registrant's: another tenant can neither take over its stream nor end it."""
        with self._lock:
            owner = self._owners.setdefault(pod_id, caller.name)
        if owner != caller.name and not caller.admin:
            raise PermissionDenied(f"pod {pod_id!r} belongs to another tenant")
