"""What SGLang's storage backends hold of the engines' backups in the engine tests (a tiercache server's namespaces,
SGLang's file backend's folder), and waiting until they hold it."""

from __future__ import annotations

import time
from pathlib import Path


def wait_until(condition, what: str, timeout_s: float = 60.0):
    """Poll `condition()` until it returns a true value (returned), or fail naming `what`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.05)


def server_namespaces(url: str, model_name: str, token: str | None = None) -> dict[str, int]:
    """{namespace: objects} a tiercache server holds for SGLang's pages (and states) of the model whose folder is
    `model_name` (TierCacheStorage's namespaces are `sglang/<model path>@<layout digest>[~<salt digest>]`); `token`:
    on a server with tenants, an admin's (it sees every tenant's namespaces)."""
    from tiercache.client import Client

    client = Client.from_url(url, token=token)
    try:
        return {n["namespace"]: n["chunks"] for n in client.stats()["namespaces"]
                if n["namespace"].startswith("sglang/") and f"/{model_name}@" in n["namespace"]}
    finally:
        client.close()


def server_pages(url: str, model_name: str, token: str | None = None) -> int:
    """Objects a tiercache server holds for SGLang's pages (and states) of the model whose folder is `model_name`."""
    return sum(server_namespaces(url, model_name, token).values())


def file_pages(directory: Path, kind: str = "") -> int:
    """Pages SGLang's file backend (HiCacheFile) holds in `directory`: KV pages (kind ""), or a side pool's
    (kind "mamba": `<hash>.mamba_<suffix>.bin`)."""
    names = [f.name[64:] for f in Path(directory).glob("*.bin")]  # after the 64-hex page hash
    return sum(1 for name in names if name.startswith(f".{kind}_" if kind else "_"))
