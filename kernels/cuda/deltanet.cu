// inferd CUDA kernels: Gated DeltaNet's recurrence (Qwen3.5 / 3.6, Qwen3-Next) in the chunked
// form of the CPU's `deltanet::step` (kernels/src/deltanet.rs), on the same state layout, so a
// sequence's state means the same on either backend and goes back the same way (a speculative
// step's rejected rows): per sequence two chunks' keys (even chunks', then odd chunks': CHUNK
// rows of k_heads * dk), then per value head an even chunk's half and an odd chunk's, each the
// state S_0 at the chunk's start (dv rows of dk), the chunk's corrected values (CHUNK rows of
// dv) and cumulative log decays (CHUNK). The arithmetic is the CPU's, in its order (the same
// eight-lane dot products, no fused multiply-adds), so the host emulation computes the CPU's
// floats. Compiled after common.cuh (kernels/src/cuda/mod.rs); the calls (calls.rs) launch a
// chunk's segment at a time, so the blocks of one launch never touch a key row another writes.

#define DELTA_CHUNK 64

// a . b in eight lanes (element i into lane i mod 8, the lanes summed pairwise, the tail after),
// as the CPU's `dot`.
__device__ float delta_dot(const float* a, const float* b, int n) {
    float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    int full = n / 8 * 8;
    for (int i = 0; i < full; i += 8) {
        for (int l = 0; l < 8; l++) acc[l] = ADD(acc[l], MUL(a[i + l], b[i + l]));
    }
    float sum = ADD(ADD(ADD(acc[0], acc[4]), ADD(acc[1], acc[5])), ADD(ADD(acc[2], acc[6]), ADD(acc[3], acc[7])));
    for (int i = full; i < n; i++) sum = ADD(sum, MUL(a[i], b[i]));
    return sum;
}

// The query/key head value head h reads: tiled (Qwen3.5) or grouped (Qwen3-Next).
__device__ int delta_key_head(int h, int k_heads, int v_heads, int grouped) {
    return grouped ? h / (v_heads / k_heads) : h % k_heads;
}

// One value head's S_0 for the chunk after a whole one (block h): from the other half's S_0,
// corrected values and decays and that chunk's keys (half 1 - par), into half par's S_0:
// Gamma_C S_0 + sum_r (Gamma_C / Gamma_r) u_r k_r^T, each value getting the rows' terms in order.
extern "C" __global__ void delta_finish(float* state, long long off, int par, int k_heads, int v_heads, int dk,
                                        int dv, int grouped) {
    __shared__ float f[DELTA_CHUNK];
    __shared__ float decay;
    int h = blockIdx.x, kh = delta_key_head(h, k_heads, v_heads, grouped);
    long long kr = (long long)DELTA_CHUNK * k_heads * dk, half = (long long)dv * dk + DELTA_CHUNK * (dv + 1);
    float* heads = state + off + 2 * kr;
    const float* from = heads + h * 2 * half + (1 - par) * half;
    float* to = heads + h * 2 * half + par * half;
    const float* keys = state + off + (1 - par) * kr;
    const float* urows = from + (long long)dv * dk;
    const float* grows = urows + DELTA_CHUNK * dv;
    float last = grows[DELTA_CHUNK - 1];
    for (int r = threadIdx.x; r < DELTA_CHUNK; r += blockDim.x) f[r] = expf(last - grows[r]);
    if (threadIdx.x == 0) decay = expf(last);
    __syncthreads();
    for (int e = threadIdx.x; e < dv * dk; e += blockDim.x) {
        int j = e / dk, i = e % dk;
        float x = MUL(from[e], decay);
        for (int r = 0; r < DELTA_CHUNK; r++) {
            float a = MUL(f[r], urows[r * dv + j]);
            x = ADD(x, MUL(a, keys[((long long)r * k_heads + kh) * dk + i]));
        }
        to[e] = x;
    }
}

// The keys of a segment's m rows (k from row t0, k_heads * dk a row) into half par's key rows
// from row c0.
extern "C" __global__ void delta_keys(float* state, long long off, int par, int c0, const float* k, long long t0,
                                      int m, int kdim) {
    float* rows = state + off + (long long)par * DELTA_CHUNK * kdim + (long long)c0 * kdim;
    const float* src = k + t0 * kdim;
    for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < (long long)m * kdim;
         e += (long long)gridDim.x * blockDim.x) {
        rows[e] = src[e];
    }
}

// A segment's m rows (the call's tokens t0.., chunk rows c0.. of half par) of value head h
// (block h; a thread per value row j): each row's cumulative decay, corrected value
// u_c = beta (v_c - Gamma_c S_0 k_c - sum_{r<c} (Gamma_c / Gamma_r)(k_c . k_r) u_r) and output
// o_c = (Gamma_c S_0 q_c + sum_{r<=c} (Gamma_c / Gamma_r)(k_r . q_c) u_r) / sqrt(dk), into
// out (tokens, v_heads, dv). q (k_heads * dk a token), v, g and beta (v_heads a token) are the
// call's rows; the keys are already in the state (delta_keys).
extern "C" __global__ void delta_rows(float* state, long long off, int par, int c0, int m, const float* q,
                                      const float* v, const float* g, const float* beta, long long t0, float* out,
                                      int k_heads, int v_heads, int dk, int dv, int grouped) {
    int h = blockIdx.x, kh = delta_key_head(h, k_heads, v_heads, grouped);
    long long kr = (long long)DELTA_CHUNK * k_heads * dk, half = (long long)dv * dk + DELTA_CHUNK * (dv + 1);
    const float* keys = state + off + par * kr;
    float* st = state + off + 2 * kr + h * 2 * half + par * half;
    float* urows = st + (long long)dv * dk;
    float* grows = urows + DELTA_CHUNK * dv;
    float scale = 1.0f / sqrtf((float)dk);
    for (int jj = 0; jj < m; jj++) {
        int c = c0 + jj;
        long long t = t0 + jj;
        if (threadIdx.x == 0) grows[c] = ADD(c == 0 ? 0.0f : grows[c - 1], g[t * v_heads + h]);
        __syncthreads();
        float gc = grows[c], gam = expf(gc), b = beta[t * v_heads + h];
        const float* qt = q + (t * k_heads + kh) * dk;
        const float* kt = keys + ((long long)c * k_heads + kh) * dk;
        for (int j = threadIdx.x; j < dv; j += blockDim.x) {
            const float* row = st + (long long)j * dk;
            float u = MUL(b, v[(t * v_heads + h) * dv + j] - MUL(gam, delta_dot(row, kt, dk)));
            float o = MUL(gam, delta_dot(row, qt, dk));
            for (int r = 0; r < c; r++) {
                float fr = MUL(MUL(b, expf(gc - grows[r])), delta_dot(kt, keys + ((long long)r * k_heads + kh) * dk, dk));
                u = u - MUL(fr, urows[r * dv + j]);
            }
            urows[c * dv + j] = u;
            for (int r = 0; r <= c; r++) {
                float fr = MUL(expf(gc - grows[r]), delta_dot(keys + ((long long)r * k_heads + kh) * dk, qt, dk));
                o = ADD(o, MUL(fr, r < c ? urows[r * dv + j] : u));
            }
            out[(t * v_heads + h) * dv + j] = MUL(o, scale);
        }
        __syncthreads();
    }
}

// The causal depthwise convolution in front of the recurrence, then SiLU: rows t0.. of x (n of
// them, `channels` a row, positions start..) into the same rows of out, the taps w (width rows
// of channels, the oldest first) over each row and the width - 1 inputs before it: x's rows,
// or the sequence's ring (rows of channels from ring_off, position p in row p mod rows), or
// zeros before position 0 (as the CPU's deltanet::conv, its taps in the same order).
extern "C" __global__ void delta_conv(const float* x, const float* ring, long long ring_off, int rows, const float* w,
                                      int width, int channels, long long start, int n, long long t0, float* out) {
    for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < (long long)n * channels;
         e += (long long)gridDim.x * blockDim.x) {
        long long t = e / channels;
        int c = (int)(e % channels);
        float o = 0.0f;
        for (int tap = 0; tap < width; tap++) {
            int back = width - 1 - tap;
            float in;
            if (t >= back) {
                in = x[(t0 + t - back) * channels + c];
            } else {
                long long p = start + t - back;
                if (p < 0) continue;
                in = ring[ring_off + (p % rows) * channels + c];
            }
            o = ADD(o, MUL(in, w[(long long)tap * channels + c]));
        }
        out[(t0 + t) * channels + c] = o / (1.0f + expf(-o));
    }
}

// The rows delta_conv read from x into the ring after it (the last `rows` of them), so a later
// call finds them (and a call that goes back finds the earlier ones still there).
extern "C" __global__ void delta_ring(const float* x, float* ring, long long ring_off, int rows, int channels,
                                      long long start, int n, long long t0) {
    int first = n > rows ? n - rows : 0;
    for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < (long long)(n - first) * channels;
         e += (long long)gridDim.x * blockDim.x) {
        long long t = first + e / channels;
        int c = (int)(e % channels);
        ring[ring_off + ((start + t) % rows) * channels + c] = x[(t0 + t) * channels + c];
    }
}

// Sum over the block's threads in double (blockDim.x a power of two, at most 256), through
// shared memory.
__device__ double delta_block_sum(double v) {
    __shared__ double part[256];
    part[threadIdx.x] = v;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s /= 2) {
        if ((int)threadIdx.x < s) part[threadIdx.x] += part[threadIdx.x + s];
        __syncthreads();
    }
    double total = part[0];
    __syncthreads();
    return total;
}

// Row blockIdx.x of the convolved inputs (queries: k_heads heads of dk, keys the same, values
// vd) into q, k and v, each query and key head L2-normalized as the CPU's l2_norm_each: over
// max(|x|, eps), the sum of squares in double.
extern "C" __global__ void delta_split(const float* xc, int k_heads, int dk, int vd, float eps, float* q, float* k,
                                       float* v) {
    long long t = blockIdx.x;
    int kd = k_heads * dk;
    const float* row = xc + t * (2 * kd + vd);
    for (int piece = 0; piece < 2 * k_heads; piece++) {
        const float* src = row + piece * dk;
        double ss = 0.0;
        for (int i = threadIdx.x; i < dk; i += blockDim.x) ss += (double)src[i] * (double)src[i];
        ss = delta_block_sum(ss);
        float scale = 1.0f / fmaxf((float)sqrt(ss), eps);
        float* dst = piece < k_heads ? q + t * kd + piece * dk : k + t * kd + (piece - k_heads) * dk;
        for (int i = threadIdx.x; i < dk; i += blockDim.x) dst[i] = MUL(src[i], scale);
    }
    for (int i = threadIdx.x; i < vd; i += blockDim.x) v[t * vd + i] = row[2 * kd + i];
}

// The log decays g = softplus(alpha + dt_bias) * a (softplus linear past 20, as llama.cpp's)
// and write strengths beta = sigmoid(b) of n tokens' heads.
extern "C" __global__ void delta_gates(const float* alpha, const float* b, const float* dt_bias, const float* a,
                                       int heads, long long n, float* g, float* beta) {
    for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < n * heads;
         e += (long long)gridDim.x * blockDim.x) {
        int h = (int)(e % heads);
        float x = ADD(alpha[e], dt_bias[h]);
        float sp = x > 20.0f ? x : logf(1.0f + expf(x));
        g[e] = MUL(sp, a[h]);
        beta[e] = 1.0f / (1.0f + expf(-b[e]));
    }
}
