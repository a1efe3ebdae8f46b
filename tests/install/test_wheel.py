"""The wheel and sdist built from the checkout's files are complete, and the wheel, installed (not editable) into a
fresh venv with nothing but its declared dependencies, runs `tiercache serve` and a client."""

from __future__ import annotations

import json
import signal
import subprocess
import tarfile
import zipfile
from email.parser import Parser

from tests.helpers import free_port, wait_for
from tests.install.conftest import run, serving
from tiercache import __version__

STUBS = ("tiercache/_proto/tiercache_pb2.py", "tiercache/_proto/tiercache_pb2_grpc.py")


def test_the_copy_that_was_built_has_no_stubs(work):
    """So the stubs in the wheel can only come from the build."""
    assert (work / "src" / "proto" / "tiercache.proto").exists()
    assert not list((work / "src" / "tiercache" / "_proto").glob("*_pb2*.py"))


def test_the_wheel_holds_the_generated_stubs_and_the_kernel_sources(wheel):
    assert wheel.name == f"tiercache_llm-{__version__}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        metadata = Parser().parsestr(archive.read(f"tiercache_llm-{__version__}.dist-info/METADATA").decode())
    assert set(STUBS) <= names
    assert {"tiercache/kernels/native/paged_kv.cu", "tiercache/kernels/native/state_copy.cu"} <= names
    assert not any(name.startswith(("tests/", "lab/", "benchmarks/", "testkit/")) for name in names)  # never shipped
    assert metadata["Name"] == "tiercache-llm"
    base = [r for r in metadata.get_all("Requires-Dist") if "extra ==" not in r]
    assert not any(r.startswith(("torch", "transformers", "cupy")) for r in base), base


def test_the_sdist_carries_the_proto_and_no_stubs(sdist):
    """A wheel built from the sdist (as `python -m build` did) generates its own stubs."""
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    assert {"proto/tiercache.proto", "setup.py", "pyproject.toml"} <= names
    assert not names & set(STUBS)


def test_the_fresh_venv_has_the_wheel_and_its_declared_dependencies_only(work, tmp_path):
    python = work / "venv" / "bin" / "python"
    run(python, "-m", "pip", "check")
    script = ("import importlib.util, json, tiercache; print(json.dumps([tiercache.__file__] + "
              "[importlib.util.find_spec(m) is not None for m in ('torch', 'pytest')]))")
    found = json.loads(run(python, "-c", script, cwd=tmp_path).stdout)
    site = run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))").stdout.strip()
    assert found == [f"{site}/tiercache/__init__.py", False, False]


CLIENT = """
import sys
import tiercache
from tiercache import Client

url = sys.argv[1]
with Client.from_url(url) as client:
    assert client.put("wheel", b"key", b"bytes from the installed wheel") == "host"
with Client.from_url(url, same_host=False) as remote:  # over the data channel
    assert remote.get("wheel", b"key") == b"bytes from the installed wheel"
    assert remote.stats()["version"] == tiercache.__version__
print(tiercache.__file__)
"""


def test_tiercache_serve_from_the_wheel_serves_a_client_and_stops_on_sigterm(work, tmp_path):
    bin_dir = work / "venv" / "bin"
    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "w") as output:
        server = subprocess.Popen([bin_dir / "tiercache", "serve", "--port", str(port), "--host-mem", "32MiB",
                                   "--disk-dir", tmp_path / "disk", "--disk-size", "64MiB"],
                                  stdout=output, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        wait_for(lambda: server.poll() is not None or serving(port), timeout_s=60, what="the server")
        assert server.poll() is None, log.read_text()
        client = run(bin_dir / "python", "-c", CLIENT, f"grpc://127.0.0.1:{port}", cwd=tmp_path)
        assert client.stdout.strip().startswith(str(work / "venv" / "lib"))
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=30)
    assert code == 0 and "stopped" in log.read_text(), log.read_text()
