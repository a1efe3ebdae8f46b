"""What a connector checks at startup: the server says its chunk limit in Attach, and a connector whose
largest object is above it refuses to start with one line naming the flag — the transformers connector on a real
model and a real server here; the vLLM connector on vLLM's real engine in tests/vllm_engine/test_startup_refusals.py;
SGLang's in tests/sglang."""

from __future__ import annotations

import logging

import pytest

from tests.helpers import ServerProcess, free_port
from tiercache.client import Client
from tiercache.client.retry import RetryPolicy
from tiercache.config import MiB
from tiercache.connector.limits import check_spec, largest_object, suggested_limit
from tiercache.errors import InvalidArgument
from tiercache.prefix.layout import GroupKind, LayerGroup, ModelLayout
from tiercache.prefix.objects import CacheSpec
from tiercache.prefix.presets import preset


@pytest.fixture(scope="module")
def small_limit():
    """A server taking chunks of up to 16 MiB: a Qwen3.5-0.8B state (18.6 MiB) is above it."""
    with ServerProcess("--host-mem", "64MiB", "--disk-size", "0", "--max-chunk-size", "16MiB") as server:
        yield server


def test_attach_says_the_servers_chunk_limit(small_limit):
    with Client.from_url(small_limit.url) as client:
        assert client.server_max_chunk_bytes() == 16 * MiB


def test_a_state_above_the_limit_is_refused_in_one_line_naming_the_flag(small_limit):
    spec = CacheSpec.for_layout(preset("qwen3.5-0.8b"))
    assert largest_object(spec) == (19_537_920, "state")
    with Client.from_url(small_limit.url) as client, pytest.raises(InvalidArgument) as refused:
        check_spec(client, spec, "TestConnector")
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("TestConnector: a state of Qwen/Qwen3.5-0.8B (N=544) is 18.6 MiB (19537920 bytes), "
                              "above the 16.0 MiB chunk limit")
    assert message.endswith("start it with `tiercache serve --max-chunk-size 32MiB` (server.max_chunk_bytes)")


def test_objects_within_the_limit_pass(small_limit):
    spec = CacheSpec.for_layout(preset("qwen3.5-0.8b", tp_size=2))  # 9.3 MiB per rank
    with Client.from_url(small_limit.url) as client:
        check_spec(client, spec, "TestConnector")


def test_a_kv_chunk_can_be_the_largest_object():
    layout = ModelLayout("llama", (LayerGroup(GroupKind.FULL_ATTENTION, tuple(range(32)), kv_heads=8,
                                              head_dim=128),))
    assert largest_object(CacheSpec.for_layout(layout)) == (16 * 32 * 2 * 8 * 128 * 2, "kv chunk")


def test_a_server_that_cannot_be_asked_is_logged_not_a_refusal(caplog):
    """Not a second warning either: the client's breaker warns once per outage (SGLang's dead-server test counts)."""
    client = Client.from_url(f"grpc://127.0.0.1:{free_port()}", timeout_s=1, retry=RetryPolicy(attempts=1))
    with client, caplog.at_level(logging.INFO, logger="tiercache.connector.limits"):
        check_spec(client, CacheSpec.for_layout(preset("qwen3.6-27b")), "TestConnector")
    records = [r for r in caplog.records if "could not ask the tiercache server" in r.getMessage()]
    assert [r.levelno for r in records] == [logging.INFO]


def test_suggested_limits_are_sizes_the_cli_takes():
    assert [suggested_limit(n) for n in (1, MiB + 1, 153_944_064, 192_061_440, 870 * MiB)] == [
        "1MiB", "2MiB", "256MiB", "256MiB", "1GiB"]


def test_the_transformers_connector_refuses_to_start_against_a_server_whose_limit_is_below_its_state():
    torch = pytest.importorskip("torch")
    from tests.hf_models import tiny_model
    from tiercache.connector.hf import CachedPrefill

    model = tiny_model("qwen3_5", torch.float32)
    with ServerProcess("--host-mem", "16MiB", "--disk-size", "0", "--max-chunk-size", "1KiB") as server, \
            Client.from_url(server.url) as client:
        with pytest.raises(InvalidArgument, match=r"^CachedPrefill: a (state|kv chunk) of .* above the 1\.0 KiB chunk "
                                                  r"limit .*`tiercache serve --max-chunk-size 1MiB` "
                                                  r"\(server\.max_chunk_bytes\)$"):
            CachedPrefill(model, client, verify_continuation=False)
    with ServerProcess("--host-mem", "16MiB", "--disk-size", "0") as server, Client.from_url(server.url) as client:
        CachedPrefill(model, client, verify_continuation=False)  # the default limit: it starts
