"""The store: the policy above the tiers (placement, demotion, promotion, write-through), its statistics, and
the same-host path's grants. Imports `tiers`, `record`, `config`, `errors`."""
