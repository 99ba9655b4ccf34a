// inferd CUDA kernels on the host, for tests only: just enough of CUDA's execution model to run
// the kernels' logic without a GPU. A launch runs its blocks one after another; a block's
// threads run as fibers on one OS thread (each started on its own stack by ucontext, then
// switched with _setjmp/_longjmp, which leave the signal mask alone and so make no system
// call), switched at the barriers: __syncthreads
// waits for every thread of the block still running, a warp shuffle for the warp's 32 lanes
// (every shuffle in these kernels is warp-uniform). __shared__ variables are function statics,
// shared by a block's threads (blocks never overlap).
#pragma once
#include <setjmp.h>
#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
// One OS thread runs every fiber: the scheduler sets threadIdx before it resumes one.
static dim3 threadIdx, blockIdx, blockDim, gridDim;

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

enum HostState { HOST_RUN, HOST_AT_BLOCK, HOST_AT_WARP, HOST_DONE };

struct HostFiber {
    ucontext_t start;  // its first entry
    jmp_buf at;        // where it waits
    std::unique_ptr<char[]> stack;
    bool started = false;
    HostState state = HOST_RUN;
};

struct HostBlock {
    std::vector<HostFiber> fibers;
    ucontext_t scheduler_start;
    jmp_buf scheduler;
    int current = 0;
    std::vector<uint64_t> slots;  // one shuffle value per thread
    std::function<void()> body;
};
static HostBlock host_block;

static inline int host_thread_id() { return (int)(threadIdx.y * blockDim.x + threadIdx.x); }

// The running fiber stops at a barrier of `kind` until the scheduler releases it.
static void host_wait(HostState kind) {
    HostFiber& f = host_block.fibers[host_block.current];
    f.state = kind;
    if (_setjmp(f.at) == 0) _longjmp(host_block.scheduler, 1);
}

static inline void __syncthreads() { host_wait(HOST_AT_BLOCK); }

template <class T>
static T host_shuffle(T v, int src_lane) {
    static_assert(sizeof(T) <= 8, "a shuffle moves at most 8 bytes");
    int id = host_thread_id(), warp = id / 32;
    std::memcpy(&host_block.slots[id], &v, sizeof(T));
    host_wait(HOST_AT_WARP);
    T r;
    std::memcpy(&r, &host_block.slots[warp * 32 + src_lane], sizeof(T));
    host_wait(HOST_AT_WARP);
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

static const size_t HOST_STACK = 32 << 10;

static void host_fiber_main() {
    host_block.body();
    host_block.fibers[host_block.current].state = HOST_DONE;
    _longjmp(host_block.scheduler, 1);
}

// Runs one block: every fiber until it reaches a barrier or ends, then releases the barriers
// whose threads have all arrived (the block's, or a warp's), until every fiber has ended.
static void host_run_block(int n) {
    HostBlock& b = host_block;
    for (int i = 0; i < n; i++) {
        HostFiber& f = b.fibers[i];
        getcontext(&f.start);
        f.start.uc_stack.ss_sp = f.stack.get();
        f.start.uc_stack.ss_size = HOST_STACK;
        f.start.uc_link = nullptr;  // a fiber ends by jumping back to the scheduler
        makecontext(&f.start, host_fiber_main, 0);
        f.started = false;
        f.state = HOST_RUN;
    }
    for (;;) {
        for (int i = 0; i < n; i++) {
            HostFiber& f = b.fibers[i];
            if (f.state != HOST_RUN) continue;
            b.current = i;
            threadIdx = dim3{(unsigned)i % blockDim.x, (unsigned)i / blockDim.x % blockDim.y, 1};
            if (_setjmp(b.scheduler) == 0) {
                if (!f.started) {
                    f.started = true;
                    swapcontext(&b.scheduler_start, &f.start);
                } else {
                    _longjmp(f.at, 1);
                }
            }
        }
        int alive = 0, at_block = 0;
        for (int i = 0; i < n; i++) {
            alive += b.fibers[i].state != HOST_DONE;
            at_block += b.fibers[i].state == HOST_AT_BLOCK;
        }
        if (alive == 0) return;
        bool released = false;
        if (at_block == alive) {
            for (int i = 0; i < n; i++) b.fibers[i].state = b.fibers[i].state == HOST_DONE ? HOST_DONE : HOST_RUN;
            released = true;
        }
        for (int w = 0; w < n / 32; w++) {
            int lanes = 0, waiting = 0;
            for (int i = w * 32; i < w * 32 + 32; i++) {
                lanes += b.fibers[i].state != HOST_DONE;
                waiting += b.fibers[i].state == HOST_AT_WARP;
            }
            if (lanes > 0 && waiting == lanes) {
                for (int i = w * 32; i < w * 32 + 32; i++)
                    if (b.fibers[i].state == HOST_AT_WARP) b.fibers[i].state = HOST_RUN;
                released = true;
            }
        }
        if (!released) {
            fprintf(stderr, "host_shim: the block's threads wait at different barriers (a deadlock on a GPU)\n");
            abort();
        }
    }
}

// Runs kernel body `f` over a grid of blocks of `block` threads (x * y a multiple of 32).
template <class F>
static void host_launch(dim3 grid, dim3 block, F f) {
    gridDim = grid;
    blockDim = block;
    int n = (int)(block.x * block.y * block.z);
    host_block.fibers.resize(n);
    for (auto& fb : host_block.fibers)
        if (!fb.stack) fb.stack.reset(new char[HOST_STACK]);  // untouched pages cost nothing
    host_block.slots.assign(n, 0);
    host_block.body = f;
    for (unsigned bz = 0; bz < grid.z; bz++)
        for (unsigned by = 0; by < grid.y; by++)
            for (unsigned bx = 0; bx < grid.x; bx++) {
                blockIdx = dim3{bx, by, bz};
                host_run_block(n);
            }
}
