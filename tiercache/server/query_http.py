"""The pod query over HTTP, in the shapes of Mooncake's conductor indexer (its RFC, kvcache-ai/Mooncake #1403 /
#1527, `docs/source/design/conductor/indexer-api-design.md`; docs/events.md, "Query API"), for routers that read no
events:

    POST /query          {model, lora_name?, token_ids, tenant_id?, instance_id?, block_size?, cache_salt?}
    POST /query_by_hash  {model, lora_name?, block_hash | seq_hashes, tenant_id?, instance_id?, block_size?}
    -> {tenant: {instance_id: {"longest_matched": t, "GPU": 0, "CPU": t, "DISK": t, "DP": {dp_rank: t}}}}

An instance is a pod registered for KV events (its pod id); the numbers are the pod query of the registry
(tiercache.events.pods, PodRegistry.query, over tiercache.events.query: Lookup's hit for that pod), with tiercache's
tiers as the events label them (host and tiercache's GPU tier are CPU, disk and Redis DISK: Mooncake's name for vLLM's
STORAGE); GPU is always 0, the engine's own memory being no tier of tiercache's.

Requests carry `Authorization: Bearer <token>`, mapped to a tenant exactly as gRPC calls are (server.auth via the
intake): a tenant sees its own pods, an admin token every pod. Every failure is a JSON `{"error": message}` with the
status errors.WIRE_CODES gives its category (400 for malformed input); an unexpected one is a 500 and a log line,
never a dead server. Bodies are limited in size, requests in concurrency (a 503 beyond it), and a client that stalls
is cut off after `TIMEOUT_S`.

Served by the stdlib's threading HTTP server in a thread of its own, as prometheus_client serves /metrics.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from tiercache.errors import InvalidArgument, TierCacheError, wire_code
from tiercache.events.query import PodHit
from tiercache.server.auth import Tenant, bearer_token

log = logging.getLogger("tiercache.server")

MAX_BODY_BYTES = 16 << 20  # a 1M-token prompt (events.query.MAX_QUERY_TOKENS) as JSON fits
MAX_CONCURRENT = 8  # requests answered at once; the rest get 503 (each holds a thread and searches the store)
TIMEOUT_S = 30.0  # for a client to send its request
_FIELDS = {
    "/query": {"model", "lora_name", "lora_id", "token_ids", "tenant_id", "instance_id", "block_size", "cache_salt"},
    "/query_by_hash": {"model", "lora_name", "lora_id", "block_hash", "seq_hashes", "tenant_id", "instance_id",
                       "block_size", "cache_salt"},
}
_MEDIA = {"CPU": "CPU", "STORAGE": "DISK"}  # vLLM's media (events.blocks.MEDIUM_BY_TIER) -> Mooncake's

# The servicer's pod query: (tenant, model, token ids, block hashes or None, pod ids, owner or None) -> answers.
Answer = Callable[..., list[tuple[str, PodHit]]]


class QueryHttpServer:
    def __init__(self, tenant_of: Callable[[str | None], Tenant], answer: Answer) -> None:
        self._tenant_of = tenant_of
        self._answer = answer
        self._slots = threading.BoundedSemaphore(MAX_CONCURRENT)
        self._http: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def start(self, host: str, port: int) -> int:
        """Listen on host:port (0: a free port) and serve in a thread; the bound port. OSError when it cannot."""
        handler = type("QueryHandler", (_Handler,), {"query": self})
        server = type("QueryServer", (ThreadingHTTPServer,),
                      {"address_family": socket.AF_INET6 if ":" in host else socket.AF_INET, "daemon_threads": True})
        self._http = server((host, port), handler)
        self._thread = threading.Thread(target=self._http.serve_forever, name="tiercache-query-http", daemon=True)
        self._thread.start()
        return self._http.server_address[1]

    def stop(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None

    def respond(self, path: str, authorization: str | None, body: bytes) -> dict:
        """The answer to one request (raises TierCacheError for the caller to turn into a status)."""
        fields = _FIELDS.get(path)
        if fields is None:
            raise _NoSuchPath(f"no such endpoint {path!r}: POST /query or /query_by_hash")
        tenant = self._tenant_of(bearer_token([("authorization", authorization)] if authorization else []))
        request = _request(body, fields)
        model = _text(request, "model", required=True)
        if _text(request, "lora_name") or _text(request, "cache_salt") or request.get("lora_id") not in (None, 0):
            # Salted namespaces (a LoRA adapter, a cache_salt) are no pod's: a pod is the namespaces it registered
            # (docs/events.md), so nothing registered can restore such a prompt.
            return {}
        owner, pod = _text(request, "tenant_id"), _text(request, "instance_id")
        block_size = _count(request, "block_size")
        if path == "/query":
            token_ids = _integers(request, "token_ids", 0, (1 << 32) - 1)
            answers = self._answer(tenant, model, token_ids, None, [pod] if pod else [], owner or None)
        else:
            hashes = _hashes(request)
            answers = self._answer(tenant, model, [], hashes, [pod] if pod else [], owner or None)
            for _, hit in answers:
                # The hashes name blocks of the pod's own N; a router counting other blocks is asking about other
                # hashes, so the mismatch is its configuration's, and an answer would be nonsense.
                if block_size and block_size != hit.pod.shape.chunk_tokens:
                    raise InvalidArgument(f"block_size {block_size} is not pod {hit.pod.pod_id!r}'s block size: its "
                                          f"blocks (and the hashes its events publish) are "
                                          f"{hit.pod.shape.chunk_tokens} tokens")
            block_size = 0
        return _shape(answers, block_size)


class _NoSuchPath(TierCacheError):
    pass


class _Handler(BaseHTTPRequestHandler):
    query: QueryHttpServer
    timeout = TIMEOUT_S
    protocol_version = "HTTP/1.1"
    server_version = "tiercache-query"

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            self._send(411, {"error": "a request needs a Content-Length"}, close=True)
            return
        if not 0 <= length <= MAX_BODY_BYTES:
            self._send(413, {"error": f"a request body is at most {MAX_BODY_BYTES} bytes"}, close=True)
            return
        body = self.rfile.read(length)
        if len(body) < length:
            self.close_connection = True  # the client went away or stalled past TIMEOUT_S: nobody to answer
            return
        # The body is read before a slot is taken: a client that sends slowly holds its own thread, not a slot.
        if not self.query._slots.acquire(blocking=False):
            self._send(503, {"error": f"busy: {MAX_CONCURRENT} queries are being answered; try again"})
            return
        try:
            self._send(200, self.query.respond(self.path, self.headers.get("Authorization"), body))
        except _NoSuchPath as exc:
            self._send(404, {"error": str(exc)})
        except TierCacheError as exc:
            row = wire_code(exc)
            self._send(row.http_status if row else 500, {"error": str(exc)})
        except Exception:  # noqa: BLE001 - one request's failure is its own, never the server's
            log.exception("pod query over HTTP failed")
            self._send(500, {"error": "internal error in the pod query"})
        finally:
            self.query._slots.release()

    def do_GET(self) -> None:  # noqa: N802
        self._send(405, {"error": "POST a JSON body to /query or /query_by_hash"})

    def _send(self, status: int, payload: dict, close: bool = False) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if status == 401:
            self.send_header("WWW-Authenticate", "Bearer")
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - http.server's signature
        log.debug("pod query over HTTP: " + format, *args)


def _shape(answers: list[tuple[str, PodHit]], block_size: int) -> dict:
    """Mooncake's response. With a block_size only whole blocks of it count (the RFC: "only complete blocks"), so a
    router's block accounting holds; tiercache's own hit is exact, to the token."""
    out: dict[str, dict] = {}
    for owner, hit in answers:
        matched = hit.tokens - hit.tokens % block_size if block_size else hit.tokens
        by_medium = hit.tokens_by_medium(matched)
        entry = {"longest_matched": matched, "GPU": 0, "CPU": 0, "DISK": 0, "DP": {str(hit.pod.dp_rank): matched}}
        for medium, tokens in by_medium.items():
            entry[_MEDIA.get(medium, "DISK")] += tokens
        out.setdefault(owner, {})[hit.pod.pod_id] = entry
    return out


def _request(body: bytes, fields: set[str]) -> dict:
    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"the body is not JSON: {exc}") from None
    if not isinstance(request, dict):
        raise InvalidArgument("the body must be a JSON object")
    unknown = sorted(set(request) - fields)
    if unknown:
        raise InvalidArgument(f"unknown fields {unknown}; this endpoint takes {sorted(fields)}")
    return request


def _text(request: dict, name: str, required: bool = False) -> str:
    value = request.get(name)
    if value is None and not required:
        return ""
    if not isinstance(value, str) or (required and not value):
        raise InvalidArgument(f"{name!r} must be a {'non-empty ' if required else ''}string")
    return value


def _count(request: dict, name: str) -> int:
    value = request.get(name)
    if value is None:
        return 0
    if type(value) is not int or value <= 0:
        raise InvalidArgument(f"{name!r} must be a positive integer")
    return value


def _integers(request: dict, name: str, low: int, high: int) -> list[int]:
    values = request.get(name)
    if not isinstance(values, list) or any(type(v) is not int or not low <= v <= high for v in values):
        raise InvalidArgument(f"{name!r} must be a list of integers in {low}..{high}")
    return values


def _hashes(request: dict) -> list[int]:
    """The block hashes, unsigned 64-bit; a signed one (a router keeping i64, as Dynamo does) is taken mod 2**64."""
    names = [name for name in ("block_hash", "seq_hashes") if request.get(name) is not None]
    if len(names) != 1:
        raise InvalidArgument("give the block hashes as 'block_hash' or 'seq_hashes' (one of them)")
    return [h & (1 << 64) - 1 for h in _integers(request, names[0], -(1 << 63), (1 << 64) - 1)]
