"""A request's salt — its LoRA adapter and its cache_salt — names a namespace of its own (the same tokens under
another adapter are other bytes). The scheduler's planner needs a PrefixCache per salt, the worker's loads and saves
the namespace of its rank per salt; both are made once per salt, here.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Generic, TypeVar

from tiercache.prefix.objects import CacheSpec

T = TypeVar("T")


class PerSalt(Generic[T]):
    """`make(salt)`, made once per salt. Read from several threads (vLLM's, the worker's fetching and gathering
    threads): two that miss at once both make it, and either result is the same."""

    def __init__(self, make: Callable[[str], T]) -> None:
        self._make = make
        self._made: dict[str, T] = {}

    def __getitem__(self, salt: str) -> T:
        made = self._made.get(salt)
        if made is None:
            made = self._made[salt] = self._make(salt)
        return made


def namespaces(spec: CacheSpec) -> PerSalt[str]:
    """The namespace of `spec` (a rank's) under each salt: a job's salt is the whole of it (joined)."""
    return PerSalt(lambda salt: dataclasses.replace(spec, salt=salt).namespace)


def request_salt(request) -> str:
    """What of a vLLM request changes its bytes beyond the engine's own settings: its LoRA adapter, its cache_salt."""
    parts = []
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        parts.append(f"lora:{lora.lora_name}")
    if getattr(request, "cache_salt", None):
        parts.append(f"salt:{request.cache_salt}")
    return "|".join(parts)


def joined_salt(base: str, extra: str) -> str:
    """The connector's configured salt and a request's own, as one."""
    return f"{base}|{extra}" if base and extra else base or extra
