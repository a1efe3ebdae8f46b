"""Configuration: one tree of frozen dataclasses, and the thin loaders (YAML file, CLI overrides) that build it.

Each component receives its own sub-config only. Every value is validated on construction, with an error that names
the key. `sections` (the tree and the defaults client and server share), `sizes` (bytes as people write them),
`loaders` (mapping, YAML file and overrides -> the tree; the rule for unknown keys; files named in configuration).
Callers import from here: the package is the one name for all of it.
"""

from tiercache.config.loaders import from_mapping, load_file, read_file, refuse_unknown, with_overrides
from tiercache.config.sections import (
    DEFAULT_FRAME_BYTES,
    DEFAULT_LEASE_TTL_S,
    DEFAULT_MAX_CHUNK_BYTES,
    Config,
    DiskTierConfig,
    EventsConfig,
    GpuTierConfig,
    HostTierConfig,
    RedisTierConfig,
    SecurityConfig,
    ServerConfig,
    cache_dir,
    default_disk_dir,
    state_budget,
)
from tiercache.config.sizes import GiB, KiB, MiB, TiB, format_size, parse_size

__all__ = ["DEFAULT_FRAME_BYTES", "DEFAULT_LEASE_TTL_S", "DEFAULT_MAX_CHUNK_BYTES", "Config", "DiskTierConfig",
           "EventsConfig", "GiB", "GpuTierConfig", "HostTierConfig", "KiB", "MiB", "RedisTierConfig", "SecurityConfig",
           "ServerConfig", "TiB", "cache_dir", "default_disk_dir", "format_size", "from_mapping", "load_file",
           "parse_size", "read_file", "refuse_unknown", "state_budget", "with_overrides"]
