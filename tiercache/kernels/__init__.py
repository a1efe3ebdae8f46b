"""Copy kernels between an engine's paged GPU buffers and contiguous chunks (see `copy`), CUDA sources in
`native/`. Imports only `errors` (and torch)."""

from tiercache.kernels.copy import (
                                    PagedGeometry,
                                    StatePools,
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

__all__ = ["PagedGeometry", "StatePools", "gather_kv", "gather_kv_reference", "scatter_kv", "scatter_kv_reference",
           "slots_for_blocks", "state_pools", "state_record_bytes", "states_from_buffer",
           "states_from_buffer_reference", "states_to_buffer", "states_to_buffer_reference"]
