// inferd CUDA kernels: the elementwise and per-row operations of a transformer block
// (embedding lookup, RMSNorm, RoPE, gated activations, residual add). Compiled after
// common.cuh as one translation unit (kernels/src/cuda/mod.rs). Activations are f32,
// row-major, one row per token.

// out[t][k] = scale * weight k of embedding row ids[t].
extern "C" __global__ void embed(const uint8_t* table, int type, long long row_bytes, const int* ids, int cols,
                                 float scale, float* out) {
    int t = blockIdx.x;
    const uint8_t* row = table + (long long)ids[t] * row_bytes;
    for (int k = threadIdx.x; k < cols; k += blockDim.x) {
        out[(long long)t * cols + k] = MUL(row_weight(type, row, k), scale);
    }
}

// Sum over the block's threads (blockDim.x a multiple of 32, at most 1024).
__device__ float block_sum(float v) {
    __shared__ float warp_sums[32];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) warp_sums[warp] = v;
    __syncthreads();
    int warps = blockDim.x / 32;
    v = lane < warps ? warp_sums[lane] : 0.0f;
    if (warp == 0) {
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0) warp_sums[0] = v;
    }
    __syncthreads();
    float s = warp_sums[0];
    __syncthreads();
    return s;
}

// y = x * w / rms(x) per piece of `n` floats (one block per piece: a token's hidden state, or a
// head for QK-norm); y may be x.
// A piece of a multiple of 4 floats is read 4 at a time, each thread's values kept in registers
// between the two passes where they fit (RMS_KEEP float4s a thread).
#define RMS_KEEP 4
extern "C" __global__ void rms_norm(const float* x, const float* w, float* y, int n, float eps) {
    const float* xr = x + (long long)blockIdx.x * n;
    float* yr = y + (long long)blockIdx.x * n;
    float ss = 0.0f;
    if (n % 4 == 0 && n <= 4 * RMS_KEEP * (int)blockDim.x) {
        float4 v[RMS_KEEP];
        for (int u = 0; u < RMS_KEEP; u++) {
            int k = 4 * (threadIdx.x + u * blockDim.x);
            v[u] = k < n ? load_float4(xr + k) : float4{0.0f, 0.0f, 0.0f, 0.0f};
            ss += v[u].x * v[u].x + v[u].y * v[u].y + v[u].z * v[u].z + v[u].w * v[u].w;
        }
        ss = block_sum(ss);
        float inv = rsqrtf(ss / n + eps);
        for (int u = 0; u < RMS_KEEP; u++) {
            int k = 4 * (threadIdx.x + u * blockDim.x);
            if (k >= n) break;
            float4 g = load_float4(w + k);
            store_float4(yr + k, float4{v[u].x * inv * g.x, v[u].y * inv * g.y, v[u].z * inv * g.z, v[u].w * inv * g.w});
        }
        return;
    }
    for (int k = threadIdx.x; k < n; k += blockDim.x) ss += xr[k] * xr[k];
    ss = block_sum(ss);
    float inv = rsqrtf(ss / n + eps);
    for (int k = threadIdx.x; k < n; k += blockDim.x) yr[k] = xr[k] * inv * w[k];
}

// Rotates the first 2 * pairs dimensions of every head of every token: token t at position
// pos[t], frequency i's angle pos * inv_freq[i], both rotated values multiplied by `scale`
// (LongRoPE's and YaRN's magnitude factor). neox: pairs (i, i + pairs), else (2i, 2i + 1).
extern "C" __global__ void rope(float* x, const int* pos, const float* inv_freq, int heads, int head_dim,
                                int pairs, int neox, float scale) {
    int t = blockIdx.x;
    int total = heads * pairs;
    for (int idx = threadIdx.x; idx < total; idx += blockDim.x) {
        int h = idx / pairs, i = idx % pairs;
        float s, c;
        sincosf((float)pos[t] * inv_freq[i], &s, &c);
        s *= scale;
        c *= scale;
        float* head = x + ((long long)t * heads + h) * head_dim;
        int a = neox ? i : 2 * i, b = neox ? i + pairs : 2 * i + 1;
        float x0 = head[a], x1 = head[b];
        head[a] = x0 * c - x1 * s;
        head[b] = x0 * s + x1 * c;
    }
}

// gate = act(gate, up) over n values, by kind: 0 SwiGLU; 1 GeGLU with GELU's tanh form,
// computed as x * sigmoid(2 y) (the CPU backend's form, without tanh's cancellation); 2
// gpt-oss's clamped SwiGLU, x * sigmoid(1.702 x) * (y + 1) with x = min(gate, 7) and
// y = clamp(up, -7, 7).
extern "C" __global__ void gated_act(float* gate, const float* up, long long n, int kind) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        float x = gate[i];
        if (kind == 1) {
            float y = 0.7978845608028654f * (x + 0.044715f * x * x * x);
            gate[i] = x / (1.0f + expf(-2.0f * y)) * up[i];
        } else if (kind == 2) {
            x = fminf(x, 7.0f);
            float y = fminf(fmaxf(up[i], -7.0f), 7.0f);
            gate[i] = x / (1.0f + expf(-1.702f * x)) * (y + 1.0f);
        } else {
            gate[i] = x / (1.0f + expf(-x)) * up[i];
        }
    }
}

// x += y over n values.
extern "C" __global__ void add_in_place(float* x, const float* y, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        x[i] += y[i];
    }
}

// dst[i] = src[rows[i]], rows of n floats: the tokens whose logits are wanted.
extern "C" __global__ void gather_rows(const float* src, const int* rows, int n, float* dst) {
    int i = blockIdx.x;
    for (int k = threadIdx.x; k < n; k += blockDim.x) dst[(long long)i * n + k] = src[(long long)rows[i] * n + k];
}

// dst[rows[i]] += weights[i] * src[i] for rows of n floats: a mixture of experts' outputs of
// one expert added to the rows of the tokens that chose it (no row twice in a launch). A block
// per source row.
extern "C" __global__ void scatter_add_rows(const float* src, const int* rows, const float* weights, int n,
                                            float* dst) {
    int i = blockIdx.x;
    float w = weights[i];
    for (int k = threadIdx.x; k < n; k += blockDim.x) dst[(long long)rows[i] * n + k] += w * src[(long long)i * n + k];
}

// Each row of x is pairs of pieces of hd floats (a gated attention's query head and its gate):
// the first of pair p to a's piece p, the second to b's.
extern "C" __global__ void split_pairs(const float* x, long long pairs, int hd, float* a, float* b) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < pairs * hd;
         i += (long long)gridDim.x * blockDim.x) {
        long long p = i / hd, k = i % hd;
        a[i] = x[2 * p * hd + k];
        b[i] = x[(2 * p + 1) * hd + k];
    }
}

// x[i] *= f(g[i / per]) over n values, f the sigmoid (silu = 0) or g * sigmoid(g) (silu = 1):
// a gated attention's heads, a DeltaNet's output; per = 1 gates value by value.
extern "C" __global__ void gate_by(float* x, const float* g, long long n, long long per, int silu) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        float v = g[i / per], s = 1.0f / (1.0f + expf(-v));
        x[i] *= silu ? v * s : s;
    }
}

// n floats of buf from float `from` to float `to` (regions apart: a recurrent state's slot to
// another), or, with from < 0, set to zero at `to`.
extern "C" __global__ void move_floats(float* buf, long long from, long long to, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        buf[to + i] = from < 0 ? 0.0f : buf[from + i];
    }
}
