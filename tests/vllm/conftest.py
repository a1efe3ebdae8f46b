"""The vLLM connector tests need vLLM, which lives in its own venv (scripts/install_vllm.sh; `make test-vllm`)."""

import importlib.util
import socket

import pytest

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["*.py"]


@pytest.fixture
def unused_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
