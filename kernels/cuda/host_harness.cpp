// inferd CUDA kernels run on the host (host_shim.h), for kernels/src/cuda/host.rs: a server
// that runs one launch per request read from stdin and answers on stdout, until stdin ends.
// All numbers little-endian. Request: u32 name length, the kernel's name, u32 grid x, grid y,
// block x, block y, u32 argument count, then per argument (in the kernel's parameter order)
// u8 written-back flag, u64 byte length, the bytes (a buffer's elements, or a scalar).
// Answer: u32 status (0: ran; else u32 length and a message follow), then for each flagged
// argument u64 length and its bytes after the launch.
#include "host_shim.h"
#include "common.cuh"
#include "ops.cu"
#include "matvec.cu"
#include "gemm.cu"
#include "attention.cu"
#include "deltanet.cu"

#include <cstdio>
#include <string>

static std::vector<std::vector<char>> args;

static bool read_exact(void* p, size_t n) { return fread(p, 1, n, stdin) == n; }
template <class T>
static bool read_num(T& v) {
    return read_exact(&v, sizeof(T));
}
static void write_exact(const void* p, size_t n) { fwrite(p, 1, n, stdout); }

// Argument i as a buffer of T, or as a scalar T.
template <class T>
static T* P(size_t i) {
    return reinterpret_cast<T*>(args[i].data());
}
template <class T>
static T V(size_t i) {
    T v;
    std::memcpy(&v, args[i].data(), sizeof(T));
    return v;
}

// Runs kernel `k`; false if there is none of that name.
static bool launch(const std::string& k, dim3 grid, dim3 block) {
    auto run = [&](auto body) { host_launch(grid, block, body); };
    if (k == "embed") {
        run([] { embed(P<uint8_t>(0), V<int>(1), V<long long>(2), P<int>(3), V<int>(4), V<float>(5), P<float>(6)); });
    } else if (k == "rms_norm") {
        run([] { rms_norm(P<float>(0), P<float>(1), P<float>(2), V<int>(3), V<float>(4)); });
    } else if (k == "rope") {
        run([] { rope(P<float>(0), P<int>(1), P<float>(2), V<int>(3), V<int>(4), V<int>(5), V<int>(6), V<float>(7)); });
    } else if (k == "gated_act") {
        run([] { gated_act(P<float>(0), P<float>(1), V<long long>(2), V<int>(3)); });
    } else if (k == "add_in_place") {
        run([] { add_in_place(P<float>(0), P<float>(1), V<long long>(2)); });
    } else if (k == "matvec") {
        run([] {
            matvec(P<uint8_t>(0), V<int>(1), V<long long>(2), V<int>(3), V<int>(4), P<float>(5), V<int>(6), P<float>(7));
        });
    } else if (k == "quantize_q8") {
        run([] { quantize_q8(P<float>(0), V<long long>(1), P<int8_t>(2), P<float>(3), P<int>(4)); });
    } else if (k == "matvec_q8") {
        run([] {
            matvec_q8(P<uint8_t>(0), V<int>(1), V<long long>(2), V<int>(3), V<int>(4), P<int8_t>(5), P<float>(6), P<int>(7),
                      V<int>(8), P<float>(9));
        });
    } else if (k == "add_bias") {
        run([] { add_bias(P<float>(0), P<float>(1), V<int>(2), V<int>(3)); });
    } else if (k == "dequantize_half") {
        run([] { dequantize_half(P<uint8_t>(0), V<int>(1), V<long long>(2), V<int>(3), V<int>(4), V<int>(5), P<uint16_t>(6)); });
    } else if (k == "to_half") {
        run([] { to_half(P<float>(0), V<long long>(1), V<int>(2), P<uint16_t>(3)); });
    } else if (k == "gather_rows") {
        run([] { gather_rows(P<float>(0), P<int>(1), V<int>(2), P<float>(3)); });
    } else if (k == "scatter_add_rows") {
        run([] { scatter_add_rows(P<float>(0), P<int>(1), P<float>(2), V<int>(3), P<float>(4)); });
    } else if (k == "kv_store") {
        run([] { kv_store(P<float>(0), P<float>(1), P<uint16_t>(2), P<uint16_t>(3), P<int>(4), V<int>(5)); });
    } else if (k == "kv_copy_blocks") {
        run([] { kv_copy_blocks(P<uint16_t>(0), P<uint16_t>(1), P<int>(2), V<long long>(3)); });
    } else if (k == "attention") {
        run([] {
            attention(P<float>(0), P<uint16_t>(1), P<uint16_t>(2), P<int>(3), P<int>(4), V<int>(5), P<int>(6), P<int>(7),
                      V<int>(8), V<int>(9), V<int>(10), V<int>(11), V<int>(12), V<int>(13), V<int>(14), V<int>(15),
                      V<int>(16), V<float>(17), P<float>(18), V<int>(19), P<float>(20), P<float>(21), P<float>(22));
        });
    } else if (k == "attention_combine") {
        run([] {
            attention_combine(P<float>(0), P<float>(1), V<int>(2), V<int>(3), V<int>(4), P<float>(5), V<int>(6), V<int>(7),
                              P<float>(8));
        });
    } else if (k == "delta_finish") {
        run([] { delta_finish(P<float>(0), V<long long>(1), V<int>(2), V<int>(3), V<int>(4), V<int>(5), V<int>(6), V<int>(7)); });
    } else if (k == "delta_keys") {
        run([] { delta_keys(P<float>(0), V<long long>(1), V<int>(2), V<int>(3), P<float>(4), V<long long>(5), V<int>(6), V<int>(7)); });
    } else if (k == "delta_rows") {
        run([] {
            delta_rows(P<float>(0), V<long long>(1), V<int>(2), V<int>(3), V<int>(4), P<float>(5), P<float>(6), P<float>(7),
                       P<float>(8), V<long long>(9), P<float>(10), V<int>(11), V<int>(12), V<int>(13), V<int>(14), V<int>(15));
        });
    } else if (k == "delta_conv") {
        run([] {
            delta_conv(P<float>(0), P<float>(1), V<long long>(2), V<int>(3), P<float>(4), V<int>(5), V<int>(6),
                       V<long long>(7), V<int>(8), V<long long>(9), P<float>(10));
        });
    } else if (k == "delta_ring") {
        run([] { delta_ring(P<float>(0), P<float>(1), V<long long>(2), V<int>(3), V<int>(4), V<long long>(5), V<int>(6), V<long long>(7)); });
    } else if (k == "delta_split") {
        run([] { delta_split(P<float>(0), V<int>(1), V<int>(2), V<int>(3), V<float>(4), P<float>(5), P<float>(6), P<float>(7)); });
    } else if (k == "delta_gates") {
        run([] { delta_gates(P<float>(0), P<float>(1), P<float>(2), P<float>(3), V<int>(4), V<long long>(5), P<float>(6), P<float>(7)); });
    } else if (k == "split_pairs") {
        run([] { split_pairs(P<float>(0), V<long long>(1), V<int>(2), P<float>(3), P<float>(4)); });
    } else if (k == "gate_by") {
        run([] { gate_by(P<float>(0), P<float>(1), V<long long>(2), V<long long>(3), V<int>(4)); });
    } else if (k == "move_floats") {
        run([] { move_floats(P<float>(0), V<long long>(1), V<long long>(2), V<long long>(3)); });
    } else {
        return false;
    }
    return true;
}

int main() {
    for (;;) {
        uint32_t len, g[4], n;
        if (!read_num(len)) return 0;  // stdin ended: done
        std::string k(len, '\0');
        if (!read_exact(k.data(), len) || !read_exact(g, sizeof g) || !read_num(n)) return 1;
        args.assign(n, {});
        std::vector<uint8_t> back(n);
        for (uint32_t i = 0; i < n; i++) {
            uint64_t bytes;
            if (!read_num(back[i]) || !read_num(bytes)) return 1;
            args[i].resize(bytes + 8);  // an address even when empty, and room for a scalar
            if (!read_exact(args[i].data(), bytes)) return 1;
            args[i].resize(bytes);
        }
        if (!launch(k, dim3{g[0], g[1], 1}, dim3{g[2], g[3], 1})) {
            std::string m = "no kernel named " + k;
            uint32_t status = 1, mlen = (uint32_t)m.size();
            write_exact(&status, 4);
            write_exact(&mlen, 4);
            write_exact(m.data(), mlen);
        } else {
            uint32_t status = 0;
            write_exact(&status, 4);
            for (uint32_t i = 0; i < n; i++) {
                if (!back[i]) continue;
                uint64_t bytes = args[i].size();
                write_exact(&bytes, 8);
                write_exact(args[i].data(), bytes);
            }
        }
        fflush(stdout);
    }
}
