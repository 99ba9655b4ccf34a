// inferd CUDA kernels: weight matrices of every type times a few tokens' activations (decode
// and small batches; prefill's large batches are cuBLAS's once the weights are F16/BF16, or
// these in groups of MV_TOKENS). Compiled after common.cuh (kernels/src/cuda/mod.rs).
//
// One warp per weight row: lane l decodes weights l, l + 32, ... (for the 32-weight block types
// one block per step, the bytes of a step contiguous across the warp), multiplies each with
// every token's activation and the warp sums the lanes at the end. Activations stay f32, so the
// result differs from the CPU backend's 8-bit activation products by their rounding only.

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

// y[t * n + i] += bias[i] (the QKV biases of Qwen 2).
extern "C" __global__ void add_bias(float* y, const float* bias, int n, int tokens) {
    long long total = (long long)n * tokens;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
        y[i] += bias[i % n];
    }
}
