"""Tenants, a damaged page and a dead server, on SGLang's real CPU engine (dense Qwen3, page size 16) with
TierCacheStorage; each judged against SGLang's own behaviour by both gates (gates.py): whatever happens to the cache,
the engine's outputs (16 tokens, their logprobs and top-20, the prompt's tail) and the request's KV pages in SGLang's
device pool are a cold run's and its own hit's, exactly (a dense hit equals recomputation exactly).

One `tiercache serve` with a disk tier and no host tier: every page is a file (a test can damage one), and a server
restarted on the same directory and port finds its pages again. It has tenants (security.tenants_file): each engine
has its tenant's token and salt, as a deployment with tenants would configure the backend. Two engines:
- A: tenant a, v1 (`interface_v1`: pages straight between SGLang's host pool and the server) and the
  `page_first_direct` host layout, as the other real-engine tests;
- B: tenant b, SGLang's generic page path (v0: flat pages through `batch_get` / `batch_set` /
  `batch_exists`) and the `layer_first` host layout, so that path and layout run on the real engine too.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from testkit.prompts import prompt
from testkit.sglang_engine import Completion, EngineProcess, engine_settings, start_together
from testkit.sglang_models import DENSE
from tests.sglang_engine.gates import OUTPUT_TOKENS, assert_exact
from tests.sglang_engine.stored import server_namespaces, wait_until
from tiercache.client import Client
from tiercache.process import ServerProcess
from tiercache.record.encoding import read_header
from tiercache.record.keys import salt_suffix

PAGE = 16
LENGTH = 200  # 12 full pages and 8 tokens
FULL_PAGES = LENGTH // PAGE
HIT = FULL_PAGES * PAGE
# What SGLang caches, and backs up, of a request: the full pages of its prompt and outputs (but the last output,
# whose KV it never computed): 13.
STORED_PAGES = (LENGTH + OUTPUT_TOKENS - 1) // PAGE
SHARED = prompt(21, LENGTH)  # what engine A computes first, and every other engine asks for
LATER = prompt(22, LENGTH)  # the prompt of the dead-server test
DAMAGED_PAGE = 5  # the page (from the prompt's start) whose file the corruption test damages

TENANTS = {"a": ("tenant-a-token-0123456789abcdef", "tenant-a-salt"),
           "b": ("tenant-b-token-0123456789abcdef", "tenant-b-salt")}
OPS_TOKEN = "ops-token-0123456789abcdef"  # an admin: the tests' view of every tenant's namespaces


class Server:
    """The module's `tiercache serve`: disk only, with tenants; can be killed and started again where it was (same
    port, same disk directory), as a restarted node's server is."""

    def __init__(self, directory: Path) -> None:
        self.disk = directory / "disk"
        self.tenants = directory / "tenants.yaml"
        lines = ["tenants:"]
        for name, (token, salt) in TENANTS.items():
            lines += [f"  {name}:", f"    token_sha256: {hashlib.sha256(token.encode()).hexdigest()}",
                      f"    salt: {salt}"]
        lines += ["  ops:", f"    token: {OPS_TOKEN}", "    admin: true"]
        self.tenants.write_text("\n".join(lines) + "\n")
        self.process = self._process(port=None).start()
        self.url = self.process.url

    def _process(self, port: int | None) -> ServerProcess:
        return ServerProcess("--host-mem", "0", "--disk-size", "256MiB", "--disk-dir", str(self.disk),
                             "--tenants-file", str(self.tenants), port=port)

    def kill(self) -> None:
        self.process.kill()  # SIGKILL: no shutdown code runs

    def restart(self) -> None:
        self.process = self._process(port=self.process.port).start()

    def namespaces(self, model: str) -> dict[str, int]:
        return server_namespaces(self.url, Path(model).name, token=OPS_TOKEN)

    def disk_stats(self) -> dict:
        with Client.from_url(self.url, token=OPS_TOKEN) as client:
            return next(t for t in client.stats()["tiers"] if t["name"] == "disk")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = Server(tmp_path_factory.mktemp("tiercache-tenants"))
    yield server
    server.kill()


@pytest.fixture(scope="module")
def model(models_dir):
    return DENSE.write(models_dir)


def settings(model: str, server: Server, tenant: str, extra: dict, **overrides) -> dict:
    token, salt = TENANTS[tenant]
    # offline_backoff_s: how far apart the backend probes a server it lost (the dead-server test waits for it).
    return engine_settings(model, page_size=PAGE, storage="tiercache", url=server.url,
                           extra={"token": token, "salt": salt, "offline_backoff_s": 0.5, **extra}, **overrides)


@pytest.fixture(scope="module")
def engines(model, logs, server):
    """Engines A and B, started together."""
    started = start_together(
        (settings(model, server, "a", {"interface_v1": 1}), logs / "faults-a.log"),
        (settings(model, server, "b", {}, hicache_mem_layout="layer_first"), logs / "faults-b.log"))
    yield started
    for engine in started:
        engine.close()


@pytest.fixture(scope="module")
def engine_a(engines):
    return engines[0]


@pytest.fixture(scope="module")
def engine_b(engines):
    return engines[1]


def generate(engine: EngineProcess, tokens: list[int]) -> Completion:
    """The prompt with its uncached tail's prompt logprobs (from HIT: the whole hit stays possible), OUTPUT_TOKENS
    generated tokens' top-20 logprobs, and the request's engine bytes."""
    return engine.generate(tokens, max_new_tokens=OUTPUT_TOKENS, logprob_start_len=HIT, engine_bytes=True)


@pytest.fixture(scope="module")
def shared(engine_a):
    """Engine A's part: SHARED cold, then its own (device) hit, then flush_cache (every backup in storage; the
    engine's device and host caches empty). Returns (cold, own hit)."""
    cold = generate(engine_a, SHARED)
    assert cold.cached == 0, f"a cold engine hit {cold.cached} tokens"
    own = generate(engine_a, SHARED)
    assert (own.cached, own.details["device"]) == (HIT, HIT), f"SGLang's own hit: {own.details}"
    assert_exact(own, cold, "a dense hit against recomputation")
    engine_a.flush()
    return cold, own


def test_a_tenant_with_another_salt_never_reads_anothers_pages(server, model, shared, engine_b):
    cold, own = shared
    salt_a, salt_b = (salt_suffix(TENANTS[t][1]) for t in "ab")
    assert {ns[-len(salt_a):]: n for ns, n in server.namespaces(model).items()} == {salt_a: STORED_PAGES}

    other = generate(engine_b, SHARED)
    assert other.cached == 0 and other.storage == 0, f"tenant b hit tenant a's pages: {other.details}"
    assert_exact(other, cold, "tenant b's cold run against tenant a's")

    # B's own pages (its salt; SGLang's v0 path from the layer_first host pool) are hits for B once flush_cache has
    # emptied its device and host caches: the same salt hits.
    engine_b.flush()
    stored = server.namespaces(model)
    assert sorted((ns[-len(salt_a):], n) for ns, n in stored.items()) == sorted(
        [(salt_a, STORED_PAGES), (salt_b, STORED_PAGES)]), stored
    again = generate(engine_b, SHARED)
    assert (again.storage, again.storage_backend) == (HIT, "TierCacheStorage"), again.details
    assert_exact(again, own, "tenant b's storage hit (v0, layer_first) against tenant a's own hit")


def _page_files(disk: Path, namespace_suffix: str) -> list[list[Path]]:
    """The disk tier's files of one tenant's pages, as chains in prompt order, longest first: each page's record names
    the page before it in its backup batch as its parent (TierCacheStorage writes the chain SGLang's hashes follow),
    and a batch's first page none when SGLang does not pass the pages before it. The prompt's 12 pages are backed up
    in one batch when the request's prefill ends; the 13th (its last 8 tokens and the first outputs), a batch of
    its own when it finishes."""
    children: dict[bytes, list[tuple[bytes, Path]]] = {}
    for path in disk.rglob("*.chunk"):
        header = read_header(path.read_bytes())
        if header.key.namespace.endswith(namespace_suffix):
            children.setdefault(header.meta.parent, []).append((header.key.key, path))
    chains = []
    for key, path in children.pop(b"", []):
        chain = [path]
        while key in children:
            (key, path), = children.pop(key)
            chain.append(path)
        chains.append(chain)
    assert not children, f"{len(children)} pages outside the chains from a batch's start"
    return sorted(chains, key=len, reverse=True)


def test_a_damaged_page_is_a_miss_and_the_engine_recomputes_from_there(server, model, shared, engine_a):
    """A bit flipped in one page's file on disk: the server's checksum catches it, the page is a miss, and SGLang
    uses the pages before it and computes the rest; its output is the cold run's, never the damaged bytes'."""
    cold, own = shared
    files, *rest = _page_files(server.disk, salt_suffix(TENANTS["a"][1]))
    assert (len(files), sum(map(len, rest))) == (FULL_PAGES, STORED_PAGES - FULL_PAGES)
    damaged = bytearray(files[DAMAGED_PAGE].read_bytes())
    damaged[-100] ^= 0x10  # in the payload: a KV value
    files[DAMAGED_PAGE].write_bytes(damaged)

    got = generate(engine_a, SHARED)  # A's device and host caches are empty since its flush_cache
    assert got.storage == got.cached == DAMAGED_PAGE * PAGE, got.details
    assert_exact(got, own, "a hit cut short at the damaged page against the own hit")
    assert server.disk_stats()["checksum_failures"] == 1


def test_the_server_killed_and_restarted_under_a_running_engine(server, model, engine_a):
    """The server SIGKILLed right after a request, while the engine backs its pages up: the engine stays up (the
    backups are dropped), a request is a miss computed as a cold run; a server started again on the same port and
    disk directory has the pages backed up before the kill, the backend's probe finds it (at most offline_backoff_s
    after), and hits resume from them."""
    cold = generate(engine_a, LATER)
    assert cold.cached == 0
    engine_a.flush()  # LATER's pages are on the server's disk
    stored = server.namespaces(model)

    generate(engine_a, prompt(23, LENGTH))
    server.kill()  # while the engine backs that prompt up (SGLang logs "12 pages failed" when the kill wins)
    engine_a.flush()  # backups to a dead server end; the engine's caches are emptied

    dead = generate(engine_a, LATER)
    assert dead.cached == 0 and dead.storage == 0, dead.details
    assert_exact(dead, cold, "a miss while the server is dead against the cold run")

    server.restart()
    after = server.namespaces(model)  # the disk tier's index, rebuilt from its files
    assert all(after.get(namespace, 0) >= pages for namespace, pages in stored.items()), (stored, after)

    def storage_hit():
        # flush_cache first: the hit must come from the server, not from the engine's own caches. A request made
        # before the backend's probe found the server again is a miss, computed cold: every answer must still be
        # the cold run's.
        engine_a.flush()
        got = generate(engine_a, LATER)
        assert_exact(got, cold, f"a request while the server restarts ({got.details})")
        return got if got.storage == HIT else None

    hit = wait_until(storage_hit, "hits from the restarted server", timeout_s=120)
    assert hit.cached == HIT and hit.storage_backend == "TierCacheStorage"
