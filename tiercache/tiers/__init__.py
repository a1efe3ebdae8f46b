"""Storage tiers behind one contract (see tiercache.tiers.base). Tiers never import each other or the store."""

from __future__ import annotations

from tiercache.config import Config
from tiercache.tiers.base import Evicted, Tier, TierUsage


def from_config(config: Config) -> list[Tier]:
    """The tiers a configuration enables, fastest first: gpu -> host -> disk -> redis. A new tier is added here (and
    its section in tiercache.config); the store takes whatever list it is given."""
    from tiercache.tiers.disk import DiskTier
    from tiercache.tiers.gpu import gpu_tier
    from tiercache.tiers.host import host_tier
    from tiercache.tiers.redis import RedisTier

    enabled = [(config.gpu.capacity_bytes, gpu_tier, config.gpu), (config.host.capacity_bytes, host_tier, config.host),
               (config.disk.capacity_bytes, DiskTier, config.disk), (config.redis.url, RedisTier, config.redis)]
    return [build(section) for on, build, section in enabled if on]


__all__ = ["Evicted", "Tier", "TierUsage", "from_config"]
