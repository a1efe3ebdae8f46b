"""The lab's scrape asks again when a server leaves a request unanswered past its timeout, and says so."""

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from lab.serving.prometheus import scrape


def server_answering_after(unanswered: int):
    """A metrics page whose first `unanswered` requests get no answer until the test ends."""
    release = threading.Event()
    seen = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append(self.path)
            if len(seen) <= unanswered:
                release.wait(30)
                return
            body = b"tiercache_lookups_total 3.0\n"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, release, seen


@pytest.fixture
def answering_second():
    server, release, seen = server_answering_after(1)
    yield f"http://127.0.0.1:{server.server_port}/metrics", seen
    release.set()
    server.shutdown()


def test_an_unanswered_scrape_is_asked_again_and_the_retry_printed(answering_second, capsys):
    # The first request is never answered, whatever the timeout; the second is answered at once, and its timeout is
    # long enough that a loaded machine still answers within it (one attempt, not two, is what is counted).
    url, seen = answering_second
    assert scrape(url, timeout_s=3.0) == "tiercache_lookups_total 3.0\n"
    assert len(seen) == 2
    assert "attempt 1 of 4; asking again" in capsys.readouterr().err


def test_a_server_that_never_answers_fails_the_scrape_after_its_attempts():
    server, release, seen = server_answering_after(10)
    try:
        with pytest.raises(TimeoutError):
            scrape(f"http://127.0.0.1:{server.server_port}/metrics", timeout_s=0.3, attempts=2)
        assert len(seen) == 2
    finally:
        release.set()
        server.shutdown()
