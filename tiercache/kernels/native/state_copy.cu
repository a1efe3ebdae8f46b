// Recurrent-state slots <-> contiguous records, batched: every tensor of every requested slot in one launch.
//
// An engine keeps recurrent state in pools indexed by slot: per layer a conv state [num_slots, ...] and an SSM /
// recurrent state [num_slots, ...], possibly of different dtypes. A record is one slot's state, all tensors back to
// back at `record_offsets`; the buffer holds `n` records, `record_bytes` apart (the row pitch: at least a record's
// size, more when the records are a column of a wider matrix). Byte movers again: T is the widest unit
// (16, 8, 4, 2 or 1 bytes) that divides every address, stride, size and offset.
// Grid: (n slots, n tensors); each block moves one tensor of one slot.

template <typename T>
__device__ __forceinline__ void move_state(const long long* __restrict__ tensor_ptrs,
                                           const long long* __restrict__ slot_strides,
                                           const long long* __restrict__ tensor_bytes,
                                           const long long* __restrict__ record_offsets,
                                           unsigned char* __restrict__ buffer,
                                           const long long* __restrict__ slots, long long record_bytes,
                                           bool to_buffer) {
    const int i = blockIdx.x;
    const int tensor = blockIdx.y;
    unsigned char* pool = reinterpret_cast<unsigned char*>(tensor_ptrs[tensor]) + slots[i] * slot_strides[tensor];
    unsigned char* record = buffer + (long long)i * record_bytes + record_offsets[tensor];
    const long long units = tensor_bytes[tensor] / (long long)sizeof(T);
    T* p = reinterpret_cast<T*>(pool);
    T* r = reinterpret_cast<T*>(record);
    for (long long u = threadIdx.x; u < units; u += blockDim.x) {
        if (to_buffer) {
            r[u] = p[u];
        } else {
            p[u] = r[u];
        }
    }
}

#define TIERCACHE_STATE_COPY(NAME, T)                                                                              \
    extern "C" __global__ void states_to_buffer_##NAME(                                                            \
        const long long* tensor_ptrs, const long long* slot_strides, const long long* tensor_bytes,              \
        const long long* record_offsets, unsigned char* buffer, const long long* slots, long long record_bytes) { \
        move_state<T>(tensor_ptrs, slot_strides, tensor_bytes, record_offsets, buffer, slots, record_bytes, true); \
    }                                                                                                              \
    extern "C" __global__ void states_from_buffer_##NAME(                                                          \
        const long long* tensor_ptrs, const long long* slot_strides, const long long* tensor_bytes,              \
        const long long* record_offsets, unsigned char* buffer, const long long* slots, long long record_bytes) { \
        move_state<T>(tensor_ptrs, slot_strides, tensor_bytes, record_offsets, buffer, slots, record_bytes,      \
                      false);                                                                                      \
    }

TIERCACHE_STATE_COPY(w16, uint4)
TIERCACHE_STATE_COPY(w8, unsigned long long)
TIERCACHE_STATE_COPY(w4, unsigned int)
TIERCACHE_STATE_COPY(w2, unsigned short)
TIERCACHE_STATE_COPY(w1, unsigned char)
