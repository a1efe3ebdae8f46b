"""The Python client: the API an engine calls, and the one path every call takes (`_call`: the breaker, the deadline,
retries of what is transient).

Payloads travel by one of three paths (client.payload), chosen per try by client.chooser: in place through the
server's shared-memory arena on its host, over its data channel elsewhere, or in gRPC stream frames. `same_host=None`
(the default) picks the arena when it can be mapped; `data_channel=None` uses the data channel whenever the server
announces one.
"""

from __future__ import annotations

import time
from typing import Callable, Mapping, NamedTuple, Sequence, TypeVar

import grpc

from tiercache.client.breaker import BreakerPolicy, CircuitBreaker
from tiercache.client.chooser import PathChooser
from tiercache.client.payload import Chunk, Fetched, flat_bytes
from tiercache.client.retry import RetryPolicy
from tiercache.client.settings import ConnectionSettings
from tiercache.client.transport import call, open_channel
from tiercache.config import DEFAULT_FRAME_BYTES, DEFAULT_MAX_CHUNK_BYTES
from tiercache.errors import ConnectFailed, ConnectionBroken, InvalidArgument, TierCacheError, Unavailable
from tiercache.prefix.delivered import Delivered
from tiercache.prefix.objects import ChainShape
from tiercache.protocol.client_id import new_client_id
from tiercache.protocol.wire import (delivery_totals, layer_groups, lookup_request, max_message_bytes, pb, pb_grpc,
                                     stats_dict)
from tiercache.record.encoding import ChunkMeta
from tiercache.record.keys import validate_key, validate_namespace

T = TypeVar("T")

# LookupResponse.pod as LookupAnswer.pod_registered: UNSPECIFIED (no pod named, an older server) says nothing.
_POD_REGISTERED = {pb.POD_REGISTRATION_REGISTERED: True, pb.POD_REGISTRATION_NOT_REGISTERED: False}


class PodEndpoints(NamedTuple):
    """Where a router reads a pod's KV events: its ZMQ PUB, its replay ROUTER, and the topic."""

    endpoint: str
    replay_endpoint: str
    topic: str

    def ports(self) -> tuple[int, int]:
        """(PUB port, ROUTER port): what a pod registering again after a server restart asks to keep."""
        return int(self.endpoint.rsplit(":", 1)[1]), int(self.replay_endpoint.rsplit(":", 1)[1])


class PodQueryHit(NamedTuple):
    """One pod's answer to `Client.query_pods`: the tokens of the prompt it can restore from the server (what Lookup
    answers its connector) and the tier their KV lies in."""

    pod_id: str
    model_name: str
    dp_rank: int
    matched_tokens: int
    tokens_by_tier: dict[str, int]
    tenant: str
    block_tokens: int  # the pod's N


class LookupAnswer(NamedTuple):
    hit_tokens: int
    tiers: list[str]  # where each object of the hit lies, in tiercache.prefix.hit.required_objects order
    unverified: tuple[int, ...]  # ask again with these positions' hashes
    chain_chunks: int  # kv chunks every attention group holds from the prompt's start
    # Whether the pod the lookup named is registered for KV events (False: the server does not know it, e.g. it
    # restarted); None when no pod was named or the server does not say (older, or without events).
    pod_registered: bool | None = None


class Client:
    def __init__(self, settings: ConnectionSettings | None = None, *, timeout_s: float = 30.0,
                 retry: RetryPolicy = RetryPolicy(), frame_bytes: int = DEFAULT_FRAME_BYTES,
                 max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES, same_host: bool | None = None,
                 breaker: BreakerPolicy | None = None, data_channel: bool | None = None) -> None:
        """`settings`: the server and what to present to it (default: ConnectionSettings.from_env()); `from_url`
        builds them from a URL.

        `breaker`: fail calls at once while the server is unreachable, probing it in the background (see
        tiercache.client.breaker; the connectors' clients use one). Without one, every call waits out its retries.
        `data_channel=False`: stream remote payloads over gRPC even when the server has a data channel."""
        self.settings = settings if settings is not None else ConnectionSettings.from_env()
        limit = max_message_bytes(max_chunk_bytes)
        options = [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]
        if breaker is not None:  # gRPC's own reconnect backoff grows to 120 s: a probe must be able to reconnect
            options += [("grpc.initial_reconnect_backoff_ms", 50),
                        ("grpc.max_reconnect_backoff_ms", max(int(breaker.probe_backoff.max_s * 1000), 100))]
        self.client_id = new_client_id()  # the server counts this client's requests in flight by it (server.limits)
        self._channel = open_channel(self.settings, options, self.client_id)
        self._stub = pb_grpc.TierCacheStub(self._channel)
        self.target = self.settings.target
        self.timeout_s = timeout_s
        self.retry = retry
        self.paths = PathChooser(self._stub, self.settings, self.client_id, same_host=same_host,
                                 data_channel=data_channel,
                                 frame_bytes=frame_bytes, max_chunk_bytes=max_chunk_bytes, timeout_s=timeout_s)
        self.breaker = CircuitBreaker(self._serving, breaker, self.target) if breaker is not None else None

    @classmethod
    def from_url(cls, url: str, *, token: str | None = None, tls_ca_file: str | None = None,
                 tls_cert_file: str | None = None, tls_key_file: str | None = None,
                 tls_server_name: str | None = None, **options) -> "Client":
        """`grpc://host:port` (or plain `host:port`), `grpcs://host:port` (TLS), or `grpc+unix:///path/to/socket`.
        Token and TLS files not given here come from the environment (tiercache.client.settings)."""
        settings = ConnectionSettings.from_env(url=url, token=token, tls_ca_file=tls_ca_file,
                                               tls_cert_file=tls_cert_file, tls_key_file=tls_key_file,
                                               tls_server_name=tls_server_name)
        return cls(settings, **options)

    @property
    def same_host(self) -> bool:
        """Whether payloads go through the server's shared-memory arena (attaching on first use)."""
        return self._call(self.paths.arena) is not None

    # -- payloads ---------------------------------------------------------------------------------------------------

    def put(self, namespace: str, key: bytes, data, meta: ChunkMeta = ChunkMeta()) -> str:
        """Store `data` (any bytes-like object) under (namespace, key); returns the tier that holds it."""
        return self.put_many(namespace, [Chunk(key, data, meta)])[0]

    def put_many(self, namespace: str, chunks: Sequence[Chunk | tuple]) -> list[str]:
        """Store several chunks in one round; returns, per chunk, the tier that holds it. A chunk is a `Chunk` or a
        (key, data[, meta]) tuple."""
        validate_namespace(namespace)
        checked = [Chunk(validate_key(c.key), flat_bytes(c.data, "chunk data"), c.meta)
                   for c in (c if isinstance(c, Chunk) else Chunk(*c) for c in chunks)]
        return self._call(self.paths.put, namespace, checked) if checked else []

    def get(self, namespace: str, key: bytes, into=None) -> bytes | memoryview | None:
        """The chunk's bytes, or None for a miss: `get_many` for one key."""
        fetched = self.get_many(namespace, [key], None if into is None else [into])[0]
        return None if fetched is None else fetched.data

    def get_many(self, namespace: str, keys: Sequence[bytes], into: Sequence | None = None) -> list[Fetched | None]:
        """Per key, in order: Fetched(bytes, tier it was read from), or None for a miss.

        `into`: one writable buffer per key to fill instead of new bytes (e.g. pinned staging buffers reused for
        every call: no allocation, no page faults); each result's bytes are then a memoryview of its buffer's first
        bytes, valid until the caller writes that buffer again. A buffer too small for its chunk is InvalidArgument."""
        checked = self._checked(namespace, keys)
        if into is None:
            outs = [None] * len(keys)
        else:
            outs = [flat_bytes(b, "a get_many buffer") for b in into]
            if len(outs) != len(keys):
                raise InvalidArgument("get_many needs one buffer per key")
        return self._call(self.paths.get, namespace, checked, outs) if keys else []

    # -- control ----------------------------------------------------------------------------------------------------

    def exists(self, namespace: str, keys: Sequence[bytes]) -> list[bool]:
        return [tier is not None for tier in self.locate(namespace, keys)]

    def locate(self, namespace: str, keys: Sequence[bytes]) -> list[str | None]:
        """For each key, the name of the highest tier holding it ("host", "disk", "redis"), or None."""
        request = pb.KeysRequest(namespace=namespace, keys=self._checked(namespace, keys))
        return [t or None for t in self._call(call, self._stub.Exists, request).tier]

    def delete(self, namespace: str, keys: Sequence[bytes]) -> int:
        """Remove keys from every tier; returns how many existed."""
        request = pb.KeysRequest(namespace=namespace, keys=self._checked(namespace, keys))
        return self._call(call, self._stub.Delete, request).deleted

    def lookup(self, namespace: str, shape: ChainShape, prompt_tokens: int, boundaries: bytes,
               positions: Mapping[int, bytes], *, rank_namespaces: Sequence[str] = (), report: bool = True,
               last_chunk_tokens: bytes = b"", match_unit: int = 0, pod_id: str = "") -> LookupAnswer:
        """The server's hit for a prompt under the hybrid hit rule (see tiercache.prefix.lookup; PrefixCache is the
        usual caller): `boundaries` = h(0), h(N), ... h(KN) concatenated, `positions` other hashes it may check,
        `last_chunk_tokens` the token bytes of [KN, L-1) with u (the server hashes positions there itself).
        `pod_id`: the engine's pod for KV events; the answer's `pod_registered` says whether the server knows it."""
        request = lookup_request(validate_namespace(namespace), shape, prompt_tokens, boundaries, positions,
                                 rank_namespaces, report, last_chunk_tokens, match_unit, pod_id)
        response = self._call(call, self._stub.Lookup, request)
        names = list(response.tier_names)
        return LookupAnswer(response.hit_tokens, [names[i] for i in response.tiers], tuple(response.unverified),
                            response.chain_chunks, _POD_REGISTERED.get(response.pod))

    def report_delivery(self, namespace: str, delivered: Delivered) -> None:
        """Tell the server what the engine did with its bytes since the last report (connectors do, in the
        background: tiercache.connector.delivery): the server's `tiercache_delivered_*` metrics count these."""
        request = pb.DeliveryReport(namespace=validate_namespace(namespace), delivered=delivery_totals(delivered))
        self._call(call, self._stub.ReportDelivery, request)

    def register_pod(self, pod_id: str, model_name: str, namespaces: Sequence[str], shape: ChainShape,
                     engine_groups: Sequence[int], *, dp_rank: int = 0, remote: bool = False,
                     match_unit: int = 0, ports: tuple[int, int] | None = None) -> PodEndpoints:
        """Have the server publish KV events for an engine instance (docs/events.md): its rank namespaces (rank 0
        first), its layout's shape and the engine's KV cache group index of each layout group. Registering again
        restarts the pod's stream. `match_unit`: u of the namespaces (0: 16, or N when 16 does not divide it), which
        the server's pod query hashes prompts with. `ports`: the (PUB, ROUTER) ports an earlier registration was
        answered (`PodEndpoints.ports()`), kept when the server can (see RegisterPodRequest). NotFound from a server
        without events."""
        pub_port, replay_port = ports or (0, 0)
        request = pb.RegisterPodRequest(pod_id=pod_id, model_name=model_name, namespaces=list(namespaces),
                                        chunk_tokens=shape.chunk_tokens, groups=layer_groups(shape),
                                        engine_groups=list(engine_groups), dp_rank=dp_rank, remote=remote,
                                        match_unit=match_unit, pub_port=pub_port, replay_port=replay_port)
        response = self._call(call, self._stub.RegisterPod, request)
        return PodEndpoints(response.endpoint, response.replay_endpoint, response.topic)

    def unregister_pod(self, pod_id: str) -> None:
        """End the pod's KV events (its stream's last batch is AllBlocksCleared)."""
        self._call(call, self._stub.UnregisterPod, pb.UnregisterPodRequest(pod_id=pod_id))

    def query_pods(self, token_ids: Sequence[int] = (), *, block_hashes: Sequence[int] | None = None,
                   model_name: str = "", pod_ids: Sequence[str] = ()) -> list[PodQueryHit]:
        """For a router: per registered pod of the caller's tenant (every pod for an admin token), of `model_name`
        ("": any) and among `pod_ids` (none: all), the tokens of the prompt `token_ids` it can restore from the
        server, by tier — or, with `block_hashes` (the hashes the pods' KV events publish), of a prompt starting
        with those blocks. Touches nothing (no recency, no statistics). NotFound from a server without events."""
        request = pb.QueryPodsRequest(model_name=model_name, token_ids=list(token_ids),
                                      block_hashes=list(block_hashes or ()), pod_ids=list(pod_ids))
        response = self._call(call, self._stub.QueryPods, request)
        return [PodQueryHit(p.pod_id, p.model_name, p.dp_rank, p.matched_tokens, dict(p.tokens_by_tier), p.tenant,
                            p.block_tokens) for p in response.pods]

    def stats(self) -> dict:
        return stats_dict(self._call(call, self._stub.Stats, pb.StatsRequest()))

    def server_max_chunk_bytes(self) -> int:
        """The largest chunk the server takes (its server.max_chunk_bytes, from its Attach answer: asked once); 0
        when the server is too old to say. Connectors check their largest object against it at startup."""
        return self._call(self.paths.attach).max_chunk_bytes

    def close(self) -> None:
        if self.breaker is not None:
            self.breaker.close()
        self.paths.close()  # before the channel: pending lease releases still go out
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- one path for every call ------------------------------------------------------------------------------------

    def _call(self, attempt: Callable[..., T], *args) -> T:
        """`attempt(*args, deadline)`, one try, again while it fails with a transient error (Unavailable: the only
        category retried, tiercache.errors) and the retry policy and the deadline allow. A call that finally could
        not reach the server (ConnectionBroken) opens the breaker; while it is open, calls fail at once."""
        if self.breaker is not None:
            self.breaker.refuse()
        deadline = time.monotonic() + self.timeout_s
        delays = self.retry.delays()
        while True:
            try:
                return attempt(*args, deadline)
            except Unavailable as error:
                delay = next(delays, None)
                if delay is None or time.monotonic() + delay >= deadline:
                    if self.breaker is not None and isinstance(error, ConnectionBroken):
                        self.breaker.trip(error)
                    if isinstance(error, ConnectFailed):  # the reason alone did not say which server
                        raise ConnectFailed(f"cannot connect to the tiercache server at {self.settings.url}: "
                                            f"{error}") from None
                    raise
            time.sleep(delay)

    @staticmethod
    def _checked(namespace: str, keys: Sequence[bytes]) -> list[bytes]:
        validate_namespace(namespace)
        return [validate_key(k) for k in keys]

    def _serving(self, timeout_s: float) -> bool:
        """The breaker's probe: does the server answer a call that goes through its store within timeout_s? (Its
        health service answers on the event loop even when every store thread is stuck, so it is not asked.)"""
        try:
            self._stub.Stats(pb.StatsRequest(), timeout=timeout_s)
        except grpc.RpcError:
            return False
        return True


__all__ = ["Chunk", "ChunkMeta", "Client", "Fetched", "LookupAnswer", "PodEndpoints", "PodQueryHit", "RetryPolicy",
           "TierCacheError"]
