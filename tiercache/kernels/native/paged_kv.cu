// Paged KV <-> contiguous chunk copies: all layers of a chunk in one launch.
//
// An engine keeps each attention layer's KV in its own paged buffer: NHD [2, num_blocks, block_size, heads, head_dim]
// (vLLM / FlashAttention) or HND [2, num_blocks, heads, block_size, head_dim] (FlashInfer). The layout is described
// by byte strides (kv, block, position in block, head), so one kernel serves both and any strided view.
// A chunk is [layers, 2, capacity, heads * head_dim]; tokens land at [token_offset, token_offset + tokens), which
// lets a `tail` (partial chunk) be gathered or scattered.
//
// The copy unit T is chosen by the host binding: 16 bytes (uint4) when every address and size is 16-byte aligned,
// else the widest of 8, 4, 2, 1 that is. Kernels are byte movers: the dtype only sets head_bytes.
// Grid: (tokens, layers); each block moves one token of one layer: 2 * heads * head_bytes / sizeof(T) units.

template <typename T>
__device__ __forceinline__ void move_token(const long long* __restrict__ layer_ptrs,
                                           unsigned char* __restrict__ chunk,
                                           const long long* __restrict__ slots, int heads, int head_bytes,
                                           long long stride_kv, long long stride_block, long long stride_pos,
                                           long long stride_head, int block_size, int capacity,
                                           int token_offset, bool to_chunk) {
    const int t = blockIdx.x;
    const int layer = blockIdx.y;
    const long long slot = slots[t];
    const long long block = slot / block_size;
    const long long pos = slot - block * block_size;
    unsigned char* paged = reinterpret_cast<unsigned char*>(layer_ptrs[layer]);
    const int units_per_head = head_bytes / (int)sizeof(T);
    const int units_per_kv = heads * units_per_head;
    const long long row_bytes = (long long)heads * head_bytes;
    for (int i = threadIdx.x; i < 2 * units_per_kv; i += blockDim.x) {
        const int kv = i / units_per_kv;
        const int rest = i - kv * units_per_kv;
        const int head = rest / units_per_head;
        const int unit = rest - head * units_per_head;
        T* p = reinterpret_cast<T*>(paged + kv * stride_kv + block * stride_block + pos * stride_pos +
                                    head * stride_head) + unit;
        T* c = reinterpret_cast<T*>(chunk + (((long long)layer * 2 + kv) * capacity + token_offset + t) * row_bytes +
                                    (long long)head * head_bytes) + unit;
        if (to_chunk) {
            *c = *p;
        } else {
            *p = *c;
        }
    }
}

#define TIERCACHE_PAGED_KV(NAME, T)                                                                                \
    extern "C" __global__ void gather_kv_##NAME(                                                                   \
        const long long* layer_ptrs, unsigned char* chunk, const long long* slots, int heads, int head_bytes,    \
        long long stride_kv, long long stride_block, long long stride_pos, long long stride_head, int block_size, \
        int capacity, int token_offset) {                                                                         \
        move_token<T>(layer_ptrs, chunk, slots, heads, head_bytes, stride_kv, stride_block, stride_pos,          \
                      stride_head, block_size, capacity, token_offset, true);                                      \
    }                                                                                                              \
    extern "C" __global__ void scatter_kv_##NAME(                                                                  \
        const long long* layer_ptrs, unsigned char* chunk, const long long* slots, int heads, int head_bytes,    \
        long long stride_kv, long long stride_block, long long stride_pos, long long stride_head, int block_size, \
        int capacity, int token_offset) {                                                                         \
        move_token<T>(layer_ptrs, chunk, slots, heads, head_bytes, stride_kv, stride_block, stride_pos,          \
                      stride_head, block_size, capacity, token_offset, false);                                     \
    }

TIERCACHE_PAGED_KV(w16, uint4)
TIERCACHE_PAGED_KV(w8, unsigned long long)
TIERCACHE_PAGED_KV(w4, unsigned int)
TIERCACHE_PAGED_KV(w2, unsigned short)
TIERCACHE_PAGED_KV(w1, unsigned char)
