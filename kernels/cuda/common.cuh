// inferd CUDA kernels: what every kernel shares. The weight decoding below is also compiled as
// plain C++ on the host by the kernel crate's tests, which check it against the CPU backend's
// dequantizer on random blocks of every type (so no GPU is needed to test a block layout).
//
// Weight types are GGML's type ids. A weight is decoded exactly as the CPU reference decodes
// it (kernels/src/group.rs): w = (d * sc) * q + dmin * m, every product rounded on its own
// (MUL/ADD never contract into a fused multiply-add).
#pragma once

#if defined(__CUDACC_RTC__)
typedef unsigned char uint8_t;
typedef signed char int8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef int int32_t;
typedef unsigned long long uint64_t;
#define INFERD_DEVICE __device__ __forceinline__
#define MUL(a, b) __fmul_rn((a), (b))
#define ADD(a, b) __fadd_rn((a), (b))
#else
#include <math.h>
#include <stdint.h>
#include <string.h>
#define INFERD_DEVICE static inline
#define MUL(a, b) ((a) * (b))
#define ADD(a, b) ((a) + (b))
#endif

enum WeightType {
    W_F32 = 0,
    W_F16 = 1,
    W_Q4_0 = 2,
    W_Q4_1 = 3,
    W_Q5_0 = 6,
    W_Q5_1 = 7,
    W_Q8_0 = 8,
    W_Q2_K = 10,
    W_Q3_K = 11,
    W_Q4_K = 12,
    W_Q5_K = 13,
    W_Q6_K = 14,
    W_IQ4_NL = 20,
    W_IQ4_XS = 23,
    W_BF16 = 30,
    W_MXFP4 = 39,
};

// IEEE half to float, exact.
INFERD_DEVICE float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f;
    uint32_t man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) {
        // Infinity, or a NaN made quiet (as the hardware conversions do).
        bits = sign | 0x7f800000u | (man << 13) | (man != 0 ? 0x400000u : 0u);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else {
        // Subnormal: normalize.
        exp = 113;
        while ((man & 0x400) == 0) {
            man <<= 1;
            exp--;
        }
        bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
    }
    union {
        uint32_t u;
        float f;
    } v;
    v.u = bits;
    return v.f;
}

#if !defined(__CUDACC_RTC__)
// Float to IEEE half, rounding to nearest even (the device uses its conversion instruction).
static inline uint16_t f32_to_f16_rne(float f) {
    union {
        float f;
        uint32_t u;
    } v;
    v.f = f;
    uint32_t x = v.u, sign = (x >> 16) & 0x8000;
    int32_t exp = (int32_t)((x >> 23) & 0xff) - 127 + 15;
    uint32_t man = x & 0x7fffff;
    if (((x >> 23) & 0xff) == 0xff) return (uint16_t)(sign | 0x7c00 | (man ? 0x200 | (man >> 13) : 0));
    if (exp >= 31) return (uint16_t)(sign | 0x7c00);
    if (exp <= 0) {
        if (exp < -10) return (uint16_t)sign;
        man |= 0x800000;
        uint32_t shift = (uint32_t)(14 - exp);
        uint32_t h = man >> shift, rem = man & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (h & 1))) h++;
        return (uint16_t)(sign | h);
    }
    uint32_t h = ((uint32_t)exp << 10) | (man >> 13), rem = man & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) h++;
    return (uint16_t)(sign | h);
}
#endif

INFERD_DEVICE float bf16_to_f32(uint16_t h) {
    union {
        uint32_t u;
        float f;
    } v;
    v.u = (uint32_t)h << 16;
    // A NaN made quiet, as the CPU's conversion does.
    if ((h & 0x7f80) == 0x7f80 && (h & 0x7f) != 0) v.u |= 0x400000u;
    return v.f;
}

#if defined(__CUDACC_RTC__)
// Float to IEEE half bits, rounding to nearest even, and back, by the conversion instructions.
__device__ __forceinline__ uint16_t f32_to_f16_bits(float x) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}

__device__ __forceinline__ float f16_bits_to_f32(uint16_t h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
#else
// The host build of the tests (host_shim.h): the same conversions in C++.
static inline uint16_t f32_to_f16_bits(float x) { return f32_to_f16_rne(x); }
static inline float f16_bits_to_f32(uint16_t h) { return f16_to_f32(h); }
#endif

// Float to bfloat16 bits, rounding to nearest even; a NaN stays a NaN, made quiet.
INFERD_DEVICE uint16_t f32_to_bf16_bits(float f) {
    union {
        float f;
        uint32_t u;
    } v;
    v.f = f;
    if ((v.u & 0x7f800000u) == 0x7f800000u && (v.u & 0x7fffffu) != 0) return (uint16_t)((v.u >> 16) | 0x40u);
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

INFERD_DEVICE uint16_t read_u16(const uint8_t* p) { return (uint16_t)(p[0] | (p[1] << 8)); }

INFERD_DEVICE uint32_t read_u32(const uint8_t* p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

INFERD_DEVICE float read_f16(const uint8_t* p) { return f16_to_f32(read_u16(p)); }

// Weights per block and bytes per block of a type (0 for an unknown type).
INFERD_DEVICE int block_len(int type) {
    switch (type) {
        case W_F32: case W_F16: case W_BF16: return 1;
        case W_Q2_K: case W_Q3_K: case W_Q4_K: case W_Q5_K: case W_Q6_K: case W_IQ4_XS: return 256;
        default: return 32;
    }
}

INFERD_DEVICE int block_bytes(int type) {
    switch (type) {
        case W_F32: return 4;
        case W_F16: case W_BF16: return 2;
        case W_Q4_0: return 18;
        case W_Q4_1: return 20;
        case W_Q5_0: return 22;
        case W_Q5_1: return 24;
        case W_Q8_0: return 34;
        case W_IQ4_NL: return 18;
        case W_Q2_K: return 84;
        case W_Q3_K: return 110;
        case W_Q4_K: return 144;
        case W_Q5_K: return 176;
        case W_Q6_K: return 210;
        case W_IQ4_XS: return 136;
        case W_MXFP4: return 17;
        default: return 0;
    }
}

INFERD_DEVICE int iq4_value(int q) {
    const int8_t values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
    return values[q & 15];
}

// MXFP4's code book: twice the E2M1 values.
INFERD_DEVICE int mxfp4_value(int q) {
    const int8_t values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
    return values[q & 15];
}

// Half the value of an E8M0 exponent byte, 2^(e - 128), exact (denormal below e = 2).
INFERD_DEVICE float e8m0_half(int e) {
    union {
        uint32_t u;
        float f;
    } v;
    v.u = e < 2 ? (0x00200000u << e) : ((uint32_t)(e - 1) << 23);
    return v.f;
}

// Nibble i (0..32) of a 16-byte run where byte k holds weights k and k + 16.
INFERD_DEVICE int nibble(const uint8_t* qs, int i) { return i < 16 ? (qs[i] & 15) : (qs[i - 16] >> 4); }

// The 6-bit scale and min of sub-block j of a Q4_K / Q5_K super-block (12 packed bytes).
INFERD_DEVICE void k_scale_min(const uint8_t* s, int j, int* sc, int* m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

INFERD_DEVICE int q3k_scale(const uint8_t* s, int j) {
    int low = j < 8 ? (s[j] & 15) : (s[j - 8] >> 4);
    int high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
    return (low | (high << 4)) - 32;
}

// Weight e (0 .. block_len) of the block at blk.
INFERD_DEVICE float weight(int type, const uint8_t* blk, int e) {
    float d = 0.0f, dmin = 0.0f;
    int q = 0, sc = 1, m = 0;
    bool has_min = false;
    switch (type) {
        case W_F32: {
            union {
                uint32_t u;
                float f;
            } v;
            v.u = read_u32(blk);
            return v.f;
        }
        case W_F16: return read_f16(blk);
        case W_BF16: return bf16_to_f32(read_u16(blk));
        case W_Q8_0: d = read_f16(blk); q = (int8_t)blk[2 + e]; break;
        case W_Q4_0: d = read_f16(blk); q = nibble(blk + 2, e) - 8; break;
        case W_Q4_1:
            d = read_f16(blk);
            dmin = read_f16(blk + 2);
            m = 1;
            has_min = true;
            q = nibble(blk + 4, e);
            break;
        case W_Q5_0: case W_Q5_1: {
            bool one = type == W_Q5_1;
            uint32_t qh = read_u32(blk + (one ? 4 : 2));
            q = nibble(blk + (one ? 8 : 6), e) | (((qh >> e) & 1) << 4);
            d = read_f16(blk);
            if (one) {
                dmin = read_f16(blk + 2);
                m = 1;
                has_min = true;
            } else {
                q -= 16;
            }
            break;
        }
        case W_IQ4_NL: d = read_f16(blk); q = iq4_value(nibble(blk + 2, e)); break;
        case W_MXFP4: d = e8m0_half(blk[0]); q = mxfp4_value(nibble(blk + 1, e)); break;
        case W_Q2_K: {
            int j = e / 32, l = e % 32, h = j / 4, s = j % 4;
            int k = blk[2 * j + l / 16];
            d = read_f16(blk + 80);
            dmin = -read_f16(blk + 82);
            has_min = true;
            sc = k & 15;
            m = k >> 4;
            q = (blk[16 + 32 * h + l] >> (2 * s)) & 3;
            break;
        }
        case W_Q3_K: {
            int j = e / 32, l = e % 32, h = j / 4, s = j % 4;
            d = read_f16(blk + 108);
            sc = q3k_scale(blk + 96, 2 * j + l / 16);
            int low = (blk[32 + 32 * h + l] >> (2 * s)) & 3;
            q = ((blk[l] >> j) & 1) ? low : low - 4;
            break;
        }
        case W_Q4_K: case W_Q5_K: {
            int j = e / 32, l = e % 32, c = j / 2, h = j % 2;
            k_scale_min(blk + 4, j, &sc, &m);
            d = read_f16(blk);
            dmin = -read_f16(blk + 2);
            has_min = true;
            if (type == W_Q4_K) {
                q = (blk[16 + 32 * c + l] >> (4 * h)) & 15;
            } else {
                q = ((blk[48 + 32 * c + l] >> (4 * h)) & 15) | (((blk[16 + l] >> j) & 1) << 4);
            }
            break;
        }
        case W_Q6_K: {
            int j = e / 32, l = e % 32, h = j / 4, s = j % 4;
            d = read_f16(blk + 208);
            sc = (int8_t)blk[192 + 2 * j + l / 16];
            int low = (blk[64 * h + 32 * (s % 2) + l] >> (4 * (s / 2))) & 15;
            int high = (blk[128 + 32 * h + l] >> (2 * s)) & 3;
            q = (low | (high << 4)) - 32;
            break;
        }
        case W_IQ4_XS: {
            int j = e / 32, i = e % 32;
            int low = (blk[4 + j / 2] >> (4 * (j % 2))) & 15;
            int high = (read_u16(blk + 2) >> (2 * j)) & 3;
            sc = (low | (high << 4)) - 32;
            d = read_f16(blk);
            q = iq4_value(nibble(blk + 8 + 16 * j, i));
            break;
        }
        default: return 0.0f;
    }
    float w = MUL(MUL(d, (float)sc), (float)q);
    return has_min ? ADD(w, MUL(dmin, (float)m)) : w;
}

// Weight k of a row of `type` starting at `row`.
INFERD_DEVICE float row_weight(int type, const uint8_t* row, int k) {
    int n = block_len(type);
    return weight(type, row + (k / n) * block_bytes(type), k % n);
}

// ---- Quantized products: a 32-weight group as integers, as the CPU's group::decode reads it
// (kernels/src/group.rs):
//
//     w[i] = (d * sc[i / 16]) * q[i] + dmin * m[i / 16]
//
// with the quants packed four to a word (weights 4k .. 4k + 3 in word k, lowest byte first), so
// that a product with 8-bit activations is four __dp4a per half group, exact in integers.
struct GroupQ {
    int q[8];
    int sc[2];
    int m[2];
    float d;
    float dmin;
    bool has_min;
};

#if defined(__CUDACC_RTC__)
// A word at a 4-byte aligned address, at a 2-byte aligned one (two halves), a half at a 2-byte
// aligned one; the product of four signed bytes added to c.
INFERD_DEVICE uint32_t u32_a4(const uint8_t* p) { return *(const uint32_t*)p; }
INFERD_DEVICE uint32_t u32_a2(const uint8_t* p) {
    const uint16_t* h = (const uint16_t*)p;
    return (uint32_t)h[0] | ((uint32_t)h[1] << 16);
}
INFERD_DEVICE float half_at(const uint8_t* p) { return f16_bits_to_f32(*(const uint16_t*)p); }
// 16 bytes at a 16-byte aligned address, loaded or stored at once (as 4 words or 4 floats).
INFERD_DEVICE uint4 load16(const void* p) { return *(const uint4*)p; }
INFERD_DEVICE void store16(void* p, uint4 v) { *(uint4*)p = v; }
INFERD_DEVICE float4 load_float4(const float* p) { return *(const float4*)p; }
INFERD_DEVICE void store_float4(float* p, float4 v) { *(float4*)p = v; }
INFERD_DEVICE int dot4(int a, int b, int c) { return __dp4a(a, b, c); }
INFERD_DEVICE int round_even(float x) { return __float2int_rn(x); }
#else
INFERD_DEVICE uint32_t u32_a4(const uint8_t* p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}
INFERD_DEVICE uint32_t u32_a2(const uint8_t* p) { return u32_a4(p); }
// CUDA's vector types, and the 16-byte loads and stores, in plain C++.
struct uint4 {
    uint32_t x, y, z, w;
};
struct float4 {
    float x, y, z, w;
};
INFERD_DEVICE uint4 load16(const void* p) {
    uint4 v;
    memcpy(&v, p, 16);
    return v;
}
INFERD_DEVICE void store16(void* p, uint4 v) { memcpy(p, &v, 16); }
INFERD_DEVICE float4 load_float4(const float* p) {
    float4 v;
    memcpy(&v, p, 16);
    return v;
}
INFERD_DEVICE void store_float4(float* p, float4 v) { memcpy(p, &v, 16); }
INFERD_DEVICE float half_at(const uint8_t* p) { return read_f16(p); }
INFERD_DEVICE int dot4(int a, int b, int c) {
    for (int k = 0; k < 4; k++) c += (int)(int8_t)(a >> (8 * k)) * (int)(int8_t)(b >> (8 * k));
    return c;
}
// Rounded to the nearest integer, ties to even (the default rounding mode).
INFERD_DEVICE int round_even(float x) { return (int)nearbyintf(x); }
#endif

// Every byte of v (each below 128) minus k, as signed bytes, with no borrow between bytes.
INFERD_DEVICE uint32_t sub_bytes(uint32_t v, uint32_t k) { return ((v | 0x80808080u) - k * 0x01010101u) ^ 0x80808080u; }

// The low 4 bits of x, one to each byte's bit 0.
INFERD_DEVICE uint32_t spread4(uint32_t x) { return (x & 1u) | ((x & 2u) << 7) | ((x & 4u) << 14) | ((x & 8u) << 21); }

// Each byte of v (a nibble) through the IQ4 table.
INFERD_DEVICE uint32_t iq4_bytes(uint32_t v) {
    uint32_t out = 0;
    for (int k = 0; k < 4; k++) out |= (uint32_t)(uint8_t)iq4_value((int)(v >> (8 * k)) & 15) << (8 * k);
    return out;
}

// Each byte of v (a nibble) through MXFP4's code book.
INFERD_DEVICE uint32_t mxfp4_bytes(uint32_t v) {
    uint32_t out = 0;
    for (int k = 0; k < 4; k++) out |= (uint32_t)(uint8_t)mxfp4_value((int)(v >> (8 * k)) & 15) << (8 * k);
    return out;
}

// Nibble runs: the 16 bytes at p hold weights k (low nibble) and k + 16 (high) of a group.
INFERD_DEVICE void nibble_words(uint32_t v, int k, GroupQ* o) {
    o->q[k] = (int)(v & 0x0F0F0F0Fu);
    o->q[k + 4] = (int)((v >> 4) & 0x0F0F0F0Fu);
}

// Group g (weights 32 g .. 32 g + 32) of a row of quantized type `type`; false for a float type.
INFERD_DEVICE bool group_ints(int type, const uint8_t* row, int g, GroupQ* o) {
    int per = block_len(type) / 32;
    if (per == 0) return false;
    const uint8_t* blk = row + (long long)(g / per) * block_bytes(type);
    int j = g % per, h = j / 4, s = j % 4, c = j / 2, hh = j % 2;
    o->sc[0] = o->sc[1] = 1;
    o->m[0] = o->m[1] = 0;
    o->dmin = 0.0f;
    o->has_min = false;
    switch (type) {
        case W_Q8_0:
            o->d = half_at(blk);
            for (int k = 0; k < 8; k++) o->q[k] = (int)u32_a2(blk + 2 + 4 * k);
            return true;
        case W_Q4_0: case W_IQ4_NL:
            o->d = half_at(blk);
            for (int k = 0; k < 4; k++) nibble_words(u32_a2(blk + 2 + 4 * k), k, o);
            for (int k = 0; k < 8; k++) {
                o->q[k] = (int)(type == W_Q4_0 ? sub_bytes((uint32_t)o->q[k], 8) : iq4_bytes((uint32_t)o->q[k]));
            }
            return true;
        case W_Q4_1:
            o->d = half_at(blk);
            o->dmin = half_at(blk + 2);
            o->m[0] = o->m[1] = 1;
            o->has_min = true;
            for (int k = 0; k < 4; k++) nibble_words(u32_a4(blk + 4 + 4 * k), k, o);
            return true;
        case W_Q5_0: case W_Q5_1: {
            bool one = type == W_Q5_1;
            uint32_t qh = one ? u32_a4(blk + 4) : u32_a2(blk + 2);
            for (int k = 0; k < 4; k++) {
                nibble_words(one ? u32_a4(blk + 8 + 4 * k) : u32_a2(blk + 6 + 4 * k), k, o);
                o->q[k] |= (int)(spread4(qh >> (4 * k)) << 4);
                o->q[k + 4] |= (int)(spread4(qh >> (16 + 4 * k)) << 4);
            }
            o->d = half_at(blk);
            if (one) {
                o->dmin = half_at(blk + 2);
                o->m[0] = o->m[1] = 1;
                o->has_min = true;
            } else {
                for (int k = 0; k < 8; k++) o->q[k] = (int)sub_bytes((uint32_t)o->q[k], 16);
            }
            return true;
        }
        case W_Q2_K:
            // Weight 128 h + 32 s + l sits in bits 2s of byte 32 h + l of qs (at 16).
            for (int k = 0; k < 8; k++) o->q[k] = (int)((u32_a4(blk + 16 + 32 * h + 4 * k) >> (2 * s)) & 0x03030303u);
            for (int i = 0; i < 2; i++) {
                o->sc[i] = blk[2 * j + i] & 15;
                o->m[i] = blk[2 * j + i] >> 4;
            }
            o->d = half_at(blk + 80);
            o->dmin = -half_at(blk + 82);
            o->has_min = true;
            return true;
        case W_Q3_K:
            // The high bit of weight 32 j + l is bit j of hmask[l]; a clear bit subtracts 4.
            for (int k = 0; k < 8; k++) {
                uint32_t low = (u32_a2(blk + 32 + 32 * h + 4 * k) >> (2 * s)) & 0x03030303u;
                uint32_t high = (u32_a2(blk + 4 * k) >> j) & 0x01010101u;
                o->q[k] = (int)sub_bytes(low | (high << 2), 4);
            }
            for (int i = 0; i < 2; i++) o->sc[i] = q3k_scale(blk + 96, 2 * j + i);
            o->d = half_at(blk + 108);
            return true;
        case W_Q4_K: case W_Q5_K: {
            // Weight 64 c + 32 hh + l sits in nibble hh of byte 32 c + l of qs.
            // The super-block is 144 (176) bytes and qs starts at 16 (48): 16-byte loads.
            bool five = type == W_Q5_K;
            const uint8_t* qs = blk + (five ? 48 : 16) + 32 * c;
            uint4 v4[2] = {load16(qs), load16(qs + 16)}, h4[2] = {{0, 0, 0, 0}, {0, 0, 0, 0}};
            if (five) h4[0] = load16(blk + 16), h4[1] = load16(blk + 32);
            uint32_t v[8] = {v4[0].x, v4[0].y, v4[0].z, v4[0].w, v4[1].x, v4[1].y, v4[1].z, v4[1].w};
            uint32_t high[8] = {h4[0].x, h4[0].y, h4[0].z, h4[0].w, h4[1].x, h4[1].y, h4[1].z, h4[1].w};
            for (int k = 0; k < 8; k++) {
                uint32_t q = (v[k] >> (4 * hh)) & 0x0F0F0F0Fu;
                if (five) q |= ((high[k] >> j) & 0x01010101u) << 4;
                o->q[k] = (int)q;
            }
            k_scale_min(blk + 4, j, &o->sc[0], &o->m[0]);
            o->sc[1] = o->sc[0];
            o->m[1] = o->m[0];
            o->d = half_at(blk);
            o->dmin = -half_at(blk + 2);
            o->has_min = true;
            return true;
        }
        case W_Q6_K:
            for (int k = 0; k < 8; k++) {
                uint32_t low = (u32_a2(blk + 64 * h + 32 * (s % 2) + 4 * k) >> (4 * (s / 2))) & 0x0F0F0F0Fu;
                uint32_t high = (u32_a2(blk + 128 + 32 * h + 4 * k) >> (2 * s)) & 0x03030303u;
                o->q[k] = (int)sub_bytes(low | (high << 4), 32);
            }
            for (int i = 0; i < 2; i++) o->sc[i] = (int8_t)blk[192 + 2 * j + i];
            o->d = half_at(blk + 208);
            return true;
        case W_IQ4_XS: {
            for (int k = 0; k < 4; k++) nibble_words(u32_a4(blk + 8 + 16 * j + 4 * k), k, o);
            for (int k = 0; k < 8; k++) o->q[k] = (int)iq4_bytes((uint32_t)o->q[k]);
            int low = (blk[4 + j / 2] >> (4 * (j % 2))) & 15;
            int high = (read_u16(blk + 2) >> (2 * j)) & 3;
            o->sc[0] = o->sc[1] = (low | (high << 4)) - 32;
            o->d = half_at(blk);
            return true;
        }
        case W_MXFP4:
            // 17-byte blocks: the quants at any alignment, read a byte at a time.
            for (int k = 0; k < 4; k++) {
                const uint8_t* p = blk + 1 + 4 * k;
                nibble_words((uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24), k, o);
            }
            for (int k = 0; k < 8; k++) o->q[k] = (int)mxfp4_bytes((uint32_t)o->q[k]);
            o->d = e8m0_half(blk[0]);
            return true;
        default: return false;
    }
}
