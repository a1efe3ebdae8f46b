"""A connector's delivery reports (tiercache.connector.delivery) against a real server: sent by the reporter's own
thread, added up by the server, and kept while the server cannot be reached, to go with the next report."""

from __future__ import annotations

from tests.helpers import ServerProcess, free_port, wait_for
from tiercache.client import Client
from tiercache.connector.delivery import DeliveryReporter
from tiercache.prefix.delivered import Delivered


def test_reports_are_sent_by_the_thread_and_added_up(start_server):
    server = start_server()
    with Client.from_url(server.url) as client:
        reporter = DeliveryReporter(client, "ns", interval_s=0.05)
        reporter.add(Delivered(1, {"host": 100}))
        reporter.add(Delivered(1, {"host": 20, "disk": 5}, 1, 30, {"backlog": 2}))
        wait_for(lambda: client.stats()["delivered"]["loads"] == 2, timeout_s=30, what="both reports added up")
        reporter.close()
        assert client.stats()["delivered"] == {"loads": 2, "loaded_tokens_by_tier": {"host": 120, "disk": 5},
                                               "failed_loads": 1, "failed_load_tokens": 30,
                                               "saves_dropped_by_reason": {"backlog": 2}}
        assert reporter.sent.loaded_tokens == 125


def test_what_an_unreachable_server_missed_goes_with_the_next_report(tmp_path):
    port = free_port()
    client = Client.from_url(f"grpc://127.0.0.1:{port}", timeout_s=2.0)
    reporter = DeliveryReporter(client, "ns")
    reporter.add(Delivered(saves_dropped_by_reason={"unreachable": 7}))
    reporter.close(timeout_s=60)  # the thread's last try fails: the report stays; flush() goes on without the thread
    assert not reporter.flush()
    reporter.add(Delivered(1, {"host": 10}))
    with ServerProcess("--host-mem", "16MiB", "--disk-size", "0", port=port):
        wait_for(reporter.flush, timeout_s=30, what="the kept report sent once the server answers")
        delivered = client.stats()["delivered"]
    client.close()
    assert delivered["saves_dropped_by_reason"] == {"unreachable": 7} and delivered["loaded_tokens_by_tier"] == {
        "host": 10}
