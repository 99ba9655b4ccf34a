// inferd CUDA kernels: weight matrices of every type times a few tokens' activations (decode
// and small batches; prefill's large batches are cuBLAS's once the weights are halves).
// Compiled after common.cuh (kernels/src/cuda/mod.rs).
//
// Quantized weights (matvec_q8) take 8-bit activations, rounded as the CPU backend rounds them
// (quantize_q8), and multiply them group by group in integers, as the CPU's products do: each
// group's term is the CPU's to the bit, only the order of the groups' sum differs. A warp per
// weight row, lane l taking groups l, l + 32, ... (a warp reads 32 consecutive groups at a
// time), every token's product from one decoding of the group; the block's rows share the
// activations, staged in shared memory. Float weights (F16, BF16, F32; matvec) keep f32 activations, lane l taking
// weights l, l + 32, ...

#define MV_TOKENS 8

// y[t * rows + r] = sum_k W[r][k] * x[t * cols + k] for t < tokens, r < rows: grid row
// blockIdx.y takes tokens MV_TOKENS * blockIdx.y onwards, at most MV_TOKENS of them.
extern "C" __global__ void matvec(const uint8_t* w, int type, long long row_bytes, int rows, int cols,
                                  const float* x, int tokens, float* y) {
    int r = blockIdx.x * blockDim.y + threadIdx.y;
    if (r >= rows) return;
    int t0 = blockIdx.y * MV_TOKENS;
    x += (long long)t0 * cols;
    y += (long long)t0 * rows;
    tokens = tokens - t0 < MV_TOKENS ? tokens - t0 : MV_TOKENS;
    int lane = threadIdx.x;
    const uint8_t* row = w + (long long)r * row_bytes;
    float acc[MV_TOKENS];
    for (int t = 0; t < MV_TOKENS; t++) acc[t] = 0.0f;
    for (int k = lane; k < cols; k += 32) {
        float wk = row_weight(type, row, k);
        for (int t = 0; t < MV_TOKENS; t++) {
            if (t < tokens) acc[t] += wk * x[(long long)t * cols + k];
        }
    }
    for (int t = 0; t < MV_TOKENS; t++) {
        float v = acc[t];
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0 && t < tokens) y[(long long)t * rows + r] = v;
    }
}

// The activations of `groups` groups of 32 as the CPU backend's quantize_q8 rounds them
// (kernels/src/cpu/scalar.rs): d = amax / 127, q = x * (127 / amax) rounded to nearest even;
// xd[g] = d, and xs[2 g + h] the sum of half h's quants (the offset terms of the products). A
// warp per group, lane l its weight l.
extern "C" __global__ void quantize_q8(const float* x, long long groups, int8_t* xq, float* xd, int* xs) {
    int lane = threadIdx.x;
    for (long long g = blockIdx.x * (long long)blockDim.y + threadIdx.y; g < groups;
         g += (long long)gridDim.x * blockDim.y) {
        float v = x[g * 32 + lane];
        float amax = fabsf(v);
        for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        float id = amax != 0.0f ? 127.0f / amax : 0.0f;
        int q = round_even(v * id);
        xq[g * 32 + lane] = (int8_t)q;
        int sum = q;
        for (int o = 8; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
        if (lane == 0) {
            xd[g] = amax / 127.0f;
            xs[2 * g] = sum;
        }
        if (lane == 16) xs[2 * g + 1] = sum;
    }
}

// The 32 activation bytes of a group (32-byte aligned) as 8 words.
INFERD_DEVICE void act_words(const int8_t* a, int* w) {
    uint4 lo = load16(a), hi = load16(a + 16);
    w[0] = (int)lo.x, w[1] = (int)lo.y, w[2] = (int)lo.z, w[3] = (int)lo.w;
    w[4] = (int)hi.x, w[5] = (int)hi.y, w[6] = (int)hi.z, w[7] = (int)hi.w;
}

// matvec_q8's blocks: MVQ_ROWS weight rows, a warp each; the activations of the block's tokens
// staged in shared memory MVQ_CHUNK groups at a time, read there by every row of the block.
#define MVQ_ROWS 8
#define MVQ_CHUNK 128

// A chunk of the activations in shared memory: per token, the quants of MVQ_CHUNK groups, their
// scales and their halves' sums.
struct Q8Chunk {
    int8_t q[MV_TOKENS][MVQ_CHUNK * 32];
    float d[MV_TOKENS][MVQ_CHUNK];
    int s[MV_TOKENS][MVQ_CHUNK * 2];
};

// Lane `lane`'s share of row `row`'s product with the staged chunk (groups c0 .. c0 + n of the
// row; tokens t < tokens), into acc, for a weight type known at compile time (group_ints then
// has no branches): groups lane, lane + 32, ..., two decoded before either is multiplied.
template <int TYPE>
__device__ __forceinline__ void matvec_q8_chunk(const uint8_t* row, int c0, int n, const Q8Chunk* a, int tokens,
                                                int lane, float* acc) {
    for (int k0 = lane; k0 < n; k0 += 64) {
        GroupQ gr[2];
        for (int u = 0; u < 2; u++) {
            int k = k0 + 32 * u;
            group_ints(TYPE, row, c0 + (k < n ? k : k0), &gr[u]);
        }
        for (int u = 0; u < 2; u++) {
            int k = k0 + 32 * u;
            if (k >= n) break;
            for (int t = 0; t < MV_TOKENS && t < tokens; t++) {
                int w[8];
                act_words(a->q[t] + 32 * k, w);
                int lo = 0, hi = 0;
                for (int i = 0; i < 4; i++) {
                    lo = dot4(gr[u].q[i], w[i], lo);
                    hi = dot4(gr[u].q[i + 4], w[i + 4], hi);
                }
                float da = a->d[t][k];
                acc[t] += MUL(MUL(da, gr[u].d), (float)(gr[u].sc[0] * lo + gr[u].sc[1] * hi));
                if (gr[u].has_min) {
                    int ms = gr[u].m[0] * a->s[t][2 * k] + gr[u].m[1] * a->s[t][2 * k + 1];
                    acc[t] += MUL(MUL(da, gr[u].dmin), (float)ms);
                }
            }
        }
    }
}

// y[t * rows + r] = sum over groups of row r of w against token t's 8-bit activations (xq, xd,
// xs from quantize_q8; cols a multiple of 32), for t < tokens: block (blockIdx.x, blockIdx.y)
// takes rows MVQ_ROWS * blockIdx.x onwards (a warp each) and tokens MV_TOKENS * blockIdx.y
// onwards, at most MV_TOKENS of them. Per group, as the CPU's dot_group: (d_a d) sum_h sc[h]
// (q . a)_h + (d_a dmin) sum_h m[h] (sum a)_h.
extern "C" __global__ void matvec_q8(const uint8_t* w, int type, long long row_bytes, int rows, int cols,
                                     const int8_t* xq, const float* xd, const int* xs, int tokens, float* y) {
    __shared__ __align__(16) Q8Chunk a;
    int lane = threadIdx.x, warp = threadIdx.y, tid = warp * 32 + lane, nthreads = 32 * MVQ_ROWS;
    int r = blockIdx.x * MVQ_ROWS + warp;
    int t0 = blockIdx.y * MV_TOKENS;
    tokens = tokens - t0 < MV_TOKENS ? tokens - t0 : MV_TOKENS;
    int groups = cols / 32;
    const uint8_t* row = w + (long long)(r < rows ? r : 0) * row_bytes;
    float acc[MV_TOKENS];
    for (int t = 0; t < MV_TOKENS; t++) acc[t] = 0.0f;
    for (int c0 = 0; c0 < groups; c0 += MVQ_CHUNK) {
        int n = groups - c0 < MVQ_CHUNK ? groups - c0 : MVQ_CHUNK;
        __syncthreads();
        for (int t = 0; t < tokens; t++) {
            long long g0 = (long long)(t0 + t) * groups + c0;
            for (int i = tid; i < 2 * n; i += nthreads) {  // 16 bytes of quants each
                store16(a.q[t] + 16 * i, load16(xq + g0 * 32 + 16 * i));
            }
            for (int i = tid; i < n; i += nthreads) {
                a.d[t][i] = xd[g0 + i];
                a.s[t][2 * i] = xs[2 * (g0 + i)];
                a.s[t][2 * i + 1] = xs[2 * (g0 + i) + 1];
            }
        }
        __syncthreads();
        if (r >= rows) continue;
#define MVQ_CASE(T)                                                           \
    case T: matvec_q8_chunk<T>(row, c0, n, &a, tokens, lane, acc); \
        break;
        switch (type) {
            MVQ_CASE(W_Q4_0)
            MVQ_CASE(W_Q4_1)
            MVQ_CASE(W_Q5_0)
            MVQ_CASE(W_Q5_1)
            MVQ_CASE(W_Q8_0)
            MVQ_CASE(W_Q2_K)
            MVQ_CASE(W_Q3_K)
            MVQ_CASE(W_Q4_K)
            MVQ_CASE(W_Q5_K)
            MVQ_CASE(W_Q6_K)
            MVQ_CASE(W_IQ4_NL)
            MVQ_CASE(W_IQ4_XS)
            MVQ_CASE(W_MXFP4)
            default: break;
        }
#undef MVQ_CASE
    }
    if (r >= rows) return;
    for (int t = 0; t < MV_TOKENS; t++) {
        float v = acc[t];
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0 && t < tokens) y[(long long)(t0 + t) * rows + r] = v;
    }
}

// y[t * n + i] += bias[i] (the QKV biases of Qwen 2).
extern "C" __global__ void add_bias(float* y, const float* bias, int n, int tokens) {
    long long total = (long long)n * tokens;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
        y[i] += bias[i % n];
    }
}
