"""The pytest plugin both suites load (tests/conftest.py and lab/tests/conftest.py name it in `pytest_plugins`): what
every test session gets, whichever suite it runs and from whichever venv.

- A home of its own: no test reads or writes the user's ~/.cache/tiercache (the default disk tier, locked by a running
  `tiercache serve`) or anything else under their home; every server, engine and CLI a test starts inherits it, and
  vLLM puts its sockets in it (VLLM_RPC_BASE_PATH), not in the system's temp dir.
- Its skips written down for CI: `.ci/run` points TIERCACHE_SKIPS_FILE at one file for every suite, then fails on a
  skip that is not on .ci/allowed-skips (scripts/check_skips.py): a test that cannot run in CI must say so there, not
  pass unseen (tests/test_ci_skips.py shows it on a planted skip).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile


def pytest_configure(config):
    """The whole session (and every server, engine and CLI it starts) gets a home of its own, and vLLM's sockets a
    folder in it. Workers of a session share their controller's."""
    if "TIERCACHE_TEST_HOME" not in os.environ:
        home = tempfile.mkdtemp(prefix="tiercache-tests-home-")
        # vLLM's engines open their ZeroMQ sockets under the system's temp dir unless told, and a killed engine leaves
        # them there: under the session's home they go with it.
        rpc = os.path.join(home, "vllm-rpc")
        os.mkdir(rpc)
        os.environ.update(TIERCACHE_TEST_HOME=home, HOME=home, XDG_CACHE_HOME=os.path.join(home, ".cache"),
                          VLLM_RPC_BASE_PATH=rpc)
        config.add_cleanup(lambda: shutil.rmtree(home, ignore_errors=True))


_skipped: list[dict] = []


def pytest_runtest_logreport(report):
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _skipped.append({"test": report.nodeid, "reason": reason.removeprefix("Skipped: ")})


def pytest_sessionfinish(session):
    path = os.environ.get("TIERCACHE_SKIPS_FILE")
    if path and _skipped and not hasattr(session.config, "workerinput"):
        with open(path, "a") as out:
            out.writelines(json.dumps(skip) + "\n" for skip in _skipped)
