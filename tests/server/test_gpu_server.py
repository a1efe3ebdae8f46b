"""`tiercache serve --gpu-mem` as a real process, where a GPU exists (-m gpu): chunks put over gRPC or the data
channel land in GPU memory first, the overflow is demoted to the (page-locked) host tier, and every chunk comes back
byte for byte from either tier over each client path (gRPC streams, the data channel, the same-host arena). A
same-host writer's chunks land in the host tier: it writes the arena's pages in place."""

from __future__ import annotations

import os

import pytest

from tests.helpers import ServerProcess
from tiercache.client import Client

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CHUNK = 1 << 20
PATHS = {"grpc": {"same_host": False, "data_channel": False}, "data channel": {"same_host": False},
         "same host": {"same_host": True}}


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--gpu-mem", "8MiB", "--host-mem", "256MiB", "--disk-size", "0") as process:
        yield process


@pytest.mark.parametrize("writer", PATHS)
def test_chunks_overflow_from_gpu_to_host_and_come_back_byte_for_byte(server, writer):
    namespace = f"gpu-server-{writer.replace(' ', '-')}"
    chunks = [(b"key-%d" % i, os.urandom(CHUNK)) for i in range(24)]  # three times the GPU tier
    keys = [key for key, _ in chunks]
    with Client.from_url(server.url, **PATHS[writer]) as client:
        demoted = _tier(client, "host")["demotions"]
        for key, data in chunks:
            client.put(namespace, key, data)
        tiers = client.locate(namespace, keys)
        assert None not in tiers
        if writer == "same host":
            assert set(tiers) == {"host"}, tiers
        else:  # the newest in GPU memory, the rest demoted to the host tier
            assert "gpu" in tiers and "host" in tiers, tiers
            assert _tier(client, "host")["demotions"] > demoted  # counted by the tier that took them
    for reader in PATHS:
        with Client.from_url(server.url, **PATHS[reader]) as client:
            fetched = client.get_many(namespace, keys)
            assert [bytes(item.data) for item in fetched] == [data for _, data in chunks], reader


def _tier(client: Client, name: str) -> dict:
    tiers = {tier["name"]: tier for tier in client.stats()["tiers"]}
    assert tiers["gpu"]["used_bytes"] <= 8 << 20
    return tiers[name]
