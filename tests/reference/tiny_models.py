"""Tiny random-weight models of every architecture inferd runs, written as GGUF with the gguf
package (deterministic: the same bytes on every machine with the pinned numpy and gguf).

    python3 tiny_models.py OUT_DIR

writes OUT_DIR/tiny-{llama,qwen2,qwen3,gemma3,phi3}.gguf. tests/reference/regen runs llama.cpp
on them; tests/e2e/reference.rs runs inferd on the same files and compares."""
import sys

import numpy as np
from gguf import GGUFWriter, GGMLQuantizationType
from gguf.quants import quantize

# A byte-level vocabulary: three specials, the 256 byte characters of GPT-2's mapping, a few merges.
def byte_chars():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


SPECIALS = ["<s>", "</s>", "<unk>"]
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a")]
TOKENS = SPECIALS + byte_chars() + [a + b for a, b in MERGES]
VOCAB = len(TOKENS)

# Shapes: hidden 64 (so 32-blocks divide everything), 4 query heads of 16, 2 KV heads.
HIDDEN, HEADS, KV_HEADS, FFN = 64, 4, 2, 128


def add_vocab(w):
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(TOKENS)
    w.add_token_types([3, 3, 2] + [1] * (VOCAB - 3))
    w.add_token_merges([f"{a} {b}" for a, b in MERGES])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_add_bos_token(True)


def model(arch, path, seed):
    rng = np.random.default_rng(seed)
    head = 32 if arch in ("qwen3", "gemma3") else HIDDEN // HEADS  # qwen3/gemma3: head size apart from hidden
    q, kv = HEADS * head, KV_HEADS * head
    layers = 6 if arch == "gemma3" else 2

    def mat(rows, cols, scale=None):
        return (rng.standard_normal((rows, cols)) * (scale or cols ** -0.5)).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w = GGUFWriter(path, arch)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(layers)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0 if arch != "gemma3" else 1000000.0)
    if head * HEADS != HIDDEN:
        w.add_key_length(head)
        w.add_value_length(head)
    if arch == "gemma3":
        w.add_sliding_window(8)
    if arch == "phi3":
        w.add_rope_dimension_count(12)  # partial rotary, as Phi-4-mini
    add_vocab(w)
    t = {}
    t["token_embd.weight"] = mat(VOCAB, HIDDEN, 1.0)
    t["output_norm.weight"] = norm(HIDDEN)
    if arch != "gemma3":
        t["output.weight"] = mat(VOCAB, HIDDEN)
    if arch == "llama":
        # Llama 3.1-style frequency divisors.
        t["rope_freqs.weight"] = np.linspace(1.0, 8.0, head // 2).astype(np.float32)
    for i in range(layers):
        p = f"blk.{i}."
        t[p + "attn_norm.weight"] = norm(HIDDEN)
        if arch == "phi3":
            t[p + "attn_qkv.weight"] = mat(q + 2 * kv, HIDDEN)
        else:
            t[p + "attn_q.weight"] = mat(q, HIDDEN)
            t[p + "attn_k.weight"] = mat(kv, HIDDEN)
            t[p + "attn_v.weight"] = mat(kv, HIDDEN)
        t[p + "attn_output.weight"] = mat(HIDDEN, q)
        if arch == "qwen2":
            for n, d in (("q", q), ("k", kv), ("v", kv)):
                t[p + f"attn_{n}.bias"] = (0.5 * rng.standard_normal(d)).astype(np.float32)
        if arch in ("qwen3", "gemma3"):
            t[p + "attn_q_norm.weight"] = norm(head)
            t[p + "attn_k_norm.weight"] = norm(head)
        if arch == "gemma3":
            t[p + "post_attention_norm.weight"] = norm(HIDDEN)
            t[p + "post_ffw_norm.weight"] = norm(HIDDEN)
        t[p + "ffn_norm.weight"] = norm(HIDDEN)
        if arch == "phi3":
            t[p + "ffn_up.weight"] = mat(2 * FFN, HIDDEN)
        else:
            t[p + "ffn_gate.weight"] = mat(FFN, HIDDEN)
            t[p + "ffn_up.weight"] = mat(FFN, HIDDEN)
        t[p + "ffn_down.weight"] = mat(HIDDEN, FFN)
    for name, value in t.items():
        if value.ndim == 2 and name != "token_embd.weight":
            # Q8_0 matrices: quantized products on both sides, as real files have.
            w.add_tensor(name, quantize(value, GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


ARCHS = ["llama", "qwen2", "qwen3", "gemma3", "phi3"]

if __name__ == "__main__":
    out = sys.argv[1]
    for seed, arch in enumerate(ARCHS):
        model(arch, f"{out}/tiny-{arch}.gguf", seed)
