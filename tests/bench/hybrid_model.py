"""A random-weight hybrid model at a Qwen3.5 small model's shapes, for the hybrid speed figures in
BENCHMARKS.md (tests/bench/hybrid-model runs this, then llama-quantize to Q4_K_M).

    python3 hybrid_model.py OUT.gguf [VOCAB.gguf]

The shapes of a 2B-class Qwen3.5 as far as its family's published configs give them: hidden
2048, 24 layers of which every fourth is gated full attention (8 query heads and 2 key/value
heads of 256, a quarter of each head rotated) and the rest Gated DeltaNet (16 key heads and 16
value heads of 128, a convolution of 4), feed-forward 6144; the tests' 264-token vocabulary
(not its 248,320), so a step's time is the layers'. Matrices are written as random Q8_0 blocks
(as tests/bench/moe_model.py), the recurrence's small tensors in f32. With VOCAB.gguf, that
file's vocabulary and chat template instead (the prefix-cache figures: chat requests whose
turns end in the vocabulary's own end-of-turn token)."""
import os
import sys

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "reference"))
from tiny_models import TOKENS, add_vocab  # noqa: E402

HIDDEN, LAYERS, FFN = 2048, 24, 6144
HEADS, KV_HEADS, HEAD, ROPE = 8, 2, 256, 64
K_HEADS, V_HEADS, DN_HEAD, CONV = 16, 16, 128, 4


def copy_vocab(w, path):
    """Every `tokenizer.*` key of the GGUF file at `path` into `w`; returns the vocabulary's size."""
    size = 0
    for key, field in GGUFReader(path).fields.items():
        if not key.startswith("tokenizer."):
            continue
        value, kind = field.contents(), field.types[0]
        if kind == GGUFValueType.ARRAY:
            w.add_key_value(key, value, kind, sub_type=field.types[-1])
        else:
            w.add_key_value(key, value, kind)
        if key == "tokenizer.ggml.tokens":
            size = len(value)
    return size


def main(path, vocab=None):
    rng = np.random.default_rng(35)

    def q8_0(rows, cols):
        nb = cols // 32
        codes = rng.integers(-127, 128, size=(rows, nb, 32), dtype=np.int8)
        scale = np.full((rows, nb, 1), cols ** -0.5 / 73.3, dtype=np.float16)
        return np.concatenate([scale.view(np.uint8), codes.view(np.uint8)], axis=-1).reshape(rows, nb * 34)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    key_dim, value_dim = K_HEADS * DN_HEAD, V_HEADS * DN_HEAD
    w = GGUFWriter(path, "qwen35")
    w.add_context_length(32768)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HEAD)
    w.add_value_length(HEAD)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000000.0)
    w.add_rope_dimension_count(ROPE)
    w.add_rope_dimension_sections([11, 11, 10, 0])
    w.add_ssm_conv_kernel(CONV)
    w.add_ssm_inner_size(value_dim)
    w.add_ssm_state_size(DN_HEAD)
    w.add_ssm_time_step_rank(V_HEADS)
    w.add_ssm_group_count(K_HEADS)
    w.add_full_attention_interval(4)
    if vocab:
        n_vocab = copy_vocab(w, vocab)
    else:
        add_vocab(w)
        n_vocab = len(TOKENS)
    q8 = GGMLQuantizationType.Q8_0
    w.add_tensor("token_embd.weight", q8_0(n_vocab, HIDDEN), raw_dtype=q8)
    w.add_tensor("output_norm.weight", norm(HIDDEN))
    w.add_tensor("output.weight", q8_0(n_vocab, HIDDEN), raw_dtype=q8)
    for i in range(LAYERS):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", norm(HIDDEN))
        if (i + 1) % 4 != 0:
            w.add_tensor(p + "attn_qkv.weight", q8_0(2 * key_dim + value_dim, HIDDEN), raw_dtype=q8)
            w.add_tensor(p + "attn_gate.weight", q8_0(value_dim, HIDDEN), raw_dtype=q8)
            w.add_tensor(p + "ssm_conv1d.weight", (0.5 * rng.standard_normal((2 * key_dim + value_dim, CONV))).astype(np.float32))
            w.add_tensor(p + "ssm_dt.bias", (0.5 * rng.standard_normal(V_HEADS)).astype(np.float32))
            w.add_tensor(p + "ssm_a", (-np.exp(rng.uniform(-1.0, 0.5, V_HEADS))).astype(np.float32))
            w.add_tensor(p + "ssm_beta.weight", (rng.standard_normal((V_HEADS, HIDDEN)) * HIDDEN ** -0.5).astype(np.float32))
            w.add_tensor(p + "ssm_alpha.weight", (rng.standard_normal((V_HEADS, HIDDEN)) * HIDDEN ** -0.5).astype(np.float32))
            w.add_tensor(p + "ssm_norm.weight", norm(DN_HEAD))
            w.add_tensor(p + "ssm_out.weight", q8_0(HIDDEN, value_dim), raw_dtype=q8)
        else:
            w.add_tensor(p + "attn_q.weight", q8_0(2 * HEADS * HEAD, HIDDEN), raw_dtype=q8)
            w.add_tensor(p + "attn_k.weight", q8_0(KV_HEADS * HEAD, HIDDEN), raw_dtype=q8)
            w.add_tensor(p + "attn_v.weight", q8_0(KV_HEADS * HEAD, HIDDEN), raw_dtype=q8)
            w.add_tensor(p + "attn_output.weight", q8_0(HIDDEN, HEADS * HEAD), raw_dtype=q8)
            w.add_tensor(p + "attn_q_norm.weight", norm(HEAD))
            w.add_tensor(p + "attn_k_norm.weight", norm(HEAD))
        w.add_tensor(p + "post_attention_norm.weight", norm(HIDDEN))
        w.add_tensor(p + "ffn_gate.weight", q8_0(FFN, HIDDEN), raw_dtype=q8)
        w.add_tensor(p + "ffn_up.weight", q8_0(FFN, HIDDEN), raw_dtype=q8)
        w.add_tensor(p + "ffn_down.weight", q8_0(HIDDEN, FFN), raw_dtype=q8)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
