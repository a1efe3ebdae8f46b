"""Pods across server restarts: a lookup that names its pod is told whether the server has it registered,
for the caller's tenant only; a connector's PodRegistration registers again when a lookup says no, and a pod that
registers again gets its ports back, so a router's subscriber reconnects by itself. Real server processes restarted
on the same port and disk directory, real ZMQ sockets. (vLLM's real scheduler doing the same:
tests/vllm/test_events.py.)"""

from __future__ import annotations

import dataclasses
import socket
import time

import pytest

from testkit.event_subscriber import Subscriber
from testkit.saved_chunks import chunks, prompt, spec_of
from tests.events.test_publisher import inventory, register, served  # noqa: F401 - a fixture
from tests.helpers import ServerProcess, wait_for
from tests.prefix.chains import HYBRID
from tests.server.test_security import SALT_A, SALT_B, TOKEN_A, TOKEN_B, TOKEN_OPS, tenants_file  # noqa: F401
from tiercache.client import Backoff, Client, ConnectionSettings
from tiercache.config import EventsConfig
from tiercache.connector.pod_registration import PodRegistration
from tiercache.connector.prefix_cache import PrefixCache
from tiercache.errors import PermissionDenied


def pod_registered(client: Client, spec, pod_id: str) -> bool | None:
    """What a connector's lookup naming `pod_id` is told."""
    return PrefixCache(client, spec, report=False, pod_id=pod_id).lookup(prompt(1, 100)).pod_registered


def test_a_lookup_says_whether_the_server_knows_its_pod_and_only_to_the_pods_tenant(served, tenants_file):  # noqa: F811
    server = served("--tenants-file", tenants_file)
    spec_a, spec_b = (dataclasses.replace(spec_of(HYBRID), salt=salt) for salt in (SALT_A, SALT_B))
    with Client(ConnectionSettings(url=server.url, token=TOKEN_A)) as a, \
            Client(ConnectionSettings(url=server.url, token=TOKEN_B)) as b, \
            Client(ConnectionSettings(url=server.url, token=TOKEN_OPS)) as ops:
        assert pod_registered(a, spec_a, "pod-a") is False  # nobody registered it
        assert pod_registered(a, spec_a, "") is None  # a lookup that names no pod is told nothing
        a.register_pod("pod-a", "tiny", [spec_a.namespace], spec_a.shape, [0, 1])
        assert pod_registered(a, spec_a, "pod-a") is True
        # Another tenant is told what it would be told of a pod nobody registered: it learns nothing of A's pods,
        # and registering the pod is still refused.
        assert pod_registered(b, spec_b, "pod-a") is False
        with pytest.raises(PermissionDenied):
            b.register_pod("pod-a", "tiny", [spec_b.namespace], spec_b.shape, [0, 1])
        assert pod_registered(ops, spec_b, "pod-a") is True  # an admin sees every pod (as in QueryPods)
        a.unregister_pod("pod-a")
        assert pod_registered(a, spec_a, "pod-a") is False


def test_a_server_without_events_says_nothing_of_pods_and_a_refused_registration_waits_its_backoff():
    """Registering is refused there (NotFound): a connector must not try after every lookup."""
    spec = spec_of(HYBRID)
    calls = []

    def register_pod(ports):
        calls.append(ports)
        return client.register_pod("pod-a", "tiny", [spec.namespace], spec.shape, [0, 1], ports=ports)

    with ServerProcess("--host-mem", "1MiB") as server, Client.from_url(server.url, same_host=False) as client:
        assert pod_registered(client, spec, "pod-a") is None
        registration = PodRegistration("pod-a", register_pod, backoff=Backoff(first_s=3600, max_s=3600))
        assert not registration.register() and registration.endpoints is None  # a warning; the engine serves on
        registration.lost(time.monotonic())  # (were a lookup to say so) within the backoff: no try
        assert not registration.in_flight and len(calls) == 1


def test_the_connector_registers_its_pod_again_after_a_server_restart_and_keeps_its_ports(tmp_path):
    spec = spec_of(HYBRID)
    tokens = prompt(2, 100)
    flags = ("--events", "--host-mem", "0", "--disk-dir", str(tmp_path / "disk"), "--no-data-channel")
    first = ServerProcess(*flags).start()
    second = None
    try:
        with Client.from_url(first.url, same_host=False) as client:
            client.put_many(spec.namespace, chunks(spec, tokens, kv=3, states=[64, 96]))
            registration = PodRegistration("pod-a", lambda ports: client.register_pod(
                "pod-a", "tiny", [spec.namespace], spec.shape, [0, 1], ports=ports))
            assert registration.register()
            endpoints = registration.endpoints
            subscriber = Subscriber(endpoints.endpoint, endpoints.replay_endpoint).ready()
            try:
                before = inventory(subscriber).held
                cache = PrefixCache(client, spec, report=False, pod_id="pod-a")
                assert cache.lookup(tokens).pod_registered is True
                first.terminate()
                second = ServerProcess(*flags, port=first.port).start()  # a deploy: same port, same disk
                asked_at = time.monotonic()
                found = cache.lookup(tokens)
                assert found.pod_registered is False and found.hit.tokens == 96  # the disk tier's chains survived
                registration.lost(float("-inf"))  # a lookup older than the last registration's answer proves nothing
                assert registration.registered_again == 0
                registration.lost(asked_at)
                registration.lost(asked_at)  # (one registration in flight at most)
                wait_for(lambda: registration.registered_again == 1, what="the pod registered again")
                assert registration.endpoints == endpoints  # the same ports: the subscriber reconnects by itself
                subscriber.next()  # a batch of the new server's stream, on the SUB that stayed connected
                frames = subscriber.replay(0)
                assert frames[0][2][1][0]["type"] == "AllBlocksCleared"
                assert inventory(subscriber).held == before and len(before) == 3 + 2
                asked_at = time.monotonic()
                assert cache.lookup(tokens).pod_registered is True
                registration.lost(asked_at)  # (a stale word would not start another)
                assert registration.registered_again == 1
            finally:
                subscriber.close()
    finally:
        first.kill()
        if second is not None:
            second.kill()


def free_ports(count: int) -> int:
    """The first of `count` consecutive free loopback ports."""
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + count > 65535:
            continue
        try:
            held = []
            for port in range(base, base + count):
                sock = socket.socket()
                held.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()


def test_with_base_port_pods_registering_again_get_their_slots_back_and_new_pods_others(start_server):
    base = free_ports(8)
    events = EventsConfig(enabled=True, base_port=base)
    first = start_server(events=events)
    with Client.from_url(first.url, same_host=False) as client:
        a, b = register(client, pod_id="pod-a"), register(client, pod_id="pod-b")
    assert (a.ports(), b.ports()) == ((base, base + 1), (base + 2, base + 3))
    first.stop(grace_s=0)
    second = start_server(events=events)
    with Client.from_url(second.url, same_host=False) as client:
        shape = spec_of(HYBRID).shape
        namespaces = [spec_of(HYBRID).namespace]
        # pod-b comes back first, then a new pod, then pod-a: each old pod gets its own slot back.
        assert client.register_pod("pod-b", "tiny", namespaces, shape, [0, 1], ports=b.ports()).ports() == b.ports()
        assert register(client, pod_id="pod-c").ports() == (base + 4, base + 5)
        assert client.register_pod("pod-a", "tiny", namespaces, shape, [0, 1], ports=a.ports()).ports() == a.ports()
        # A slot another pod holds, or ports outside the range, are not given: the pod gets a new slot.
        assert client.register_pod("pod-d", "tiny", namespaces, shape, [0, 1], ports=a.ports()).ports() == \
            (base + 6, base + 7)
