// inferd CUDA kernels: the operands of prefill's large products, which cuBLAS multiplies (a
// GEMM of halves accumulated in f32): a weight matrix of any type decoded to halves, and the
// activations rounded to the same kind (f16; bf16 for a BF16 matrix, whose range f16 lacks).
// Compiled after common.cuh (kernels/src/cuda/mod.rs).

INFERD_DEVICE uint16_t to_half_bits(float v, int bf16) { return bf16 ? f32_to_bf16_bits(v) : f32_to_f16_bits(v); }

// 32 halves (64 bytes, 64-byte aligned) at out.
INFERD_DEVICE void store_halves(uint16_t* out, const uint16_t* h) {
    for (int k = 0; k < 4; k++) {
        const uint16_t* p = h + 8 * k;
        store16(out + 8 * k, uint4{p[0] | ((uint32_t)p[1] << 16), p[2] | ((uint32_t)p[3] << 16),
                                   p[4] | ((uint32_t)p[5] << 16), p[6] | ((uint32_t)p[7] << 16)});
    }
}

// out[r * cols + k] = weight k of row r, as a half: the weight decoded as row_weight decodes it
// (the CPU's rounding), then one rounding. Quantized types a thread per 32-weight group
// (group_ints, 64 bytes written at once), float types a thread per weight.
extern "C" __global__ void dequantize_half(const uint8_t* w, int type, long long row_bytes, int rows, int cols,
                                           int bf16, uint16_t* out) {
    long long first = blockIdx.x * (long long)blockDim.x + threadIdx.x, stride = (long long)gridDim.x * blockDim.x;
    if (block_len(type) >= 32) {
        int per_row = cols / 32;
        long long groups = (long long)rows * per_row;
        for (long long i = first; i < groups; i += stride) {
            long long r = i / per_row;
            int g = (int)(i - r * per_row);
            GroupQ gr;
            group_ints(type, w + r * row_bytes, g, &gr);
            uint16_t h[32];
            for (int e = 0; e < 32; e++) {
                int q = (int)(int8_t)(gr.q[e / 4] >> (8 * (e % 4)));
                float v = MUL(MUL(gr.d, (float)gr.sc[e / 16]), (float)q);
                if (gr.has_min) v = ADD(v, MUL(gr.dmin, (float)gr.m[e / 16]));
                h[e] = to_half_bits(v, bf16);
            }
            store_halves(out + r * cols + 32 * g, h);
        }
        return;
    }
    long long n = (long long)rows * cols;
    for (long long i = first; i < n; i += stride) {
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
