"""Storage tiers behind one contract (see tiercache.tiers.base). Tiers never import each other or the store."""

from __future__ import annotations

from typing import Callable

from tiercache.config import Config
from tiercache.tiers.base import Evicted, Tier, TierUsage


def from_config(config: Config, cancelled: Callable[[], bool] | None = None) -> list[Tier]:
    """The tiers a configuration enables, fastest first: gpu -> host -> disk -> redis. A new tier is added here (and
    its section in tiercache.config.sections); the store takes whatever list it is given.

    They are built in the order that refuses a bad start soonest: the host tier's room is checked and the GPU tier and
    the disk tier (its directory lock) are built before the host arena is committed, which takes seconds per GiB and
    stops when `cancelled()` turns true. What was built is closed again when a later tier fails."""
    from tiercache.tiers.disk import DiskTier
    from tiercache.tiers.gpu import gpu_tier
    from tiercache.tiers.host import check_room, host_tier
    from tiercache.tiers.redis import RedisTier

    if config.host.capacity_bytes:
        check_room(config.host)
    steps = [("gpu", config.gpu.capacity_bytes, lambda: gpu_tier(config.gpu)),
             ("disk", config.disk.capacity_bytes, lambda: DiskTier(config.disk)),
             ("host", config.host.capacity_bytes, lambda: host_tier(config.host, cancelled)),
             ("redis", config.redis.url, lambda: RedisTier(config.redis))]
    built: dict[str, Tier] = {}
    try:
        for name, enabled, build in steps:
            if enabled:
                built[name] = build()
    except BaseException:
        for tier in built.values():
            tier.close()
        raise
    return [built[name] for name in ("gpu", "host", "disk", "redis") if name in built]


__all__ = ["Evicted", "Tier", "TierUsage", "from_config"]
