"""Copy kernels between an engine's paged GPU buffers and contiguous chunks (see `copy`: the boundary and the torch
references; `launch`: the CUDA launches; `geometry`: what the checks learn), CUDA sources in `native/`. Imports only
`errors` (and torch)."""

from tiercache.kernels.copy import (
                                    gather_kv,
                                    gather_kv_reference,
                                    scatter_kv,
                                    scatter_kv_reference,
                                    slots_for_blocks,
                                    state_pools,
                                    state_record_bytes,
                                    states_from_buffer,
                                    states_from_buffer_reference,
                                    states_to_buffer,
                                    states_to_buffer_reference,
)
from tiercache.kernels.geometry import PagedGeometry, StatePools

__all__ = ["PagedGeometry", "StatePools", "gather_kv", "gather_kv_reference", "scatter_kv", "scatter_kv_reference",
           "slots_for_blocks", "state_pools", "state_record_bytes", "states_from_buffer",
           "states_from_buffer_reference", "states_to_buffer", "states_to_buffer_reference"]
