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
// Positions per K/V tile, and the query rows' floats a block holds (rows x head_dim).
#define ATT_TILE 32
#define ATT_Q_FLOATS 3584
#define ATT_WARPS 4
// 16-byte loads per thread to stage a tile's K (or V) at the largest head size.
#define ATT_STAGE (ATT_TILE * ATT_MAX_HEAD_DIM / 8 / (32 * ATT_WARPS))

// One block per (tile of query tokens, KV head, chunk of that KV head's query heads, split of
// the positions): the block's rows are (token, head) pairs, token-major, RPW of them per warp;
// it walks the tile's positions ATT_TILE at a time, K and V of those positions staged in shared
// memory once for all its rows (so the query heads of a KV head, and the tokens of a prefill
// chunk, share each load). Scores are scale * q . k; a streaming softmax per row, lane l taking
// position l of a K/V tile for the scores and output dimensions l, l + 32, ... (DPL of them)
// for the values. Query t sits at position q_pos[t] of its sequence and sees positions
// max(0, q_pos - window + 1) ..= q_pos (window 0: all), whose K/V live in the blocks of its
// table (tables + table_of[t] * table_len); a tile's tokens share a table. With splits > 1 the
// block covers positions [lo + split * split_len, lo + (split + 1) * split_len) of its tile
// (lo the tile's first visible position) and leaves its unnormalized output and its (max, sum)
// in part_o / part_ml for attention_combine; else it writes out: (tokens, q_heads, head_dim).
// With has_sinks, head h's sink logit sinks[h] joins each of its rows' softmax denominators
// (gpt-oss), added where the splits are merged when split.
template <int DPL, int RPW>
__device__ void attention_block(const float* q, const uint16_t* k_cache, const uint16_t* v_cache, const int* tables,
                                const int* table_of, int table_len, const int* q_pos, int t0, int count, int h0, int nh,
                                int kvh, int split, int splits, int split_len, int tokens, int q_heads, int kv_heads,
                                int head_dim, int block_size, int window, float scale, const float* sinks,
                                int has_sinks, float* out, float* part_o, float* part_ml, float* qs, uint32_t* ks,
                                uint16_t* vs) {
    int lane = threadIdx.x, warp = threadIdx.y, tid = warp * 32 + lane, nthreads = 32 * ATT_WARPS;
    int rows = count * nh, kv_dim = kv_heads * head_dim, words = head_dim / 2, kstride = words + 1;
    const int* table = tables + (long long)table_of[t0] * table_len;
    // The tile's visible positions, and this split's share of them.
    int lo = q_pos[t0], hi = q_pos[t0];
    for (int i = 0; i < count; i++) {
        int p = q_pos[t0 + i];
        int first = window > 0 && p + 1 > window ? p + 1 - window : 0;
        lo = first < lo ? first : lo;
        hi = p > hi ? p : hi;
    }
    int start = lo + split * split_len;
    int end = splits > 1 && start + split_len - 1 < hi ? start + split_len - 1 : hi;
    for (int i = tid; i < rows * head_dim; i += nthreads) {
        int r = i / head_dim, d = i % head_dim;
        qs[i] = q[((long long)(t0 + r / nh) * q_heads + h0 + r % nh) * head_dim + d];
    }
    // This warp's rows: their positions and visible ranges, running max and sum, outputs.
    int row_pos[RPW], row_first[RPW];
    float m[RPW], l[RPW], acc[RPW][DPL];
    for (int rr = 0; rr < RPW; rr++) {
        int r = warp * RPW + rr;
        int p = r < rows ? q_pos[t0 + r / nh] : -1;
        row_pos[rr] = p;
        row_first[rr] = window > 0 && p + 1 > window ? p + 1 - window : 0;
        m[rr] = NEG_INF;
        l[rr] = 0.0f;
        for (int i = 0; i < DPL; i++) acc[rr][i] = 0.0f;
    }
    for (int p0 = start; p0 <= end; p0 += ATT_TILE) {
        __syncthreads();
        // K and V of the tile's positions (zeros past `end` or in a released block) into shared
        // memory: 8 halves per load where the head size allows (every thread's loads issued
        // before its stores), else a word per load.
        if (head_dim % 8 == 0) {
            int vecs = head_dim / 8;
            uint4 kv[ATT_STAGE], vv[ATT_STAGE];
            for (int u = 0; u < ATT_STAGE; u++) {
                int i = tid + u * nthreads, j = i / vecs, c = i % vecs, p = p0 + j;
                kv[u] = vv[u] = uint4{0, 0, 0, 0};
                int b = i < ATT_TILE * vecs && p <= end ? table[p / block_size] : -1;
                if (b >= 0) {
                    long long at = ((long long)b * block_size + p % block_size) * kv_dim + (long long)kvh * head_dim + 8 * c;
                    kv[u] = load16(k_cache + at);
                    vv[u] = load16(v_cache + at);
                }
            }
            for (int u = 0; u < ATT_STAGE; u++) {
                int i = tid + u * nthreads, j = i / vecs, c = i % vecs;
                if (i >= ATT_TILE * vecs) break;
                uint32_t* kd = ks + j * kstride + 4 * c;
                kd[0] = kv[u].x, kd[1] = kv[u].y, kd[2] = kv[u].z, kd[3] = kv[u].w;
                store16(vs + j * head_dim + 8 * c, vv[u]);
            }
        } else {
            for (int i = tid; i < ATT_TILE * words; i += nthreads) {
                int j = i / words, w = i % words, p = p0 + j;
                uint32_t kw = 0, vw = 0;
                int b = p <= end ? table[p / block_size] : -1;
                if (b >= 0) {
                    long long at = ((long long)b * block_size + p % block_size) * kv_dim + (long long)kvh * head_dim + 2 * w;
                    kw = u32_a4((const uint8_t*)(k_cache + at));
                    vw = u32_a4((const uint8_t*)(v_cache + at));
                }
                ks[j * kstride + w] = kw;
                vs[j * head_dim + 2 * w] = (uint16_t)(vw & 0xffffu);
                vs[j * head_dim + 2 * w + 1] = (uint16_t)(vw >> 16);
            }
        }
        __syncthreads();
        // Scores: lane l against position p0 + l, for every row of the warp.
        float s[RPW];
        for (int rr = 0; rr < RPW; rr++) s[rr] = 0.0f;
        const float* qw = qs + warp * RPW * head_dim;
        for (int w = 0; w < words; w++) {
            uint32_t kw = ks[lane * kstride + w];
            float k0 = f16_bits_to_f32((uint16_t)(kw & 0xffffu)), k1 = f16_bits_to_f32((uint16_t)(kw >> 16));
            for (int rr = 0; rr < RPW; rr++) {
                s[rr] += qw[rr * head_dim + 2 * w] * k0;
                s[rr] += qw[rr * head_dim + 2 * w + 1] * k1;
            }
        }
        int p = p0 + lane;
        float e[RPW];
        for (int rr = 0; rr < RPW; rr++) {
            bool seen = p <= end && p <= row_pos[rr] && p >= row_first[rr];
            float sc = seen ? s[rr] * scale : NEG_INF;
            float tile_max = sc;
            for (int o = 16; o > 0; o >>= 1) tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, o));
            float new_max = fmaxf(m[rr], tile_max);
            float correction = m[rr] == NEG_INF ? 0.0f : expf(m[rr] - new_max);
            e[rr] = seen ? expf(sc - new_max) : 0.0f;
            float sum = e[rr];
            for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
            if (new_max != NEG_INF) {
                l[rr] = l[rr] * correction + sum;
                for (int i = 0; i < DPL; i++) acc[rr][i] *= correction;
                m[rr] = new_max;
            }
        }
        // Values: every lane adds the tile's positions to its own dimensions.
        int in_tile = end - p0 + 1 < ATT_TILE ? end - p0 + 1 : ATT_TILE;
        for (int j = 0; j < in_tile; j++) {
            float v[DPL];
            for (int i = 0; i < DPL; i++) {
                int d = lane + 32 * i;
                v[i] = d < head_dim ? f16_bits_to_f32(vs[j * head_dim + d]) : 0.0f;
            }
            for (int rr = 0; rr < RPW; rr++) {
                float ej = __shfl_sync(0xffffffffu, e[rr], j);
                for (int i = 0; i < DPL; i++) acc[rr][i] += ej * v[i];
            }
        }
    }
    for (int rr = 0; rr < RPW; rr++) {
        int r = warp * RPW + rr;
        if (r >= rows) break;
        int t = t0 + r / nh, h = h0 + r % nh;
        long long row = (long long)t * q_heads + h;
        for (int i = 0; i < DPL; i++) {
            int d = lane + 32 * i;
            if (d >= head_dim) continue;
            if (splits > 1) {
                part_o[((long long)split * tokens * q_heads + row) * head_dim + d] = acc[rr][i];
            } else {
                // A sink's logit joins the denominator (and nothing the values).
                float z = l[rr] + (has_sinks && m[rr] != NEG_INF ? expf(sinks[h] - m[rr]) : 0.0f);
                out[row * head_dim + d] = z > 0.0f ? acc[rr][i] / z : 0.0f;
            }
        }
        if (splits > 1 && lane == 0) {
            part_ml[2 * ((long long)split * tokens * q_heads + row)] = m[rr];
            part_ml[2 * ((long long)split * tokens * q_heads + row) + 1] = l[rr];
        }
    }
}

// The grid: x over tiles (tiles[2 x] = first token, tiles[2 x + 1] = token count), y over
// (KV head, chunk of heads_per_block of its query heads, split), split fastest. Blocks of 32 x
// ATT_WARPS threads. The rows per warp and dimensions per lane follow head_dim (the host's
// tiles hold at most 4 * RPW rows: kernels/src/cuda/calls.rs, attention_rows).
extern "C" __global__ void attention(const float* q, const uint16_t* k_cache, const uint16_t* v_cache,
                                     const int* tables, const int* table_of, int table_len, const int* q_pos,
                                     const int* tiles, int heads_per_block, int splits, int split_len, int tokens,
                                     int q_heads, int kv_heads, int head_dim, int block_size, int window, float scale,
                                     const float* sinks, int has_sinks, float* out, float* part_o, float* part_ml) {
    __shared__ float qs[ATT_Q_FLOATS];
    __shared__ uint32_t ks[ATT_TILE * (ATT_MAX_HEAD_DIM / 2 + 1)];
    __shared__ __align__(16) uint16_t vs[ATT_TILE * ATT_MAX_HEAD_DIM];
    int group = q_heads / kv_heads, chunks = (group + heads_per_block - 1) / heads_per_block;
    int split = blockIdx.y % splits, chunk = blockIdx.y / splits % chunks, kvh = blockIdx.y / splits / chunks;
    int h0 = kvh * group + chunk * heads_per_block;
    int nh = group - chunk * heads_per_block < heads_per_block ? group - chunk * heads_per_block : heads_per_block;
    int t0 = tiles[2 * blockIdx.x], count = tiles[2 * blockIdx.x + 1];
#define ATT_ARGS                                                                                                    \
    q, k_cache, v_cache, tables, table_of, table_len, q_pos, t0, count, h0, nh, kvh, split, splits, split_len, tokens, \
        q_heads, kv_heads, head_dim, block_size, window, scale, sinks, has_sinks, out, part_o, part_ml, qs, ks, vs
    if (head_dim <= 32) {
        attention_block<1, 14>(ATT_ARGS);
    } else if (head_dim <= 64) {
        attention_block<2, 14>(ATT_ARGS);
    } else if (head_dim <= 128) {
        attention_block<4, 7>(ATT_ARGS);
    } else {
        attention_block<8, 3>(ATT_ARGS);
    }
#undef ATT_ARGS
}

// The splits of attention's positions merged: per (token, head) row, out = sum_s o_s
// exp(m_s - M) / (sum_s l_s exp(m_s - M) + sink), M the largest m_s, sink = exp(sinks[h] - M)
// for the row's head h where has_sinks, else 0. A warp per row.
extern "C" __global__ void attention_combine(const float* part_o, const float* part_ml, int splits, int rows,
                                             int head_dim, const float* sinks, int has_sinks, int q_heads,
                                             float* out) {
    int row = blockIdx.x * blockDim.y + threadIdx.y;
    if (row >= rows) return;
    float mx = NEG_INF;
    for (int s = 0; s < splits; s++) mx = fmaxf(mx, part_ml[2 * ((long long)s * rows + row)]);
    float total = 0.0f;
    for (int s = 0; s < splits; s++) {
        float ms = part_ml[2 * ((long long)s * rows + row)];
        total += ms == NEG_INF ? 0.0f : part_ml[2 * ((long long)s * rows + row) + 1] * expf(ms - mx);
    }
    if (has_sinks && mx != NEG_INF) total += expf(sinks[row % q_heads] - mx);
    for (int d = threadIdx.x; d < head_dim; d += 32) {
        float v = 0.0f;
        for (int s = 0; s < splits; s++) {
            float ms = part_ml[2 * ((long long)s * rows + row)];
            if (ms != NEG_INF) v += part_o[((long long)s * rows + row) * head_dim + d] * expf(ms - mx);
        }
        out[(long long)row * head_dim + d] = total > 0.0f ? v / total : 0.0f;
    }
}
