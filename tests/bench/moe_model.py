"""A random-weight mixture of experts at a real family's layer shapes, for the MoE speed
figures in BENCHMARKS.md (tests/bench/moe-model runs this, then llama-quantize to Q4_K_M).

    python3 moe_model.py OUT.gguf LAYERS

Qwen3-30B-A3B's layer: hidden 2048; attention 32 query heads and 4 key/value heads of 128 with
Q/K norms; 128 experts of width 768, 8 a token, normalized (its `norm_topk_prob`). Fewer layers
than its 48 and the tests' 264-token vocabulary (not its 151,936), so the file stays a few GB
and a step's time is the layers' (the logits row of a real vocabulary would add about a tenth).
Every matrix is written as Q8_0 blocks drawn at random (uniform 8-bit codes, a scale that gives
each row the spread of a 1/sqrt(cols) Gaussian), which is fast at this size; llama-quantize
then requantizes them as it would a real model's."""
import os
import sys

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "reference"))
from tiny_models import TOKENS, add_vocab  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD = 2048, 32, 4, 128
EXPERTS, USED, WIDTH = 128, 8, 768


def main(path, layers):
    rng = np.random.default_rng(30)

    def q8_0(*shape):
        # Uniform codes in -127..127 have a spread of about 73.3.
        *lead, cols = shape
        nb = cols // 32
        codes = rng.integers(-127, 128, size=(*lead, nb, 32), dtype=np.int8)
        scale = np.full((*lead, nb, 1), cols ** -0.5 / 73.3, dtype=np.float16)
        blocks = np.concatenate([scale.view(np.uint8), codes.view(np.uint8)], axis=-1)
        return blocks.reshape(*lead, nb * 34)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w = GGUFWriter(path, "qwen3moe")
    w.add_context_length(32768)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(layers)
    w.add_feed_forward_length(6144)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HEAD)
    w.add_value_length(HEAD)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1000000.0)
    w.add_expert_count(EXPERTS)
    w.add_expert_used_count(USED)
    w.add_expert_feed_forward_length(WIDTH)
    add_vocab(w)
    q8 = GGMLQuantizationType.Q8_0
    w.add_tensor("token_embd.weight", q8_0(len(TOKENS), HIDDEN), raw_dtype=q8)
    w.add_tensor("output_norm.weight", norm(HIDDEN))
    w.add_tensor("output.weight", q8_0(len(TOKENS), HIDDEN), raw_dtype=q8)
    for i in range(layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", norm(HIDDEN))
        w.add_tensor(p + "attn_q.weight", q8_0(HEADS * HEAD, HIDDEN), raw_dtype=q8)
        w.add_tensor(p + "attn_k.weight", q8_0(KV_HEADS * HEAD, HIDDEN), raw_dtype=q8)
        w.add_tensor(p + "attn_v.weight", q8_0(KV_HEADS * HEAD, HIDDEN), raw_dtype=q8)
        w.add_tensor(p + "attn_output.weight", q8_0(HIDDEN, HEADS * HEAD), raw_dtype=q8)
        w.add_tensor(p + "attn_q_norm.weight", norm(HEAD))
        w.add_tensor(p + "attn_k_norm.weight", norm(HEAD))
        w.add_tensor(p + "ffn_norm.weight", norm(HIDDEN))
        # The router in f32, as converted models keep it (llama-quantize leaves it so).
        router = (rng.standard_normal((EXPERTS, HIDDEN)) * HIDDEN ** -0.5).astype(np.float32)
        w.add_tensor(p + "ffn_gate_inp.weight", router)
        w.add_tensor(p + "ffn_gate_exps.weight", q8_0(EXPERTS, WIDTH, HIDDEN), raw_dtype=q8)
        w.add_tensor(p + "ffn_up_exps.weight", q8_0(EXPERTS, WIDTH, HIDDEN), raw_dtype=q8)
        w.add_tensor(p + "ffn_down_exps.weight", q8_0(EXPERTS, HIDDEN, WIDTH), raw_dtype=q8)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
