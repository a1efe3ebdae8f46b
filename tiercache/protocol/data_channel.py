"""The data channel's wire format: chunk payloads between a remote client and the server over a plain TCP (or unix)
socket, beside the gRPC port that carries everything else.

Why a second channel: grpcio costs more per message than the copy it carries (docs/performance.md), so a remote put
or get through it ran at half redis-py's rate. Here the payload bytes are the only bytes on the wire after a short
header: the server receives them straight into the pages of the record that will hold them (`recv_into`), and sends
a hit straight out of its arena; the client does the same with its own buffers.

It is no side door: a connection opens with the same bearer token a gRPC call carries (checked by the same
TenantTable), the server wraps it in TLS whenever the gRPC port has TLS (same certificate, same client CA), and every
request is checked like its gRPC twin (namespace owned by the tenant, key and size limits, quota).

A connection (all integers little-endian):

    client: HELLO     magic "TCD1", u16 token length, token (empty when the server has no tenants); or
                      magic "TCD2", the same, then u8 client id length, client id (protocol.client_id: the server
                      counts the connection's requests as that client's; with TCD1 as the connection's own)
    server: STATUS    u8 code (0: ok), u32 message length, message (utf-8)
    then any number of requests, one at a time:
    client: REQUEST   u8 op, u32 count, u32 block length, block
              PUT block: u16 namespace length, namespace, then per chunk
                         u16 key length, key, u64 size, u8 object class, u64 prefix tokens, u16 parent length, parent
                         [u64 engine hash, u32 token bytes, tokens: when the parent length has bit 15 set]
                         -- followed by the chunks' payloads, back to back, in order
              GET block: u16 namespace length, namespace, then per key u16 key length, key
    server: PUT   -> STATUS, and when ok: per chunk u8 length + the name of the tier that holds it
            GET   -> STATUS, and when ok: per key ITEM = u8 found, u64 size, u8 tier length, tier, then the payload

A request the server refuses (a namespace the tenant does not own, a quota) is answered with its error STATUS after
the server has read (and dropped) the payloads already on their way, so the connection stays usable. Malformed input
gets an error STATUS and the connection is closed; a get that fails after its STATUS (a tier's error half-way) just
closes the connection.

Both ends read and send these bytes through tiercache.protocol.sockets (exact reads, sliced sends, deadlines).
"""

from __future__ import annotations

import socket
import struct
import time
from typing import NamedTuple, Sequence

from tiercache.protocol import client_id as client_ids
from tiercache.errors import WIRE_CODES, ConnectionBroken, InvalidArgument, TierCacheError, wire_code
from tiercache.protocol.sockets import recv_exactly, recv_exactly_into, recv_growing
from tiercache.record.encoding import ChunkMeta

MAGIC = b"TCD1"
MAGIC_NAMED = b"TCD2"  # a hello that carries the client's id
OP_PUT = 1
OP_GET = 2
MAX_BATCH = 65_536  # chunks or keys in one request
MAX_BLOCK_BYTES = 16 << 20  # a request's header block (keys, metas): far above what MAX_BATCH entries need
MAX_TOKEN_BYTES = 4096
MAX_MESSAGE_BYTES = 64 << 10
# Between requests the server keeps an idle connection this long; a client pooling connections closes its own well
# before (client.data_channel.IDLE_CLOSE_S), so it never sends a request into a connection the server is closing.
KEEPALIVE_S = 300.0

_HELLO = struct.Struct("<4sH")
_STATUS = struct.Struct("<BI")
_REQUEST = struct.Struct("<BII")
_U16 = struct.Struct("<H")
_PUT_ENTRY = struct.Struct("<QBQH")  # size, object class, prefix tokens, parent length (after the key)
# Bit 15 of the parent length: the engine block (ChunkMeta.tokens and engine_hash, for KV events: docs/events.md)
# follows the parent. A flag rather than a new op, so puts without tokens are byte for byte what they always were
# (old servers take them).
_WITH_ENGINE = 0x8000
_ENGINE = struct.Struct("<QI")  # engine hash, token bytes
ITEM = struct.Struct("<BQB")  # found, size, tier length

OK = 0
INTERNAL = 7  # an unexpected error; the other codes are tiercache.errors.WIRE_CODES


class PutEntry(NamedTuple):
    key: bytes
    size: int
    meta: ChunkMeta


def code_for(error: BaseException) -> int:
    row = wire_code(error)
    return row.data_code if row else INTERNAL


def error_for(code: int, message: str) -> TierCacheError:
    kind = next((row.error for row in WIRE_CODES if row.data_code == code), None)
    return kind(message) if kind else TierCacheError(f"INTERNAL: {message}")


# -- messages ---------------------------------------------------------------------------------------------------------

class Hello(NamedTuple):
    token: str  # '' for none
    client_id: str  # '' when the client named none (a TCD1 hello)


def hello(token: str | None, client_id: str = "") -> bytes:
    data = (token or "").encode()
    if len(data) > MAX_TOKEN_BYTES:
        raise InvalidArgument(f"a token is at most {MAX_TOKEN_BYTES} bytes")
    if not client_id:  # byte for byte the hello of clients that name themselves nowhere
        return _HELLO.pack(MAGIC, len(data)) + data
    name = client_ids.checked(client_id).encode()
    return _HELLO.pack(MAGIC_NAMED, len(data)) + data + bytes([len(name)]) + name


def read_hello(sock: socket.socket, deadline: float | None = None) -> Hello:
    """What a connection opens with; InvalidArgument when it is not a data-channel client."""
    magic, length = _HELLO.unpack(recv_exactly(sock, _HELLO.size, deadline))
    if magic not in (MAGIC, MAGIC_NAMED):
        raise InvalidArgument("not a tiercache data-channel client (bad magic)")
    if length > MAX_TOKEN_BYTES:
        raise InvalidArgument("token too long")
    token = bytes(recv_exactly(sock, length, deadline)).decode(errors="replace")
    if magic == MAGIC:
        return Hello(token, "")
    size = recv_exactly(sock, 1, deadline)[0]
    return Hello(token, client_ids.checked(bytes(recv_exactly(sock, size, deadline))))


def status(code: int, message: str = "") -> bytes:
    data = message.encode()[:MAX_MESSAGE_BYTES]
    return _STATUS.pack(code, len(data)) + data


def read_status(sock: socket.socket) -> None:
    """Raise the error a STATUS carries; return when it says ok."""
    code, length = _STATUS.unpack(recv_exactly(sock, _STATUS.size))
    if length > MAX_MESSAGE_BYTES:
        raise ConnectionBroken("data channel: malformed status")
    message = bytes(recv_exactly(sock, length)).decode(errors="replace")
    if code != OK:
        raise error_for(code, message)


def _name(data: bytes) -> bytes:
    return _U16.pack(len(data)) + data


def put_request(namespace: str, entries: Sequence[PutEntry]) -> bytes:
    parts = [_name(namespace.encode())]
    for entry in entries:
        meta = entry.meta
        flag = _WITH_ENGINE if meta.tokens else 0
        parts += [_name(entry.key), _PUT_ENTRY.pack(entry.size, meta.object_class, meta.prefix_tokens,
                                                   len(meta.parent) | flag), meta.parent]
        if flag:
            parts += [_ENGINE.pack(meta.engine_hash, len(meta.tokens)), meta.tokens]
    return _request(OP_PUT, len(entries), b"".join(parts))


def get_request(namespace: str, keys: Sequence[bytes]) -> bytes:
    return _request(OP_GET, len(keys), b"".join([_name(namespace.encode()), *(_name(k) for k in keys)]))


def _request(op: int, count: int, block: bytes) -> bytes:
    if count > MAX_BATCH or len(block) > MAX_BLOCK_BYTES:
        raise InvalidArgument(f"a data-channel request holds at most {MAX_BATCH} chunks")
    return _REQUEST.pack(op, count, len(block)) + block


class Request(NamedTuple):
    op: int
    namespace: str
    keys: list[bytes]
    entries: list[PutEntry]  # PUT only


def read_request(sock: socket.socket, idle_s: float) -> Request | None:
    """The next request, or None when the client closed the connection between requests. The wait for its first
    byte is the socket's timeout; the rest of its header and its whole block must follow within `idle_s` of that
    byte (each read alone waiting `idle_s` let a client trickle a declared 16 MiB block for as long as it liked),
    and the block's buffer grows as it arrives."""
    head = bytearray(_REQUEST.size)
    view = memoryview(head)
    try:
        first = sock.recv_into(view)
    except (OSError, ValueError) as exc:
        raise ConnectionBroken(f"data channel: {exc or type(exc).__name__}") from None
    if not first:
        return None
    deadline = time.monotonic() + idle_s
    sock.settimeout(idle_s)
    recv_exactly_into(sock, view[first:], deadline)
    op, count, block_bytes = _REQUEST.unpack(head)
    if op not in (OP_PUT, OP_GET) or count > MAX_BATCH or block_bytes > MAX_BLOCK_BYTES:
        raise InvalidArgument(f"malformed data-channel request (op {op}, {count} entries, {block_bytes} bytes)")
    return parse_block(op, count, recv_growing(sock, block_bytes, deadline))


def parse_block(op: int, count: int, block: bytearray) -> Request:
    reader = _Reader(block)
    try:
        namespace = reader.name().decode()
        keys, entries = [], []
        for _ in range(count):
            key = reader.name()
            keys.append(key)
            if op == OP_PUT:
                size, object_class, prefix_tokens, parent_len = reader.unpack(_PUT_ENTRY)
                parent = reader.take(parent_len & ~_WITH_ENGINE)
                engine_hash, tokens = 0, b""
                if parent_len & _WITH_ENGINE:
                    engine_hash, token_bytes = reader.unpack(_ENGINE)
                    tokens = reader.take(token_bytes)
                entries.append(PutEntry(key, size, ChunkMeta(object_class, prefix_tokens, parent, tokens,
                                                             engine_hash)))
    except (struct.error, UnicodeDecodeError, IndexError) as exc:
        raise InvalidArgument(f"malformed data-channel request: {exc}") from None
    if reader.left:
        raise InvalidArgument("malformed data-channel request: trailing bytes")
    return Request(op, namespace, keys, entries)


class _Reader:
    def __init__(self, data: bytearray) -> None:
        self._data = bytes(data)
        self._at = 0

    @property
    def left(self) -> int:
        return len(self._data) - self._at

    def unpack(self, fmt: struct.Struct) -> tuple:
        values = fmt.unpack_from(self._data, self._at)
        self._at += fmt.size
        return values

    def take(self, n: int) -> bytes:
        if n > self.left:
            raise IndexError("field runs past the block")
        data = self._data[self._at:self._at + n]
        self._at += n
        return data

    def name(self) -> bytes:
        (n,) = self.unpack(_U16)
        return self.take(n)


def tiers_answer(tiers: Sequence[str]) -> bytes:
    names = [t.encode() for t in tiers]
    return b"".join(bytes([len(n)]) + n for n in names)


def read_tiers(sock: socket.socket, count: int) -> list[str]:
    tiers = []
    for _ in range(count):
        (length,) = recv_exactly(sock, 1)
        tiers.append(bytes(recv_exactly(sock, length)).decode())
    return tiers


def item(found: bool, size: int = 0, tier: str = "") -> bytes:
    name = tier.encode()
    return ITEM.pack(1 if found else 0, size, len(name)) + name


class Item(NamedTuple):
    """One key's answer to a GET: whether it was found, its payload's size (which follows), the tier it came from."""

    found: bool
    size: int
    tier: str


def read_item(sock: socket.socket, max_size: int) -> Item:
    """An ITEM header. Anything else where an item belongs (a server that failed half-way through a get closes the
    connection) is ConnectionBroken, never a size to allocate."""
    found, size, tier_bytes = ITEM.unpack(recv_exactly(sock, ITEM.size))
    if found not in (0, 1) or size > max_size or (not found and size):
        raise ConnectionBroken(f"data channel: malformed item (found {found}, {size} bytes)")
    return Item(bool(found), size, bytes(recv_exactly(sock, tier_bytes)).decode(errors="replace"))
