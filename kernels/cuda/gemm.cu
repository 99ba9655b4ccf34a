// inferd CUDA kernels: the operands of prefill's large products, which cuBLAS multiplies (a
// GEMM of halves accumulated in f32): a weight matrix of any type decoded to halves, and the
// activations rounded to the same kind (f16; bf16 for a BF16 matrix, whose range f16 lacks).
// Compiled after common.cuh (kernels/src/cuda/mod.rs).

INFERD_DEVICE uint16_t to_half_bits(float v, int bf16) { return bf16 ? f32_to_bf16_bits(v) : f32_to_f16_bits(v); }

// out[r * cols + k] = weight k of row r, as a half: the decoding of row_weight, then one rounding.
extern "C" __global__ void dequantize_half(const uint8_t* w, int type, long long row_bytes, int rows, int cols,
                                           int bf16, uint16_t* out) {
    long long n = (long long)rows * cols;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        long long r = i / cols;
        out[i] = to_half_bits(row_weight(type, w + r * row_bytes, (int)(i - r * cols)), bf16);
    }
}

// out[i] = x[i] as a half, for i < n.
extern "C" __global__ void to_half(const float* x, long long n, int bf16, uint16_t* out) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        out[i] = to_half_bits(x[i], bf16);
    }
}
