"""Storage tiers behind one contract (see tiercache.tiers.base). Tiers never import each other or the store."""

from tiercache.tiers.base import Evicted, Tier, TierUsage

__all__ = ["Evicted", "Tier", "TierUsage"]
