// inferd CUDA kernels run on the host (host_shim.h), for kernels/src/cuda/tests.rs: one kernel
// per invocation, `host_harness OP DIR`, its inputs read from DIR (raw little-endian arrays and
// a `params` file of numbers), its output written to DIR/out.
#include "host_shim.h"
#include "common.cuh"
#include "ops.cu"
#include "matvec.cu"
#include "attention.cu"

#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>

static std::string dir;

template <class T>
static std::vector<T> input(const char* name) {
    std::ifstream f(dir + "/" + name, std::ios::binary);
    std::vector<char> raw((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    std::vector<T> v(raw.size() / sizeof(T));
    std::memcpy(v.data(), raw.data(), v.size() * sizeof(T));
    return v;
}

template <class T>
static void output(const std::vector<T>& v) {
    std::ofstream f(dir + "/out", std::ios::binary);
    f.write((const char*)v.data(), (std::streamsize)(v.size() * sizeof(T)));
}

int main(int argc, char** argv) {
    if (argc != 3) return 2;
    std::string op = argv[1];
    dir = argv[2];
    std::vector<double> p = input<double>("params");
    if (op == "rms_norm") {
        // params: rows, n, eps
        auto x = input<float>("x");
        auto w = input<float>("w");
        int rows = (int)p[0], n = (int)p[1];
        std::vector<float> y(x.size());
        host_launch({(unsigned)rows, 1, 1}, {64, 1, 1}, [&] { rms_norm(x.data(), w.data(), y.data(), n, (float)p[2]); });
        output(y);
    } else if (op == "rope") {
        // params: tokens, heads, head_dim, pairs, neox, scale
        auto x = input<float>("x");
        auto pos = input<int>("pos");
        auto f = input<float>("inv_freq");
        host_launch({(unsigned)p[0], 1, 1}, {32, 1, 1}, [&] {
            rope(x.data(), pos.data(), f.data(), (int)p[1], (int)p[2], (int)p[3], (int)p[4], (float)p[5]);
        });
        output(x);
    } else if (op == "gated_act") {
        // params: n, gelu
        auto g = input<float>("gate");
        auto u = input<float>("up");
        host_launch({2, 1, 1}, {32, 1, 1}, [&] { gated_act(g.data(), u.data(), (long long)p[0], (int)p[1]); });
        output(g);
    } else if (op == "matvec") {
        // params: type, rows, cols, tokens, row_bytes
        auto w = input<uint8_t>("w");
        auto x = input<float>("x");
        int rows = (int)p[1], tokens = (int)p[3];
        std::vector<float> y((size_t)rows * tokens);
        host_launch({(unsigned)((rows + 3) / 4), 1, 1}, {32, 4, 1}, [&] {
            matvec(w.data(), (int)p[0], (long long)p[4], rows, (int)p[2], x.data(), tokens, y.data());
        });
        output(y);
    } else if (op == "embed") {
        // params: type, row_bytes, tokens, cols, scale
        auto table = input<uint8_t>("table");
        auto ids = input<int>("ids");
        int tokens = (int)p[2], cols = (int)p[3];
        std::vector<float> y((size_t)tokens * cols);
        host_launch({(unsigned)tokens, 1, 1}, {32, 1, 1}, [&] {
            embed(table.data(), (int)p[0], (long long)p[1], ids.data(), cols, (float)p[4], y.data());
        });
        output(y);
    } else if (op == "kv_attention") {
        // params: tokens, q_heads, kv_heads, head_dim, block_size, window, scale, table_len, blocks
        int tokens = (int)p[0], qh = (int)p[1], kvh = (int)p[2], hd = (int)p[3], bs = (int)p[4];
        int kv_dim = kvh * hd;
        auto k = input<float>("k");
        auto v = input<float>("v");
        auto slot = input<int>("slot");
        auto q = input<float>("q");
        auto tables = input<int>("tables");
        auto table_of = input<int>("table_of");
        auto q_pos = input<int>("q_pos");
        std::vector<uint16_t> kc((size_t)p[8] * bs * kv_dim), vc(kc.size());
        int stored = (int)slot.size();
        host_launch({(unsigned)stored, 1, 1}, {32, 1, 1},
                    [&] { kv_store(k.data(), v.data(), kc.data(), vc.data(), slot.data(), kv_dim); });
        std::vector<float> out((size_t)tokens * qh * hd);
        host_launch({(unsigned)tokens, (unsigned)qh, 1}, {32, 1, 1}, [&] {
            attention(q.data(), kc.data(), vc.data(), tables.data(), table_of.data(), (int)p[7], q_pos.data(), qh, kvh,
                      hd, bs, (int)p[5], (float)p[6], out.data());
        });
        output(out);
    } else {
        return 2;
    }
    return 0;
}
