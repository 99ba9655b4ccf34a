// inferd CUDA kernels: the paged KV cache (vLLM's design, as the CPU backend's): storing new
// tokens' K and V in their slots, copying blocks for copy-on-write forks, and attention of
// queries over their sequence's blocks, for decode and for chunked prefill alike. Compiled
// after common.cuh (kernels/src/cuda/mod.rs).
//
// Cache layout, per layer slot: [block][position in block][kv head][head_dim], f16, so a
// block is block_size * kv_dim contiguous halves and a position's K (or V) row is contiguous.

// The K and V rows of n tokens (n x kv_dim f32) into cache slots slot[t] (block * block_size +
// position in block).
extern "C" __global__ void kv_store(const float* k, const float* v, uint16_t* k_cache, uint16_t* v_cache,
                                    const int* slot, int kv_dim) {
    int t = blockIdx.x;
    long long base = (long long)slot[t] * kv_dim;
    for (int i = threadIdx.x; i < kv_dim; i += blockDim.x) {
        k_cache[base + i] = f32_to_f16_bits(k[(long long)t * kv_dim + i]);
        v_cache[base + i] = f32_to_f16_bits(v[(long long)t * kv_dim + i]);
    }
}

// Copies whole blocks: pairs[2 i] to pairs[2 i + 1], block_elems halves each, K and V.
extern "C" __global__ void kv_copy_blocks(uint16_t* k_cache, uint16_t* v_cache, const int* pairs,
                                          long long block_elems) {
    int p = blockIdx.y;
    long long src = (long long)pairs[2 * p] * block_elems, dst = (long long)pairs[2 * p + 1] * block_elems;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < block_elems;
         i += (long long)gridDim.x * blockDim.x) {
        k_cache[dst + i] = k_cache[src + i];
        v_cache[dst + i] = v_cache[src + i];
    }
}

#define ATT_MAX_HEAD_DIM 256
#define NEG_INF __int_as_float(0xff800000)

// One warp per (query token, query head). Query t sits at position q_pos[t] of its sequence
// and sees positions max(0, q_pos - window + 1) ..= q_pos (window 0: all), whose K/V live in
// the blocks of its table (tables + table_of[t] * table_len). Scores are scale * q . k; a
// streaming softmax over tiles of 32 positions (one per lane) accumulates V, each lane owning
// head_dim / 32 output dimensions. out: (tokens, q_heads, head_dim).
extern "C" __global__ void attention(const float* q, const uint16_t* k_cache, const uint16_t* v_cache,
                                     const int* tables, const int* table_of, int table_len, const int* q_pos,
                                     int q_heads, int kv_heads, int head_dim, int block_size, int window,
                                     float scale, float* out) {
    int t = blockIdx.x, h = blockIdx.y * blockDim.y + threadIdx.y;
    if (h >= q_heads) return;
    int lane = threadIdx.x;
    int kvh = h / (q_heads / kv_heads);
    int kv_dim = kv_heads * head_dim;
    const float* qv = q + ((long long)t * q_heads + h) * head_dim;
    const int* table = tables + (long long)table_of[t] * table_len;
    int last = q_pos[t];
    int first = window > 0 && last + 1 > window ? last + 1 - window : 0;
    const int per_lane = ATT_MAX_HEAD_DIM / 32;
    float acc[per_lane];
    for (int i = 0; i < per_lane; i++) acc[i] = 0.0f;
    float run_max = NEG_INF, run_sum = 0.0f;
    for (int p0 = first; p0 <= last; p0 += 32) {
        int p = p0 + lane;
        float s = NEG_INF;
        long long at = 0;
        if (p <= last) {
            at = ((long long)table[p / block_size] * block_size + p % block_size) * kv_dim + (long long)kvh * head_dim;
            float dot = 0.0f;
            for (int d = 0; d < head_dim; d++) dot += qv[d] * f16_bits_to_f32(k_cache[at + d]);
            s = dot * scale;
        }
        float tile_max = s;
        for (int o = 16; o > 0; o >>= 1) tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, o));
        float new_max = fmaxf(run_max, tile_max);
        float correction = run_max == NEG_INF ? 0.0f : expf(run_max - new_max);
        float e = p <= last ? expf(s - new_max) : 0.0f;
        float tile_sum = e;
        for (int o = 16; o > 0; o >>= 1) tile_sum += __shfl_xor_sync(0xffffffffu, tile_sum, o);
        run_sum = run_sum * correction + tile_sum;
        for (int i = 0; i < per_lane; i++) acc[i] *= correction;
        // Every lane adds the tile's positions to its own dimensions d = lane + 32 i.
        for (int j = 0; j < 32 && p0 + j <= last; j++) {
            float ej = __shfl_sync(0xffffffffu, e, j);
            long long atj = __shfl_sync(0xffffffffu, at, j);
            for (int i = 0; i < per_lane; i++) {
                int d = lane + 32 * i;
                if (d < head_dim) acc[i] += ej * f16_bits_to_f32(v_cache[atj + d]);
            }
        }
        run_max = new_max;
    }
    float* o = out + ((long long)t * q_heads + h) * head_dim;
    for (int i = 0; i < per_lane; i++) {
        int d = lane + 32 * i;
        if (d < head_dim) o[d] = acc[i] / run_sum;
    }
}
