"""Random-weight models at real models' shapes, for speed measurements on a machine that cannot
fetch the models themselves (tests/gpu/run on a GPU machine without a network). Every product
and KV page has the real model's size, so a step costs what it costs there; the text it writes
is noise.

    python3 tests/gpu/bench_model.py OUT.gguf [SHAPE]

SHAPE:
- smollm2 (the default): SmolLM2-135M's Llama architecture (hidden 576, 30 layers, 9 query and
  3 KV heads of 64, FFN 1536, a 49,152-token byte-level vocabulary), its matrices Q4_1 and its
  embedding Q8_0, tied to the output, as in SmolLM2-135M-Instruct.Q4_1.gguf.
- llama3-8b-q4_k_m: Llama 3.1 8B's shapes (hidden 4096, 32 layers, 32 query and 8 KV heads of
  128, FFN 14,336, a 128,256-token vocabulary, an untied output) with llama-quantize's Q4_K_M
  mix of types: Q6_K for the output and for attn_v and ffn_down of the layers its
  use_more_bits picks (the first and last eighth, every third between), Q4_K elsewhere; 4.9 GB.
  Its blocks are written directly (random quants, scales sized for unit activations) rather
  than quantized from floats, which would take minutes for nothing: the file has the bytes and
  the types of the real one.
"""
import os
import sys

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import quantize

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "reference"))
from tiny_models import MERGES, byte_chars  # noqa: E402

Q = GGMLQuantizationType


def tokens_of(vocab):
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + byte_chars() + [a + b for a, b in MERGES]
    return tokens + [f"<filler {i}>" for i in range(vocab - len(tokens))]


def header(w, hidden, layers, heads, kv_heads, ffn, vocab, rope_base):
    w.add_context_length(8192)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(hidden // heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(rope_base)
    tokens = tokens_of(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    w.add_token_merges([f"{a} {b}" for a, b in MERGES])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


def smollm2(path):
    hidden, layers, heads, kv_heads, ffn, vocab = 576, 30, 9, 3, 1536, 49152
    rng = np.random.default_rng(135)
    head = hidden // heads

    def mat(rows, cols, qtype=Q.Q4_1):
        m = (rng.standard_normal((rows, cols), dtype=np.float32) * cols**-0.5).astype(np.float32)
        return quantize(m, qtype), qtype

    def norm():
        return (1.0 + 0.1 * rng.standard_normal(hidden)).astype(np.float32), None

    w = GGUFWriter(path, "llama")
    header(w, hidden, layers, heads, kv_heads, ffn, vocab, 100000.0)
    t = {"token_embd.weight": mat(vocab, hidden, Q.Q8_0), "output_norm.weight": norm()}
    for i in range(layers):
        p = f"blk.{i}."
        t[p + "attn_norm.weight"] = norm()
        t[p + "attn_q.weight"] = mat(heads * head, hidden)
        t[p + "attn_k.weight"] = mat(kv_heads * head, hidden)
        t[p + "attn_v.weight"] = mat(kv_heads * head, hidden)
        t[p + "attn_output.weight"] = mat(hidden, heads * head)
        t[p + "ffn_norm.weight"] = norm()
        t[p + "ffn_gate.weight"] = mat(ffn, hidden)
        t[p + "ffn_up.weight"] = mat(ffn, hidden)
        t[p + "ffn_down.weight"] = mat(hidden, ffn)
    for name, (data, qtype) in t.items():
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def random_blocks(rng, qtype, count, cols):
    """`count` random blocks of a K-quant, their scales set so that a row's weights have about
    1/sqrt(cols) spread (random quants and sub-block scales, as random as a block can be)."""
    _, size = GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, size=(count, size), dtype=np.uint8)
    if qtype == Q.Q4_K:
        # d and dmin, f16, first: w = d * sc * q - dmin * m, sc and m < 64, q < 16.
        d = np.float16(1.0 / (63 * 15 * cols**0.5))
        b[:, 0:2] = np.frombuffer(d.tobytes(), np.uint8)
        b[:, 2:4] = np.frombuffer(d.tobytes(), np.uint8)
    elif qtype == Q.Q6_K:
        # d, f16, last: w = d * sc * (q - 32), |sc| < 128.
        d = np.float16(1.0 / (128 * 32 * cols**0.5))
        b[:, 208:210] = np.frombuffer(d.tobytes(), np.uint8)
    else:
        raise ValueError(qtype)
    return b


def llama3_8b_q4_k_m(path):
    hidden, layers, heads, kv_heads, ffn, vocab = 4096, 32, 32, 8, 14336, 128256
    rng = np.random.default_rng(8)
    head = hidden // heads

    def more_bits(i):
        return i < layers // 8 or i >= 7 * layers // 8 or (i - layers // 8) % 3 == 2

    # (name, rows, cols, type); None for an f32 norm of `hidden`.
    specs = [("token_embd.weight", vocab, hidden, Q.Q4_K)]
    for i in range(layers):
        p = f"blk.{i}."
        six = Q.Q6_K if more_bits(i) else Q.Q4_K
        specs += [
            (p + "attn_norm.weight", None, hidden, None),
            (p + "attn_q.weight", heads * head, hidden, Q.Q4_K),
            (p + "attn_k.weight", kv_heads * head, hidden, Q.Q4_K),
            (p + "attn_v.weight", kv_heads * head, hidden, six),
            (p + "attn_output.weight", hidden, heads * head, Q.Q4_K),
            (p + "ffn_norm.weight", None, hidden, None),
            (p + "ffn_gate.weight", ffn, hidden, Q.Q4_K),
            (p + "ffn_up.weight", ffn, hidden, Q.Q4_K),
            (p + "ffn_down.weight", hidden, ffn, six),
        ]
    specs += [("output_norm.weight", None, hidden, None), ("output.weight", vocab, hidden, Q.Q6_K)]

    # A pool of random blocks per (type, cols), repeated over each matrix: every byte is read
    # as in the real model, and writing 4.9 GB of fresh randomness would cost minutes.
    pools = {}

    def data(rows, cols, qtype):
        per_row = cols // 256
        if (qtype, cols) not in pools:
            pools[(qtype, cols)] = random_blocks(rng, qtype, 1 << 16, cols)
        pool = pools[(qtype, cols)]
        return np.resize(pool, (rows * per_row, pool.shape[1])).reshape(rows, -1)

    w = GGUFWriter(path, "llama")
    header(w, hidden, layers, heads, kv_heads, ffn, vocab, 500000.0)
    for name, rows, cols, qtype in specs:
        if qtype is None:
            w.add_tensor_info(name, (cols,), np.dtype(np.float32), cols * 4)
        else:
            row_bytes = cols // 256 * GGML_QUANT_SIZES[qtype][1]
            w.add_tensor_info(name, (rows, row_bytes), np.dtype(np.uint8), rows * row_bytes, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, rows, cols, qtype in specs:
        if qtype is None:
            w.write_tensor_data((1.0 + 0.1 * rng.standard_normal(cols)).astype(np.float32))
        else:
            w.write_tensor_data(data(rows, cols, qtype))
    w.close()


SHAPES = {"smollm2": smollm2, "llama3-8b-q4_k_m": llama3_8b_q4_k_m}

if __name__ == "__main__":
    SHAPES[sys.argv[2] if len(sys.argv) > 2 else "smollm2"](sys.argv[1])
