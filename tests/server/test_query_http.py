"""The pod query over HTTP (tiercache.server.query_http) of a real server process, against hostile input: every
malformed request is answered 400 (or 404, 413) with a message, and the server goes on answering."""

from __future__ import annotations

import json
import socket

from testkit.saved_chunks import chunks, prompt, spec_of
from tests.events.test_query import post, register, served  # noqa: F401 - a fixture
from tests.prefix.chains import HYBRID
from tiercache.client import Client


def test_bad_http_input_is_answered_400_and_the_server_goes_on(served):  # noqa: F811
    server = served()
    spec = spec_of(HYBRID)
    tokens = prompt(40, 100)
    port = server.query_port
    with Client.from_url(server.url, same_host=False) as client:
        client.put_many(spec.namespace, chunks(spec, tokens, kv=2, states=[64]))
        register(client, spec)
    bad = [b"not json", b"[1, 2]", b'{"model": "tiny", "token_ids": [1, 2]',
           json.dumps({"token_ids": [1, 2]}).encode(),  # no model
           json.dumps({"model": "tiny", "tokens": [1, 2]}).encode(),  # an unknown field
           json.dumps({"model": "tiny", "token_ids": [1, "2"]}).encode(),
           json.dumps({"model": "tiny", "token_ids": [-1]}).encode(),
           json.dumps({"model": "tiny", "token_ids": [1 << 32]}).encode(),
           json.dumps({"model": "tiny", "token_ids": [1.5]}).encode(),
           json.dumps({"model": "tiny", "token_ids": [1], "block_size": 0}).encode(),
           json.dumps({"model": 7, "token_ids": [1]}).encode()]
    for body in bad:
        status, answer = post(port, "/query", body)
        assert status == 400 and answer["error"], body
    for body in ({"model": "tiny"}, {"model": "tiny", "block_hash": [1], "seq_hashes": [1]},
                 {"model": "tiny", "block_hash": [1 << 64]}):
        assert post(port, "/query_by_hash", body)[0] == 400, body
    assert post(port, "/nowhere", {"model": "tiny", "token_ids": []})[0] == 404
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:  # a body larger than the limit
        raw.sendall(b"POST /query HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999999\r\n\r\n")
        assert raw.recv(1024).startswith(b"HTTP/1.1 413")
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:  # no HTTP at all
        raw.sendall(b"\x00\x01garbage\r\n\r\n")
        raw.recv(1024)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:  # a client that leaves mid-body
        raw.sendall(b"POST /query HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"model\"")
    status, body = post(port, "/query", {"model": "tiny", "token_ids": tokens})
    assert status == 200 and body["open"]["pod-a"]["longest_matched"] == 64
    with Client.from_url(server.url, same_host=False) as client:
        assert client.query_pods(tokens)[0].matched_tokens == 64
