"""A random-weight model of the default model's shape, for speed measurements on a machine that
cannot fetch the model itself (tests/gpu/run on a GPU machine without a network): SmolLM2-135M's
Llama architecture (hidden 576, 30 layers, 9 query and 3 KV heads of 64, FFN 1536, a 49,152-token
byte-level vocabulary), its matrices Q4_1 and its embedding Q8_0, tied to the output, as in
SmolLM2-135M-Instruct.Q4_1.gguf. Every product and KV page has the real model's size, so a step
costs what it costs there; the text it writes is noise.

    python3 tests/gpu/bench_model.py OUT.gguf
"""
import os
import sys

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "reference"))
from tiny_models import MERGES, byte_chars  # noqa: E402

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, VOCAB = 576, 30, 9, 3, 1536, 49152


def main(path):
    rng = np.random.default_rng(135)
    head = HIDDEN // HEADS

    def mat(rows, cols, qtype=GGMLQuantizationType.Q4_1):
        m = (rng.standard_normal((rows, cols), dtype=np.float32) * cols**-0.5).astype(np.float32)
        return quantize(m, qtype), qtype

    def norm():
        return (1.0 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32), None

    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + byte_chars() + [a + b for a, b in MERGES]
    tokens += [f"<filler {i}>" for i in range(VOCAB - len(tokens))]
    w = GGUFWriter(path, "llama")
    w.add_context_length(8192)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(head)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(100000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    w.add_token_merges([f"{a} {b}" for a, b in MERGES])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    t = {"token_embd.weight": mat(VOCAB, HIDDEN, GGMLQuantizationType.Q8_0), "output_norm.weight": norm()}
    for i in range(LAYERS):
        p = f"blk.{i}."
        t[p + "attn_norm.weight"] = norm()
        t[p + "attn_q.weight"] = mat(HEADS * head, HIDDEN)
        t[p + "attn_k.weight"] = mat(KV_HEADS * head, HIDDEN)
        t[p + "attn_v.weight"] = mat(KV_HEADS * head, HIDDEN)
        t[p + "attn_output.weight"] = mat(HIDDEN, HEADS * head)
        t[p + "ffn_norm.weight"] = norm()
        t[p + "ffn_gate.weight"] = mat(FFN, HIDDEN)
        t[p + "ffn_up.weight"] = mat(FFN, HIDDEN)
        t[p + "ffn_down.weight"] = mat(HIDDEN, FFN)
    for name, (data, qtype) in t.items():
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main(sys.argv[1])
