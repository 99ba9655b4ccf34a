// inferd CUDA kernels on the host, for tests only: just enough of CUDA's execution model to run
// the kernels' logic without a GPU. A launch runs its blocks one after another; a block's
// threads run as real threads, so __syncthreads is a barrier of the block and a warp shuffle a
// barrier of the warp's 32 lanes (every shuffle in these kernels is warp-uniform). __shared__
// variables are function statics, shared by a block's threads (blocks never overlap).
#pragma once
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
static thread_local dim3 threadIdx, blockIdx;
static dim3 blockDim, gridDim;

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static

struct HostBlock {
    std::unique_ptr<std::barrier<>> block;
    std::vector<std::unique_ptr<std::barrier<>>> warps;
    std::vector<uint64_t> slots;
};
static HostBlock* host_block = nullptr;

static inline int host_thread_id() { return (int)(threadIdx.y * blockDim.x + threadIdx.x); }

static inline void __syncthreads() { host_block->block->arrive_and_wait(); }

template <class T>
static T host_shuffle(T v, int src_lane) {
    static_assert(sizeof(T) <= 8, "a shuffle moves at most 8 bytes");
    int id = host_thread_id(), warp = id / 32;
    std::memcpy(&host_block->slots[id], &v, sizeof(T));
    host_block->warps[warp]->arrive_and_wait();
    T r;
    std::memcpy(&r, &host_block->slots[warp * 32 + src_lane], sizeof(T));
    host_block->warps[warp]->arrive_and_wait();
    return r;
}

template <class T>
static T __shfl_xor_sync(unsigned, T v, int mask) {
    return host_shuffle(v, (host_thread_id() % 32) ^ mask);
}

template <class T>
static T __shfl_sync(unsigned, T v, int src) {
    return host_shuffle(v, src);
}

static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __int_as_float(unsigned x) {
    float f;
    std::memcpy(&f, &x, 4);
    return f;
}
static inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }

// Runs kernel body `f` over a grid of blocks of `block` threads (x * y a multiple of 32).
template <class F>
static void host_launch(dim3 grid, dim3 block, F f) {
    gridDim = grid;
    blockDim = block;
    int n = (int)(block.x * block.y * block.z);
    for (unsigned bz = 0; bz < grid.z; bz++)
        for (unsigned by = 0; by < grid.y; by++)
            for (unsigned bx = 0; bx < grid.x; bx++) {
                HostBlock hb;
                hb.block = std::make_unique<std::barrier<>>(n);
                for (int w = 0; w < n / 32; w++) hb.warps.push_back(std::make_unique<std::barrier<>>(32));
                hb.slots.assign(n, 0);
                host_block = &hb;
                std::vector<std::thread> threads;
                for (int i = 0; i < n; i++) {
                    threads.emplace_back([=] {
                        threadIdx = dim3{(unsigned)i % block.x, (unsigned)i / block.x % block.y, 1};
                        blockIdx = dim3{bx, by, bz};
                        f();
                    });
                }
                for (auto& t : threads) t.join();
                host_block = nullptr;
            }
}
