"""Tiny random-weight models of every architecture inferd runs, written as GGUF with the gguf
package (deterministic: the same bytes on every machine with the pinned numpy and gguf).

    python3 tiny_models.py OUT_DIR

writes OUT_DIR/tiny-{llama,qwen2,qwen3,gemma3,phi3}.gguf, and the same models but Llama (whose
Hugging Face form the engine's own tests write) as Hugging Face directories tiny-ARCH-hf/
(config.json, model.safetensors, tokenizer.json, in transformers' names and layouts); the
long-context variants tiny-phi3-longrope (LongRoPE, partial rotation) and tiny-qwen2-yarn
(YaRN), trained on 256 positions and stretched to 1024, also as directories; and
tiny-pre-NAME.gguf, Llama models whose vocabularies name each GGUF pre-tokenizer inferd
knows, with merges learned across word boundaries (so a text split differently tokenizes
differently); and the embedding models of EMBEDDERS (a pooling type of their own).
The rerankers of RERANKERS (Qwen3's form: rank pooling, a two-label head `cls.output.weight`,
with a `rerank` prompt template or without) are written by `rerankers OUT_DIR`, for
daemon/tests/daemon/rerank.rs, which checks them against llama-server. The mixtures of experts
of MOES (Qwen3 MoE and gpt-oss: 8 experts, 2 a token, in Q8_0 or MXFP4; gpt-oss with its
biases, attention sinks, alternating 8-position windows and YaRN) are written by `moe OUT_DIR`, for
daemon/tests/daemon/moe.rs, which checks them against llama-server too. The hybrids of HYBRIDS
(tiny-qwen35: three Gated DeltaNet layers, then a gated attention layer; tiny-qwen35moe and
tiny-qwen3next: the same with a mixture of experts and a shared expert) are written with the
rest (and again in f32, tiny-ARCH-f32), and alone by `hybrid OUT_DIR` for
daemon/tests/daemon/hybrid.rs.
tests/reference/regen runs llama.cpp on the GGUF files; tests/e2e/reference.rs runs inferd on
them and compares, and checks that each directory gives the logits of its GGUF file."""
import json
import math
import os
import struct
import sys
import zlib

import numpy as np
from gguf import GGUFWriter, GGMLQuantizationType, PoolingType, RopeScalingType
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

# gpt-oss's harmony markers, control tokens of its vocabulary, and a chat template that writes
# harmony (the official one's shape in brief: the reasoning effort in the system message,
# tools in a developer message, the answer's channels).
HARMONY_TOKENS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"]
HARMONY_TEMPLATE = (
    "<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}<|end|>"
    "{%- if tools %}<|start|>developer<|message|># Tools{% for t in tools %} {{ t.function.name }}{% endfor %}<|end|>{% endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'tool' -%}<|start|>functions.tool to=assistant<|channel|>commentary<|message|>{{ m.content }}<|end|>"
    "{%- else -%}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"
)

# Gemma 3's turn and image markers (control tokens of the vision variant's vocabulary), and a
# chat template in the shape of Gemma's: turns between markers, the assistant called `model`.
GEMMA_TOKENS = ["<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>"]
GEMMA_TEMPLATE = (
    "{{ bos_token }}{%- for m in messages -%}"
    "<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}\n{{ m.content }}<end_of_turn>\n"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<start_of_turn>model\n{%- endif -%}"
)

# Shapes: hidden 64 (so 32-blocks divide everything), 4 query heads of 16, 2 KV heads.
HIDDEN, HEADS, KV_HEADS, FFN = 64, 4, 2, 128
# The trained context of the long-context variants, stretched 4 times. llama.cpp rounds its
# context up to a multiple of 256 and picks LongRoPE's factors by it, so the short ones need a
# trained context of 256 at least.
ORIGINAL = 256


def is_control(t):
    """Markers spelled <|...|> (harmony's) and Gemma's turn and image markers."""
    return (t.startswith("<|") and t.endswith("|>")) or t in GEMMA_TOKENS


def add_vocab(w, pre="default", tokens=TOKENS, merges=MERGES):
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    # Control tokens: the three specials, and markers spelled <|...|> (harmony's).
    w.add_token_types([3, 3, 2] + [3 if is_control(t) else 1 for t in tokens[3:]])
    w.add_token_merges([f"{a} {b}" for a, b in merges])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_add_bos_token(True)


# Texts whose splits differ between the pre-tokenizers: contractions, capitals inside words,
# digit runs, punctuation before slashes and line breaks, runs of spaces, other scripts.
PRE_TEXTS = [
    "Hello world",
    " leading space and  double  spaces",
    "Tabs\tand\nnewlines\n\n  indented",
    "Numbers 1234567 and 3.14159, dates 2026-11-30.",
    "HelloWorld and camelCaseWords, XMLHttpRequest, iPhone, MyClass::new()",
    "I'm sure they'll say it's 'fine' - don't they? WE'RE HERE, AREN'T WE",
    "path/to/file.txt\n/usr/bin/env --flag=1\n\nend.\r\nnext",
    "École ÉCOLE école naïve façade Straße ΑΒΓ αβγ Ünïcödé",
    "    four spaces\n\tand a tab\r\n crlf   \n",
    "日本語のテキストと中文，한국어 text",
    "emoji 🎉🚀 mixed👍text!!! ...?",
    "x=1;y=22;z=333;w=4444 (a+b)*c/d",
    "HelloWorld camelCase DON'T WE'RE IT'S path/\nmore",
]
PRE_TYPES = ["default", "smollm", "llama-bpe", "qwen2", "gpt-4o", "tekken"]
# More for Gemma 4's vocabulary: runs of line breaks (a token whole, or not), trailing spaces.
GEMMA4_TEXTS = ["one\n\ntwo\n\n\nthree\n", "\n\n", "trailing space ", "  ", "a\n\n\n\nb"]


def learn_merges(text, n):
    """Byte-level BPE merges learned on `text` as one sequence (no pre-tokenization, so merges
    cross word boundaries), most frequent pair first, ties to the larger pair."""
    chars = byte_chars()
    return learn_pairs([[chars[b] for b in text.encode()]], n)


def learn_pairs(seqs, n, skip=lambda pair: False):
    """Up to `n` merges learned on the sequences of symbols `seqs` (none across two of them),
    most frequent pair first, ties to the larger pair; pairs `skip` names are never merged."""
    merges = []
    for _ in range(n):
        counts = {}
        for seq in seqs:
            for pair in zip(seq, seq[1:]):
                if not skip(pair):
                    counts[pair] = counts.get(pair, 0) + 1
        if not counts:
            break
        pair = max(counts, key=lambda p: (counts[p], p))
        if counts[pair] < 2:
            break
        merges.append(pair)
        for j, seq in enumerate(seqs):
            out, i = [], 0
            while i < len(seq):
                if i + 1 < len(seq) and (seq[i], seq[i + 1]) == pair:
                    out.append(seq[i] + seq[i + 1])
                    i += 2
                else:
                    out.append(seq[i])
                    i += 1
            seqs[j] = out
    return merges


def gemma4_vocab():
    """Gemma 4's kind of vocabulary (`tokenizer.ggml.model = gemma4`): BPE over raw UTF-8 with
    spaces written `▁`, merges learned within lines (its pre-tokenizer splits at line breaks
    only), byte tokens `<0xNN>` for what no token spells (the emoji, whose characters are left
    out), and a run of two line breaks as a token no merge makes."""
    text = "\n".join(PRE_TEXTS * 2) + "\n" + "HelloWorld camelCase DON'T WE'RE IT'S path/\n" * 4
    lines = [list(line.replace(" ", "\u2581")) for line in text.split("\n") if line]
    left_out = set("🎉🚀👍")
    chars = sorted({c for line in lines for c in line} - left_out)
    merges = learn_pairs(lines, 300, lambda pair: bool(set(pair[0] + pair[1]) & left_out))
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)] + ["\n", "\n\n"]
    types = [3, 3, 3, 2] + [6] * 256 + [1, 1]
    seen = set(tokens)
    for t in chars + [a + b for a, b in merges]:
        if t not in seen:
            seen.add(t)
            tokens.append(t)
            types.append(1)
    return tokens, types, merges


def add_gemma4_vocab(w):
    tokens, types, merges = gemma4_vocab()
    w.add_tokenizer_model("gemma4")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types(types)
    w.add_token_merges([f"{a} {b}" for a, b in merges])
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_space_prefix(False)
    w.add_add_bos_token(True)
    return len(tokens)


def pre_vocab():
    # Capitals inside words and contractions in capitals, often enough to be merged across
    # the boundaries that only some patterns keep.
    extra = "HelloWorld camelCase DON'T WE'RE IT'S path/\n" * 4
    merges = learn_merges("\n".join(PRE_TEXTS * 2) + extra, 400)
    tokens = SPECIALS + byte_chars()
    seen = set(tokens)
    for a, b in merges:
        if a + b not in seen:
            seen.add(a + b)
            tokens.append(a + b)
    return tokens, merges


# A mixture of experts' shape: experts, experts a token, an expert's width.
EXPERTS, EXPERTS_USED, EXPERT_FFN = 8, 2, 32


def model(arch, path, seed, scaling=None, vocab=None, pooling=None, rerank=None, experts_type=None, template=None, embd=1.0, head=None, layers=None, context=None):
    rng = np.random.default_rng(seed)
    tokens, merges, pre = vocab or (TOKENS + (HARMONY_TOKENS if arch == "gpt-oss" else []), MERGES, "default")
    head = head or (32 if arch in ("qwen3", "qwen3vl", "qwen3moe", "gemma3") else HIDDEN // HEADS)  # qwen3/gemma3: head size apart from hidden
    moe = arch in ("qwen3moe", "gpt-oss")
    q, kv = HEADS * head, KV_HEADS * head
    layers = layers or (6 if arch == "gemma3" else 2)

    def mat(rows, cols, scale=None):
        return (rng.standard_normal((rows, cols)) * (scale or cols ** -0.5)).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w = GGUFWriter(path, arch)
    # The mixtures of experts are trained on 1024 positions, so that long answers fill a small
    # KV cache (daemon/tests/daemon/moe.rs).
    w.add_context_length(context or (4 * ORIGINAL if scaling else 1024 if moe else 256))
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
    if arch in ("gemma3", "gpt-oss"):
        w.add_sliding_window(8)
    if arch == "phi3":
        w.add_rope_dimension_count(12)  # partial rotary, as Phi-4-mini
    if arch == "qwen2vl":
        # M-RoPE: of each head's rotated pairs, a quarter turn with the time position, three
        # eighths with the row and three eighths with the column (Qwen2.5-VL's 16, 24, 24 of
        # 64; 2, 3, 3 of a tiny head's 8).
        w.add_rope_dimension_sections([head // 8, 3 * head // 16, 3 * head // 16, 0])
    if arch == "qwen3vl":
        # Interleaved M-RoPE's sections (Qwen3-VL's 24, 20, 20 of 64, scaled to the head), and
        # two deepstack layers: image tokens carry two more rows, added after layers 0 and 1.
        w.add_rope_dimension_sections([3 * head // 16, 5 * head // 32, 5 * head // 32, 0])
        w.add_num_deepstack_layers(QV3_DEEPSTACK)
    if scaling:
        w.add_rope_scaling_orig_ctx_len(ORIGINAL)
    if scaling == "yarn":
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(4.0)
    if scaling == "longrope":
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(4) / math.log(ORIGINAL)))
    add_vocab(w, pre, tokens, merges)
    if pooling is not None:
        # An embedding model: its pooling, and (last-token pooling) an end token after each text.
        w.add_pooling_type(pooling)
        w.add_add_eos_token(pooling == PoolingType.LAST)
    if arch == "gpt-oss":
        # gpt-oss's YaRN (its betas written as its conversion writes them), stretched 4 times.
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(4.0)
        w.add_rope_scaling_orig_ctx_len(64)
        w.add_rope_scaling_yarn_beta_fast(32.0)
        w.add_rope_scaling_yarn_beta_slow(1.0)
    if moe:
        w.add_expert_count(EXPERTS)
        w.add_expert_used_count(EXPERTS_USED)
        w.add_expert_feed_forward_length(EXPERT_FFN)
    if arch == "gpt-oss" or template:
        w.add_chat_template(template or HARMONY_TEMPLATE)
    if rerank is not None:
        # A reranker: "yes" and "no" as its labels, and its prompt (None: llama.cpp's
        # BOS query EOS document EOS).
        w.add_pooling_type(PoolingType.RANK)
        w.add_classifier_output_labels(["yes", "no"])
        w.add_add_eos_token(rerank["template"] is None)
        if rerank["template"] is not None:
            w.add_chat_template([{"name": "rerank", "template": rerank["template"]}])
    t = {}
    t["token_embd.weight"] = mat(len(tokens), HIDDEN, embd)
    t["output_norm.weight"] = norm(HIDDEN)
    if arch != "gemma3":
        t["output.weight"] = mat(len(tokens), HIDDEN)
    if arch == "llama":
        # Llama 3.1-style frequency divisors.
        t["rope_freqs.weight"] = np.linspace(1.0, 8.0, head // 2).astype(np.float32)
    if scaling == "longrope":
        # Phi-3's factor tables: near 1 for the short context, growing for the long one.
        t["rope_factors_short.weight"] = (1.0 + 0.2 * rng.random(6)).astype(np.float32)
        t["rope_factors_long.weight"] = np.geomspace(1.0, 16.0, 6).astype(np.float32) * (1.0 + 0.1 * rng.random(6)).astype(np.float32)
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
        if arch in ("qwen2", "qwen2vl", "gpt-oss"):
            for n, d in (("q", q), ("k", kv), ("v", kv)):
                t[p + f"attn_{n}.bias"] = (0.5 * rng.standard_normal(d)).astype(np.float32)
        if arch == "gpt-oss":
            t[p + "attn_output.bias"] = (0.5 * rng.standard_normal(HIDDEN)).astype(np.float32)
            # A sink per query head: some heads give it most of their weight, some little.
            t[p + "attn_sinks.weight"] = (2.0 * rng.standard_normal(HEADS)).astype(np.float32)
        if arch in ("qwen3", "qwen3vl", "qwen3moe", "gemma3"):
            t[p + "attn_q_norm.weight"] = norm(head)
            t[p + "attn_k_norm.weight"] = norm(head)
        if arch == "gemma3":
            t[p + "post_attention_norm.weight"] = norm(HIDDEN)
            t[p + "post_ffw_norm.weight"] = norm(HIDDEN)
        # gpt-oss's norm before the feed-forward has the name of a post-attention norm.
        t[p + ("post_attention_norm.weight" if arch == "gpt-oss" else "ffn_norm.weight")] = norm(HIDDEN)
        if arch == "gpt-oss":
            t[p + "ffn_gate_inp.bias"] = (0.5 * rng.standard_normal(EXPERTS)).astype(np.float32)
            for name, rows in (("gate", EXPERT_FFN), ("up", EXPERT_FFN), ("down", HIDDEN)):
                t[p + f"ffn_{name}_exps.bias"] = (0.5 * rng.standard_normal((EXPERTS, rows))).astype(np.float32)
        if moe:
            # The router, sharper than the rest so that the choice of experts varies; in f32, as
            # llama-quantize leaves it in real files.
            t[p + "ffn_gate_inp.weight"] = mat(EXPERTS, HIDDEN, 1.0)
            for name in ("gate", "up"):
                t[p + f"ffn_{name}_exps.weight"] = np.stack([mat(EXPERT_FFN, HIDDEN) for _ in range(EXPERTS)])
            # Experts that outweigh the residual, so that how they are chosen and weighed shows
            # in the logits.
            t[p + "ffn_down_exps.weight"] = np.stack([mat(HIDDEN, EXPERT_FFN, 4.0 / EXPERT_FFN ** 0.5) for _ in range(EXPERTS)])
            continue
        if arch == "phi3":
            t[p + "ffn_up.weight"] = mat(2 * FFN, HIDDEN)
        else:
            t[p + "ffn_gate.weight"] = mat(FFN, HIDDEN)
            t[p + "ffn_up.weight"] = mat(FFN, HIDDEN)
        t[p + "ffn_down.weight"] = mat(HIDDEN, FFN)
    if rerank is not None:
        t["cls.output.weight"] = mat(2, HIDDEN, 0.3)
    if scaling:
        # Sharper attention (scores 16 times larger), so that the position encoding, and
        # which of LongRoPE's tables it uses, shows in the logits.
        for i in range(layers):
            p = f"blk.{i}."
            if arch == "phi3":
                t[p + "attn_qkv.weight"][: q + kv] *= 4.0
            else:
                t[p + "attn_q.weight"] *= 4.0
                t[p + "attn_k.weight"] *= 4.0
    for name, value in t.items():
        if value.ndim == 3:
            # Expert stacks, in the type asked for.
            qt = getattr(GGMLQuantizationType, experts_type)
            w.add_tensor(name, quantize(value, qt), raw_dtype=qt)
        elif value.ndim == 2 and name != "token_embd.weight" and not name.endswith((".bias", "ffn_gate_inp.weight")):
            # Q8_0 matrices: quantized products on both sides, as real files have.
            w.add_tensor(name, quantize(value, GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return t, head, layers, scaling


# Qwen3.5's hybrid layers: Gated DeltaNet key heads, value heads, their size, the convolution's
# width, and every fourth layer full attention (the last of 4).
DN_K_HEADS, DN_V_HEADS, DN_HEAD, DN_CONV, HYBRID_LAYERS = 2, 4, 16, 4, 4


# The hybrids' shared expert's width.
SHARED_FFN = 96


def hybrid(path, seed, arch="qwen35", f32=False):
    """A tiny Qwen3.5 (`qwen35`): three Gated DeltaNet layers then one gated full-attention
    layer, partial interleaved M-RoPE, Q8_0 matrices as real files have, the recurrence's
    small tensors in f32. `qwen35moe` and `qwen3next` have a mixture of experts (Q8_0 stacks)
    with a shared expert instead of the dense feed-forward; `qwen3next` keeps a key head's
    value heads together and fuses its write strength and decay projections per key head
    (`ssm_ba`), and its first layer has the older fused input projection (`ssm_in`: per key
    head its queries, keys, values and gates) where the others have `attn_qkv` and `attn_gate`.
    `f32` writes every tensor in f32: no 8-bit rounding on either side, so inferd and llama.cpp
    agree to float rounding."""
    rng = np.random.default_rng(seed)
    moe = arch != "qwen35"
    head = HIDDEN // HEADS
    key_dim, value_dim = DN_K_HEADS * DN_HEAD, DN_V_HEADS * DN_HEAD

    def mat(rows, cols, scale=None):
        return (rng.standard_normal((rows, cols)) * (scale or cols ** -0.5)).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w = GGUFWriter(path, arch)
    w.add_context_length(1024)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(HYBRID_LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(8)  # a quarter of the head rotated, as Qwen3.5
    if arch != "qwen3next":
        w.add_rope_dimension_sections([2, 1, 1, 0])
    if moe:
        w.add_expert_count(EXPERTS)
        w.add_expert_used_count(EXPERTS_USED)
        w.add_expert_feed_forward_length(EXPERT_FFN)
        w.add_expert_shared_feed_forward_length(SHARED_FFN)
    w.add_ssm_conv_kernel(DN_CONV)
    w.add_ssm_inner_size(value_dim)
    w.add_ssm_state_size(DN_HEAD)
    w.add_ssm_time_step_rank(DN_V_HEADS)
    w.add_ssm_group_count(DN_K_HEADS)
    w.add_full_attention_interval(4)
    add_vocab(w, "default", TOKENS, MERGES)
    t = {"token_embd.weight": mat(len(TOKENS), HIDDEN, 1.0), "output_norm.weight": norm(HIDDEN),
         "output.weight": mat(len(TOKENS), HIDDEN)}
    for i in range(HYBRID_LAYERS):
        p = f"blk.{i}."
        t[p + "attn_norm.weight"] = norm(HIDDEN)
        if (i + 1) % 4 != 0:
            # Gated DeltaNet: Q, K and V through the convolution, the output gate z, the decay
            # (softplus(alpha + dt) * a, a < 0) and the write strength (sigmoid(beta)).
            qkv, z = mat(2 * key_dim + value_dim, HIDDEN), mat(value_dim, HIDDEN)
            if arch == "qwen3next" and i == 0:
                # Per key head: its query, key, its value heads' values, their gates.
                per_v = DN_V_HEADS // DN_K_HEADS * DN_HEAD
                heads = lambda m, at, n: [m[at + g * n:at + (g + 1) * n] for g in range(DN_K_HEADS)]
                qs, ks = heads(qkv, 0, DN_HEAD), heads(qkv, key_dim, DN_HEAD)
                vs, zs = heads(qkv, 2 * key_dim, per_v), heads(z, 0, per_v)
                t[p + "ssm_in.weight"] = np.concatenate([np.concatenate(g) for g in zip(qs, ks, vs, zs)])
            else:
                t[p + "attn_qkv.weight"] = qkv
                t[p + "attn_gate.weight"] = z
            t[p + "ssm_conv1d.weight"] = (0.5 * rng.standard_normal((2 * key_dim + value_dim, DN_CONV))).astype(np.float32)
            t[p + "ssm_dt.bias"] = (0.5 * rng.standard_normal(DN_V_HEADS)).astype(np.float32)
            t[p + "ssm_a"] = (-np.exp(rng.uniform(-1.0, 0.5, DN_V_HEADS))).astype(np.float32)
            beta, alpha = mat(DN_V_HEADS, HIDDEN), mat(DN_V_HEADS, HIDDEN)
            if arch == "qwen3next":
                # Per key head: its value heads' beta rows, then their alpha rows.
                per = DN_V_HEADS // DN_K_HEADS
                t[p + "ssm_ba.weight"] = np.concatenate(
                    [np.concatenate([beta[g * per:(g + 1) * per], alpha[g * per:(g + 1) * per]]) for g in range(DN_K_HEADS)])
            else:
                t[p + "ssm_beta.weight"] = beta
                t[p + "ssm_alpha.weight"] = alpha
            t[p + "ssm_norm.weight"] = norm(DN_HEAD)
            t[p + "ssm_out.weight"] = mat(HIDDEN, value_dim)
        else:
            # Full attention whose Q projection also gives each head's output gate.
            t[p + "attn_q.weight"] = mat(2 * HEADS * head, HIDDEN)
            t[p + "attn_k.weight"] = mat(KV_HEADS * head, HIDDEN)
            t[p + "attn_v.weight"] = mat(KV_HEADS * head, HIDDEN)
            t[p + "attn_output.weight"] = mat(HIDDEN, HEADS * head)
            t[p + "attn_q_norm.weight"] = norm(head)
            t[p + "attn_k_norm.weight"] = norm(head)
        t[p + "post_attention_norm.weight"] = norm(HIDDEN)
        if moe:
            # The router (f32, sharp), experts as strong as the residual (stronger ones, four
            # layers of them, amplify the 8-bit activations' rounding tenfold and more), and
            # the shared expert with its gate's one row.
            t[p + "ffn_gate_inp.weight"] = mat(EXPERTS, HIDDEN, 1.0)
            for name in ("gate", "up"):
                t[p + f"ffn_{name}_exps.weight"] = np.stack([mat(EXPERT_FFN, HIDDEN) for _ in range(EXPERTS)])
            t[p + "ffn_down_exps.weight"] = np.stack([mat(HIDDEN, EXPERT_FFN, 2.0 / EXPERT_FFN ** 0.5) for _ in range(EXPERTS)])
            t[p + "ffn_gate_shexp.weight"] = mat(SHARED_FFN, HIDDEN)
            t[p + "ffn_up_shexp.weight"] = mat(SHARED_FFN, HIDDEN)
            t[p + "ffn_down_shexp.weight"] = mat(HIDDEN, SHARED_FFN)
            t[p + "ffn_gate_inp_shexp.weight"] = (rng.standard_normal(HIDDEN) * HIDDEN ** -0.5).astype(np.float32)
        else:
            t[p + "ffn_gate.weight"] = mat(FFN, HIDDEN)
            t[p + "ffn_up.weight"] = mat(FFN, HIDDEN)
            t[p + "ffn_down.weight"] = mat(HIDDEN, FFN)
    for name, value in t.items():
        if f32:
            w.add_tensor(name, value.astype(np.float32))
        elif value.ndim == 3:
            w.add_tensor(name, quantize(value, GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0)
        elif value.ndim == 2 and name != "token_embd.weight" and not name.endswith("ffn_gate_inp.weight") and (
                not name.split(".")[-2].startswith("ssm_") or name.endswith(("ssm_out.weight", "ssm_in.weight"))):
            w.add_tensor(name, quantize(value, GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_safetensors(path, tensors):
    header, blobs, at = {}, [], 0
    for name, value in tensors.items():
        data = np.ascontiguousarray(value, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(value.shape), "data_offsets": [at, at + len(data)]}
        blobs.append(data)
        at += len(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw + b"".join(blobs))


def tokenizer_json():
    return {
        "version": "1.0",
        "added_tokens": [
            {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
             "special": True}
            for i, t in enumerate(SPECIALS)
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
            "vocab": {tok: i for i, tok in enumerate(TOKENS)},
            "merges": [f"{a} {b}" for a, b in MERGES],
        },
    }


def hf_model(arch, out, t, head, layers, scaling):
    """The same model as a Hugging Face directory, tensors as the GGUF holds them after
    dequantization (so both loaders see the same numbers), in transformers' names and layouts."""
    from gguf.quants import dequantize

    def deq(name):
        v = t[name]
        if v.ndim == 2 and name != "token_embd.weight":
            return dequantize(quantize(v, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0).reshape(v.shape)
        return v

    q, kv = HEADS * head, KV_HEADS * head
    gemma = arch == "gemma3"
    norm = (lambda v: v - 1.0) if gemma else (lambda v: v)
    st = {"model.embed_tokens.weight": deq("token_embd.weight"), "model.norm.weight": norm(deq("output_norm.weight"))}
    if not gemma:
        st["lm_head.weight"] = deq("output.weight")
    for i in range(layers):
        p, g = f"model.layers.{i}.", f"blk.{i}."
        st[p + "input_layernorm.weight"] = norm(deq(g + "attn_norm.weight"))
        if arch == "phi3":
            st[p + "self_attn.qkv_proj.weight"] = deq(g + "attn_qkv.weight")
            st[p + "mlp.gate_up_proj.weight"] = deq(g + "ffn_up.weight")
        else:
            for n in "qkv":
                st[p + f"self_attn.{n}_proj.weight"] = deq(g + f"attn_{n}.weight")
            st[p + "mlp.gate_proj.weight"] = deq(g + "ffn_gate.weight")
            st[p + "mlp.up_proj.weight"] = deq(g + "ffn_up.weight")
        st[p + "self_attn.o_proj.weight"] = deq(g + "attn_output.weight")
        st[p + "mlp.down_proj.weight"] = deq(g + "ffn_down.weight")
        if arch == "qwen2":
            for n in "qkv":
                st[p + f"self_attn.{n}_proj.bias"] = deq(g + f"attn_{n}.bias")
        if arch in ("qwen3", "gemma3"):
            st[p + "self_attn.q_norm.weight"] = norm(deq(g + "attn_q_norm.weight"))
            st[p + "self_attn.k_norm.weight"] = norm(deq(g + "attn_k_norm.weight"))
        if gemma:
            st[p + "post_attention_layernorm.weight"] = norm(deq(g + "post_attention_norm.weight"))
            st[p + "pre_feedforward_layernorm.weight"] = norm(deq(g + "ffn_norm.weight"))
            st[p + "post_feedforward_layernorm.weight"] = norm(deq(g + "post_ffw_norm.weight"))
        else:
            st[p + "post_attention_layernorm.weight"] = deq(g + "ffn_norm.weight")
    config = {
        "architectures": [{"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                           "phi3": "Phi3ForCausalLM"}[arch]],
        "model_type": "gemma3_text" if gemma else arch,
        "hidden_size": HIDDEN, "intermediate_size": FFN, "num_hidden_layers": layers,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": head,
        "vocab_size": VOCAB, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0 if gemma else 10000.0, "tie_word_embeddings": gemma,
        "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "float32",
    }
    if gemma:
        config.update({"sliding_window": 8, "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": head,
                       "hidden_activation": "gelu_pytorch_tanh",
                       "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]})
    else:
        config["hidden_act"] = "silu"
    if arch == "phi3":
        config["partial_rotary_factor"] = 12 / head
    if scaling:
        config["original_max_position_embeddings"] = ORIGINAL
        config["max_position_embeddings"] = 4 * ORIGINAL
    if scaling == "yarn":
        config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}
    if scaling == "longrope":
        config["rope_scaling"] = {"type": "longrope", "short_factor": [float(x) for x in t["rope_factors_short.weight"]],
                                  "long_factor": [float(x) for x in t["rope_factors_long.weight"]]}
    os.makedirs(out, exist_ok=True)
    write_safetensors(f"{out}/model.safetensors", st)
    with open(f"{out}/config.json", "w") as f:
        json.dump(config, f, indent=1)
    with open(f"{out}/tokenizer.json", "w") as f:
        json.dump(tokenizer_json(), f)


ARCHS = ["llama", "qwen2", "qwen3", "gemma3", "phi3"]

# Embedding models: (name, architecture, pooling), as the Qwen embedders (last token) and a
# CLS-pooled one.
EMBEDDERS = [("tiny-qwen2-embed-last", "qwen2", PoolingType.LAST), ("tiny-llama-embed-cls", "llama", PoolingType.CLS)]

# Mixtures of experts: (name, architecture, the experts' type).
MOES = [
    ("tiny-qwen3moe-q8_0", "qwen3moe", "Q8_0"),
    ("tiny-qwen3moe-mxfp4", "qwen3moe", "MXFP4"),
    ("tiny-gpt-oss-mxfp4", "gpt-oss", "MXFP4"),
]

# The hybrid families of hybrid(), and their seeds: ones where no DeltaNet head's query-key
# cosine at the first position (a head's whole output there, normalized, is its value's times
# that cosine's sign) lies within 0.06 of zero, where 8-bit rounding would flip its sign.
HYBRIDS = [("qwen35", 300), ("qwen35moe", 309), ("qwen3next", 309)]

# Gemma 4's layers: sliding-window ones with heads of G4_SWA_HEAD and one KV head, global
# ones with heads of G4_FULL_HEAD, two KV heads (K/V four times as wide as the sliding ones')
# and a quarter of each head rotated; per-layer
# embeddings of G4_PLE a layer; the last G4_SHARED layers read the K/V of the last layer of
# their kind before them.
G4_LAYERS, G4_SWA_HEAD, G4_FULL_HEAD, G4_PLE, G4_SHARED = 6, 16, 32, 8, 2


EMBD_SCALE = 0.3


def gemma4(path, seed, f32=False, moe=False, own_vocab=False):
    """A tiny Gemma 4 (`gemma4`, as E2B / E4B; with `moe`, as 26B-A4B: experts beside every
    layer's dense feed-forward, fused gate and up stacks in the even layers, each expert's
    output scale): sliding-window and global layers alternating,
    their heads of two sizes and KV heads of two counts, the global layers' "proportional"
    RoPE (frequency factors of 1e30 leave three quarters of a head unrotated) with their own
    base, K and V normed (V without a weight), attention unscaled, one global layer's V its K
    (no `attn_v`), per-layer embeddings gated into every layer, a scalar on every layer's
    output, the last two layers sharing earlier layers' K/V, and soft-capped logits."""
    rng = np.random.default_rng(seed)
    swa = [i % 2 == 0 for i in range(G4_LAYERS)]
    kv_heads = [1 if s else 2 for s in swa]
    first_shared = G4_LAYERS - G4_SHARED

    def mat(rows, cols, scale=None):
        return (rng.standard_normal((rows, cols)) * (scale or cols ** -0.5)).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w = GGUFWriter(path, "gemma4")
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(G4_LAYERS)
    # The layers sharing K/V twice as wide (the converter's `use_double_wide_mlp`).
    ffn = [FFN if i < first_shared else 2 * FFN for i in range(G4_LAYERS)]
    w.add_feed_forward_length(ffn)
    w.add_head_count(HEADS)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1000000.0)
    w.add_rope_freq_base_swa(10000.0)
    w.add_key_length(G4_FULL_HEAD)
    w.add_value_length(G4_FULL_HEAD)
    w.add_key_length_swa(G4_SWA_HEAD)
    w.add_value_length_swa(G4_SWA_HEAD)
    w.add_rope_dimension_count(G4_FULL_HEAD)
    w.add_rope_dimension_count_swa(G4_SWA_HEAD)
    w.add_sliding_window(8)
    w.add_sliding_window_pattern(swa)
    w.add_shared_kv_layers(G4_SHARED)
    w.add_embedding_length_per_layer_input(G4_PLE)
    w.add_final_logit_softcapping(30.0)
    if moe:
        w.add_expert_count(EXPERTS)
        w.add_expert_used_count(EXPERTS_USED)
        w.add_expert_feed_forward_length(EXPERT_FFN)
    vocab = add_gemma4_vocab(w) if own_vocab else VOCAB
    if not own_vocab:
        add_vocab(w)
    t = {}
    t["token_embd.weight"] = mat(vocab, HIDDEN, EMBD_SCALE)
    t["output_norm.weight"] = norm(HIDDEN)
    rotated = G4_FULL_HEAD // 8  # of the head's G4_FULL_HEAD / 2 pairs: a quarter of the head
    t["rope_freqs.weight"] = np.array([1.0] * rotated + [1e30] * (G4_FULL_HEAD // 2 - rotated), dtype=np.float32)
    t["per_layer_token_embd.weight"] = mat(vocab, G4_LAYERS * G4_PLE, 1.0)
    t["per_layer_model_proj.weight"] = mat(G4_LAYERS * G4_PLE, HIDDEN, 1.0)
    t["per_layer_proj_norm.weight"] = norm(G4_PLE)
    for i in range(G4_LAYERS):
        p = f"blk.{i}."
        head = G4_SWA_HEAD if swa[i] else G4_FULL_HEAD
        q, kv = HEADS * head, kv_heads[i] * head
        t[p + "attn_norm.weight"] = norm(HIDDEN)
        # Unscaled attention: queries and keys normed to about unit size, so scores stay
        # moderate.
        t[p + "attn_q.weight"] = mat(q, HIDDEN)
        t[p + "attn_q_norm.weight"] = norm(head)
        if i < first_shared:
            t[p + "attn_k.weight"] = mat(kv, HIDDEN)
            t[p + "attn_k_norm.weight"] = norm(head)
            if i != 1:
                t[p + "attn_v.weight"] = mat(kv, HIDDEN)
        t[p + "attn_output.weight"] = mat(HIDDEN, q)
        t[p + "post_attention_norm.weight"] = norm(HIDDEN)
        t[p + "ffn_norm.weight"] = norm(HIDDEN)
        t[p + "ffn_gate.weight"] = mat(ffn[i], HIDDEN)
        t[p + "ffn_up.weight"] = mat(ffn[i], HIDDEN)
        t[p + "ffn_down.weight"] = mat(HIDDEN, ffn[i])
        t[p + "post_ffw_norm.weight"] = norm(HIDDEN)
        t[p + "inp_gate.weight"] = mat(G4_PLE, HIDDEN)
        t[p + "proj.weight"] = mat(HIDDEN, G4_PLE)
        t[p + "post_norm.weight"] = norm(HIDDEN)
        t[p + "layer_output_scale.weight"] = np.array([0.5 + rng.random()], dtype=np.float32)
        if moe:
            # The router (f32) reads the normed residual scaled per channel over sqrt(hidden).
            t[p + "ffn_gate_inp.weight"] = mat(EXPERTS, HIDDEN, 1.0)
            t[p + "ffn_gate_inp.scale"] = norm(HIDDEN)
            gate = [mat(EXPERT_FFN, HIDDEN) for _ in range(EXPERTS)]
            up = [mat(EXPERT_FFN, HIDDEN) for _ in range(EXPERTS)]
            if i % 2 == 0:
                t[p + "ffn_gate_up_exps.weight"] = np.stack([np.concatenate([g, u]) for g, u in zip(gate, up)])
            else:
                t[p + "ffn_gate_exps.weight"] = np.stack(gate)
                t[p + "ffn_up_exps.weight"] = np.stack(up)
            t[p + "ffn_down_exps.weight"] = np.stack([mat(HIDDEN, EXPERT_FFN) for _ in range(EXPERTS)])
            t[p + "ffn_down_exps.scale"] = (0.5 + rng.random(EXPERTS)).astype(np.float32)
            t[p + "pre_ffw_norm_2.weight"] = norm(HIDDEN)
            t[p + "post_ffw_norm_1.weight"] = norm(HIDDEN)
            t[p + "post_ffw_norm_2.weight"] = norm(HIDDEN)
    for name, value in t.items():
        # Rows shorter than a Q8_0 block (the per-layer projection back) stay f32.
        small = value.ndim < 2 or value.shape[-1] % 32 != 0 or name in ("token_embd.weight", "per_layer_token_embd.weight")
        small = small or name.endswith("ffn_gate_inp.weight")
        if f32 or small:
            w.add_tensor(name, value)
        else:
            w.add_tensor(name, quantize(value, GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

# Rerankers (Qwen3's form): (name, prompt template).
RERANKERS = [("tiny-qwen3-rerank", "<s>query: {query}\ndocument: {document}</s>"), ("tiny-qwen3-rerank-bare", None)]

# The long-context variants: (name, architecture, scaling).
SCALED = [("tiny-phi3-longrope", "phi3", "longrope"), ("tiny-qwen2-yarn", "qwen2", "yarn")]

# The vision encoder of a tiny Gemma 3 mmproj (SigLIP's form): images of V_IMAGE pixels a side
# in patches of V_PATCH (16 x 16 patches, pooled 4 x 4 into 16 image tokens), V_LAYERS layers of
# width V_HIDDEN with V_HEADS heads; matrices of values bf16 holds (as the published checkpoints'
# are) in f16 as llama.cpp's converter writes them (the patch embedding in f32, the projection
# into the language model's width in f16).
V_IMAGE, V_PATCH, V_HIDDEN, V_HEADS, V_FFN, V_LAYERS = 224, 14, 64, 4, 128, 2
# Gemma 3 4B's vision tower (SigLIP so400m at 896 pixels) and its language model, for the speed
# comparisons (tests/bench/vision-encode, tests/bench/vision-ttft): image, patch, width, heads,
# feed-forward; the language model's width, heads, KV heads, head size, feed-forward and layers
# (27 vision layers to 34).
G3_4B_VISION = (896, 14, 1152, 16, 4304)
G3_4B_HIDDEN, G3_4B_TEXT = 2560, (8, 4, 256, 10240, 34)


def bf16_values(rng, rows, cols, scale=None):
    """A random matrix of values a bf16 holds, as the released vision checkpoints' are (trained
    and published in bf16; the converter's f16 holds them exactly)."""
    x = (rng.standard_normal((rows, cols)) * (scale or cols ** -0.5)).astype(np.float32)
    u = x.view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32)


def clip_writer(path, projector, image, patch, width, ffn, layers, heads, text_hidden, mean, std):
    """A projector file's writer with the `clip.*` keys every encoder here has."""
    w = GGUFWriter(path, "clip")
    w.add_type("mmproj")
    w.add_clip_has_vision_encoder(True)
    w.add_clip_projector_type(projector)
    w.add_vision_image_size(image)
    w.add_vision_patch_size(patch)
    w.add_vision_embedding_length(width)
    w.add_vision_feed_forward_length(ffn)
    w.add_vision_block_count(layers)
    w.add_vision_head_count(heads)
    w.add_vision_projection_dim(text_hidden)
    w.add_vision_attention_layernorm_eps(1e-6)
    w.add_vision_image_mean(mean)
    w.add_vision_image_std(std)
    return w


def write_all(w, tensors):
    """Adds `tensors` in order and writes the file."""
    for name, value in tensors.items():
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def mmproj(path, seed, text_hidden=HIDDEN, shapes=None, layers=V_LAYERS, pool=None):
    """A Gemma 3 vision projector (`clip.projector_type = gemma3`), as `mmproj-*.gguf` files are
    (with `pool`, its patches average-pooled `pool x pool` instead of 4 x 4)."""
    rng = np.random.default_rng(seed)
    V_IMAGE, V_PATCH, e, V_HEADS, V_FFN = shapes or (globals()["V_IMAGE"], globals()["V_PATCH"], V_HIDDEN, globals()["V_HEADS"], globals()["V_FFN"])
    V_LAYERS = layers
    n = (V_IMAGE // V_PATCH) ** 2

    def mat(rows, cols, scale=None):
        return bf16_values(rng, rows, cols, scale)

    def vec(k, scale=0.1, mean=0.0):
        return (mean + scale * rng.standard_normal(k)).astype(np.float32)

    w = clip_writer(path, "gemma3", V_IMAGE, V_PATCH, e, V_FFN, V_LAYERS, V_HEADS, text_hidden, [0.5, 0.5, 0.5], [0.5, 0.5, 0.5])
    w.add_vision_use_gelu(True)
    if pool:
        w.add_vision_projector_scale_factor(pool)
    t = {}
    t["v.patch_embd.weight"] = (rng.standard_normal((e, 3, V_PATCH, V_PATCH)) * (3 * V_PATCH * V_PATCH) ** -0.5).astype(np.float32)
    t["v.patch_embd.bias"] = vec(e)
    t["v.position_embd.weight"] = mat(n, e, 0.5)
    for i in range(V_LAYERS):
        p = f"v.blk.{i}."
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            t[p + name + ".weight"] = mat(e, e).astype(np.float16)
            t[p + name + ".bias"] = vec(e)
        for name in ("ln1", "ln2"):
            t[p + name + ".weight"] = vec(e, 0.1, 1.0)
            t[p + name + ".bias"] = vec(e)
        t[p + "ffn_up.weight"] = mat(V_FFN, e).astype(np.float16)
        t[p + "ffn_up.bias"] = vec(V_FFN)
        t[p + "ffn_down.weight"] = mat(e, V_FFN).astype(np.float16)
        t[p + "ffn_down.bias"] = vec(e)
    t["v.post_ln.weight"] = vec(e, 0.1, 1.0)
    t["v.post_ln.bias"] = vec(e)
    # Hugging Face's (vision width, text width) parameter, stored as it is.
    t["mm.input_projection.weight"] = mat(e, text_hidden).astype(np.float16)
    t["mm.soft_emb_norm.weight"] = vec(e, 0.1, 1.0)
    write_all(w, t)


# Qwen's chat markers and image markers (control tokens), and a ChatML template as Qwen's.
QWEN_VL_TOKENS = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
QWEN_TEMPLATE = (
    "{%- for m in messages -%}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"
)
# The vision encoder of a tiny Qwen2.5-VL mmproj: patches of 14 pixels merged 2 x 2 into image
# tokens, QV_LAYERS layers of width QV_HIDDEN (QV_HEADS heads of 16) where every second one
# attends over the whole image and the others within windows of 112 pixels (8 x 8 patches).
QV_PATCH, QV_HIDDEN, QV_HEADS, QV_FFN, QV_LAYERS, QV_WA_PATTERN = 14, 64, 4, 96, 4, 2
# Qwen2.5-VL 3B's vision tower (patch, width, heads, feed-forward, layers, every 8th layer over
# the whole image) and its language model's width, for tests/bench/vision-encode --qwen25vl.
QV_3B, QV_3B_TEXT = (14, 1280, 16, 3420, 32, 8), 2048


# The vision encoder of a tiny Qwen3-VL mmproj: patches of 16 pixels, learned positions on a
# 12 x 12 grid (192-pixel inputs), QV3_LAYERS layers, the outputs of layers 1 and 2 merged by
# deepstack mergers of their own.
QV3_PATCH, QV3_GRID, QV3_LAYERS, QV3_DEEPSTACK = 16, 12, 4, 2
# Qwen3-VL 2B's vision tower (patch, position grid, width, heads, feed-forward, layers, its
# deepstack layers) and its language model's width, for tests/bench/vision-encode --qwen3vl.
QV3_2B, QV3_2B_TEXT = (16, 48, 1024, 16, 4096, 24, (5, 11, 17)), 2048


def qwen3_mmproj(path, seed, text_hidden=HIDDEN, shapes=None):
    """A Qwen3-VL vision projector (`clip.projector_type = qwen3vl_merger`) as llama.cpp's
    converter writes it: the temporal pair of patch kernels and a bias, learned positions,
    layer norms, a fused QKV with bias, a GELU feed-forward, the main merger (`v.post_ln`,
    `mm.0`, `mm.2`) and a deepstack merger per chosen layer (`v.deepstack.N.*`)."""
    rng = np.random.default_rng(seed)
    p, grid, e, heads, f, layers, deep = shapes or (QV3_PATCH, QV3_GRID, QV_HIDDEN, QV_HEADS, QV_FFN, QV3_LAYERS, (1, 2))
    m = 4 * e

    def mat(rows, cols, scale=None):
        return bf16_values(rng, rows, cols, scale)

    def vec(k, scale=0.1, mean=0.0):
        return (mean + scale * rng.standard_normal(k)).astype(np.float32)

    w = clip_writer(path, "qwen3vl_merger", grid * p, p, e, f, layers, heads, text_hidden, [0.5, 0.5, 0.5], [0.5, 0.5, 0.5])
    w.add_vision_use_gelu(True)
    w.add_vision_spatial_merge_size(2)
    t = {}
    for name in ("v.patch_embd.weight", "v.patch_embd.weight.1"):
        t[name] = (rng.standard_normal((e, 3, p, p)) * (6 * p * p) ** -0.5).astype(np.float16)
    t["v.patch_embd.bias"] = vec(e)
    t["v.position_embd.weight"] = mat(grid * grid, e, 0.5)
    for i in range(layers):
        b = f"v.blk.{i}."
        for name in ("ln1", "ln2"):
            t[b + name + ".weight"] = vec(e, 0.1, 1.0)
            t[b + name + ".bias"] = vec(e)
        t[b + "attn_qkv.weight"] = mat(3 * e, e).astype(np.float16)
        t[b + "attn_qkv.bias"] = vec(3 * e)
        t[b + "attn_out.weight"] = mat(e, e).astype(np.float16)
        t[b + "attn_out.bias"] = vec(e)
        t[b + "ffn_up.weight"] = mat(f, e).astype(np.float16)
        t[b + "ffn_up.bias"] = vec(f)
        t[b + "ffn_down.weight"] = mat(e, f).astype(np.float16)
        t[b + "ffn_down.bias"] = vec(e)
        if i in deep:
            d = f"v.deepstack.{i}."
            t[d + "norm.weight"] = vec(m, 0.1, 1.0)
            t[d + "norm.bias"] = vec(m)
            t[d + "fc1.weight"] = mat(m, m).astype(np.float16)
            t[d + "fc1.bias"] = vec(m)
            t[d + "fc2.weight"] = mat(text_hidden, m).astype(np.float16)
            t[d + "fc2.bias"] = vec(text_hidden)
    t["v.post_ln.weight"] = vec(e, 0.1, 1.0)
    t["v.post_ln.bias"] = vec(e)
    t["mm.0.weight"] = mat(m, m).astype(np.float16)
    t["mm.0.bias"] = vec(m)
    t["mm.2.weight"] = mat(text_hidden, m).astype(np.float16)
    t["mm.2.bias"] = vec(text_hidden)
    write_all(w, t)


def qwen_mmproj(path, seed, text_hidden=HIDDEN, shapes=None, qwen2=False):
    """A Qwen2.5-VL vision projector (`clip.projector_type = qwen2.5vl`) as llama.cpp's
    converter writes it: the temporal patch convolution as two 2-D kernels (no bias), RMS
    norms, a gated SiLU feed-forward with biases, the merger's RMS norm as `v.post_ln` and its
    GELU MLP over 2 x 2 patches as `mm.0` and `mm.2`. With `qwen2`, Qwen2-VL's
    (`qwen2vl_merger`): layer norms with biases, a plain quick-GELU feed-forward, no windows."""
    rng = np.random.default_rng(seed)
    p, e, QV_HEADS, QV_FFN, QV_LAYERS, QV_WA_PATTERN = shapes or (QV_PATCH, QV_HIDDEN, globals()["QV_HEADS"], globals()["QV_FFN"], globals()["QV_LAYERS"], globals()["QV_WA_PATTERN"])

    def mat(rows, cols, scale=None):
        return bf16_values(rng, rows, cols, scale)

    def vec(k, scale=0.1, mean=0.0):
        return (mean + scale * rng.standard_normal(k)).astype(np.float32)

    kind = "qwen2vl_merger" if qwen2 else "qwen2.5vl_merger"
    w = clip_writer(path, kind, 560, p, e, QV_FFN, QV_LAYERS, QV_HEADS, text_hidden, [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711])
    if not qwen2:
        w.add_vision_use_silu(True)
        w.add_vision_n_wa_pattern(QV_WA_PATTERN)
    t = {}
    for name in ("v.patch_embd.weight", "v.patch_embd.weight.1"):
        t[name] = (rng.standard_normal((e, 3, p, p)) * (6 * p * p) ** -0.5).astype(np.float16)
    for i in range(QV_LAYERS):
        b = f"v.blk.{i}."
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            t[b + name + ".weight"] = mat(e, e).astype(np.float16)
            t[b + name + ".bias"] = vec(e)
        for name in ("ln1", "ln2"):
            t[b + name + ".weight"] = vec(e, 0.1, 1.0)
            if qwen2:
                t[b + name + ".bias"] = vec(e)
        for name in ("ffn_up",) if qwen2 else ("ffn_gate", "ffn_up"):
            t[b + name + ".weight"] = mat(QV_FFN, e).astype(np.float16)
            t[b + name + ".bias"] = vec(QV_FFN)
        t[b + "ffn_down.weight"] = mat(e, QV_FFN).astype(np.float16)
        t[b + "ffn_down.bias"] = vec(e)
    t["v.post_ln.weight"] = vec(e, 0.1, 1.0)
    if qwen2:
        t["v.post_ln.bias"] = vec(e)
    t["mm.0.weight"] = mat(4 * e, 4 * e).astype(np.float16)
    t["mm.0.bias"] = vec(4 * e)
    t["mm.2.weight"] = mat(text_hidden, 4 * e).astype(np.float16)
    t["mm.2.bias"] = vec(text_hidden)
    write_all(w, t)


def png(path, width, height, pixel):
    """An 8-bit RGB PNG whose pixel (x, y) is pixel(x, y), written with zlib alone."""
    raw = b"".join(b"\x00" + bytes(v for x in range(width) for v in pixel(x, y)) for y in range(height))

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def vision(out):
    """tiny-gemma3-vision.gguf (Gemma 3 with its image markers and chat template) and its
    projector tiny-gemma3-vision-mmproj.gguf (and a slow one), for daemon/tests/daemon/vision.rs; and two
    images: square.png, of the encoder's input size (taken as it is), and wide.png, which is
    resized and letterboxed."""
    # Token embeddings of the image embeddings' size (Gemma scales looked-up rows by
    # sqrt(hidden), not images'), so that the image weighs in the answer and the tied output's
    # logits leave several tokens likely.
    model("gemma3", f"{out}/tiny-gemma3-vision.gguf", 500, vocab=(TOKENS + GEMMA_TOKENS, MERGES, "default"), template=GEMMA_TEMPLATE, embd=0.15)
    mmproj(f"{out}/tiny-gemma3-vision-mmproj.gguf", 501)
    # A projector for the same model whose encoding takes long (896 pixels, 4,096 patches,
    # four layers of width 256: about a second on two cores), pooled 16 x 16 into the same 16
    # image tokens, so that another request's stream has many steps to run while an image
    # encodes.
    mmproj(f"{out}/tiny-gemma3-vision-slow-mmproj.gguf", 504, shapes=(896, 14, 256, 4, 512), layers=4, pool=16)
    png(f"{out}/square.png", V_IMAGE, V_IMAGE, lambda x, y: ((x * 7 + y * 3) % 256, (x * y) % 256, int(127 + 127 * math.sin(x / 9 + y / 13))))
    png(f"{out}/wide.png", 300, 170, lambda x, y: ((x * 5) % 256, (y * 11) % 256, (x ^ y) % 256))


def qwen_vision(out):
    """tiny-qwen25vl.gguf (`qwen2vl`: Qwen 2's layers with M-RoPE, Qwen's markers and ChatML)
    and its projector tiny-qwen25vl-mmproj.gguf, for daemon/tests/daemon/vision.rs; and two
    images: landscape.png, 476 x 280 (a multiple of 28 each way: taken as it is, 17 x 10 image
    tokens in windows of 8 x 8, the last ones cut), and odd.png, 150 x 230, which is resized."""
    model("qwen2vl", f"{out}/tiny-qwen25vl.gguf", 510, vocab=(TOKENS + QWEN_VL_TOKENS, MERGES, "default"), template=QWEN_TEMPLATE, context=1024)
    qwen_mmproj(f"{out}/tiny-qwen25vl-mmproj.gguf", 511)
    # Qwen2-VL's projector for the same language model (Qwen2-VL's is the same family).
    qwen_mmproj(f"{out}/tiny-qwen2vl-mmproj.gguf", 518, qwen2=True)
    # Qwen3-VL: its language model (Qwen 3's layers, interleaved M-RoPE, two deepstack layers)
    # and projector; and grid.png, of its learned positions' own size (192 x 192).
    model("qwen3vl", f"{out}/tiny-qwen3vl.gguf", 514, vocab=(TOKENS + QWEN_VL_TOKENS, MERGES, "default"), template=QWEN_TEMPLATE, context=1024, layers=3)
    qwen3_mmproj(f"{out}/tiny-qwen3vl-mmproj.gguf", 515)
    png(f"{out}/grid.png", 192, 192, lambda x, y: ((x * 13 + y) % 256, (y * 7) % 256, (x * y // 5) % 256))
    png(f"{out}/landscape.png", 476, 280, lambda x, y: ((x * 3 + y * 5) % 256, (x * y // 7) % 256, int(127 + 127 * math.sin(x / 11 - y / 7))))
    png(f"{out}/odd.png", 150, 230, lambda x, y: ((x * 9) % 256, (y * 4 + x) % 256, (x ^ (2 * y)) % 256))


def vision_bench_qwen(out, layers):
    """A random-weight projector at Qwen2.5-VL 3B's vision shapes with `layers` of its 32
    layers (every 8th over the whole image), a one-layer language model of its width (only
    loaded: llama-mtmd-cli needs one), and an 896 x 896 image (1,024 image tokens), for
    tests/bench/vision-encode --qwen25vl."""
    p, e, heads, ffn, _, wa = QV_3B
    qwen_mmproj(f"{out}/bench-qwen25vl-3b-mmproj.gguf", 512, QV_3B_TEXT, (p, e, heads, ffn, layers, wa))
    global HIDDEN, HEADS, KV_HEADS, FFN
    saved = (HIDDEN, HEADS, KV_HEADS, FFN)
    HIDDEN, HEADS, KV_HEADS, FFN = QV_3B_TEXT, 16, 2, 256
    try:
        model("qwen2vl", f"{out}/bench-qwen25vl-3b-lm.gguf", 513, vocab=(TOKENS + QWEN_VL_TOKENS, MERGES, "default"), template=QWEN_TEMPLATE, head=128, layers=1, context=4096)
    finally:
        HIDDEN, HEADS, KV_HEADS, FFN = saved
    png(f"{out}/image-896-0.png", 896, 896, lambda x, y: ((x * 7 + y * 3) % 256, (x * y) % 256, (x ^ y) % 256))


def vision_bench_qwen3(out, layers):
    """A random-weight projector at Qwen3-VL 2B's vision shapes with `layers` of its 24 layers
    (its three deepstack layers placed in the same proportion), a one-layer language model of
    its width with three deepstack layers (only loaded), and an 896 x 896 image (784 image
    tokens), for tests/bench/vision-encode --qwen3vl."""
    p, grid, e, heads, ffn, full, deep = QV3_2B
    deep = tuple(min(layers - 1, round(d * layers / full)) for d in deep)
    qwen3_mmproj(f"{out}/bench-qwen3vl-2b-mmproj.gguf", 516, QV3_2B_TEXT, (p, grid, e, heads, ffn, layers, deep))
    global HIDDEN, HEADS, KV_HEADS, FFN, QV3_DEEPSTACK
    saved = (HIDDEN, HEADS, KV_HEADS, FFN, QV3_DEEPSTACK)
    HIDDEN, HEADS, KV_HEADS, FFN, QV3_DEEPSTACK = QV3_2B_TEXT, 16, 8, 256, len(deep)
    try:
        model("qwen3vl", f"{out}/bench-qwen3vl-2b-lm.gguf", 517, vocab=(TOKENS + QWEN_VL_TOKENS, MERGES, "default"), template=QWEN_TEMPLATE, head=128, layers=len(deep) + 1, context=4096)
    finally:
        HIDDEN, HEADS, KV_HEADS, FFN, QV3_DEEPSTACK = saved
    png(f"{out}/image-896-0.png", 896, 896, lambda x, y: ((x * 7 + y * 3) % 256, (x * y) % 256, (x ^ y) % 256))


def vision_bench(out, layers):
    """A random-weight projector at Gemma 3 4B's vision shapes with `layers` layers, a language
    model at Gemma 3 4B's shapes (Q8_0 matrices, the tiny vocabulary) with as many of its 34
    layers as keep its share (34 / 27 of `layers`), and three 896 x 896 images, for
    tests/bench/vision-encode and tests/bench/vision-ttft."""
    mmproj(f"{out}/bench-gemma3-4b-mmproj.gguf", 502, G3_4B_HIDDEN, G3_4B_VISION, layers)
    global HIDDEN, HEADS, KV_HEADS, FFN
    saved = (HIDDEN, HEADS, KV_HEADS, FFN)
    heads, kv_heads, head, ffn, text_layers = G3_4B_TEXT
    HIDDEN, HEADS, KV_HEADS, FFN = G3_4B_HIDDEN, heads, kv_heads, ffn
    try:
        model("gemma3", f"{out}/bench-gemma3-4b-lm.gguf", 503, vocab=(TOKENS + GEMMA_TOKENS, MERGES, "default"), template=GEMMA_TEMPLATE, embd=0.15, head=head, layers=max(1, round(layers * text_layers / 27)), context=4096)
    finally:
        HIDDEN, HEADS, KV_HEADS, FFN = saved
    for i in range(3):
        png(f"{out}/image-896-{i}.png", 896, 896, lambda x, y: ((x * (7 + i) + y * 3) % 256, (x * y + i) % 256, (x ^ y) % 256))


if __name__ == "__main__" and sys.argv[1] == "vision":
    vision(sys.argv[2])
    qwen_vision(sys.argv[2])
elif __name__ == "__main__" and sys.argv[1] == "vision-bench":
    vision_bench(sys.argv[2], int(sys.argv[3]))
elif __name__ == "__main__" and sys.argv[1] == "vision-bench-qwen":
    vision_bench_qwen(sys.argv[2], int(sys.argv[3]))
elif __name__ == "__main__" and sys.argv[1] == "vision-bench-qwen3":
    vision_bench_qwen3(sys.argv[2], int(sys.argv[3]))
elif __name__ == "__main__" and sys.argv[1] == "moe":
    for seed, (name, arch, experts_type) in enumerate(MOES, start=200):
        model(arch, f"{sys.argv[2]}/{name}.gguf", seed, experts_type=experts_type)
elif __name__ == "__main__" and sys.argv[1] == "hybrid":
    for arch, seed in HYBRIDS:
        hybrid(f"{sys.argv[2]}/tiny-{arch}.gguf", seed, arch)
elif __name__ == "__main__" and sys.argv[1] == "gemma4":
    gemma4(f"{sys.argv[2]}/tiny-gemma4.gguf", 400)
    gemma4(f"{sys.argv[2]}/tiny-gemma4-f32.gguf", 400, f32=True)
    gemma4(f"{sys.argv[2]}/tiny-gemma4-moe.gguf", 401, moe=True)
    gemma4(f"{sys.argv[2]}/tiny-gemma4-moe-f32.gguf", 401, f32=True, moe=True)
    gemma4(f"{sys.argv[2]}/tiny-gemma4-vocab.gguf", 402, own_vocab=True)
elif __name__ == "__main__" and sys.argv[1] == "rerankers":
    for seed, (name, template) in enumerate(RERANKERS, start=100):
        model("qwen3", f"{sys.argv[2]}/{name}.gguf", seed, rerank={"template": template})
elif __name__ == "__main__":
    out = sys.argv[1]
    for seed, arch in enumerate(ARCHS):
        t, head, layers, _ = model(arch, f"{out}/tiny-{arch}.gguf", seed)
        if arch != "llama":
            hf_model(arch, f"{out}/tiny-{arch}-hf", t, head, layers, None)
    for seed, (name, arch, scaling) in enumerate(SCALED, start=len(ARCHS)):
        hf_model(arch, f"{out}/{name}-hf", *model(arch, f"{out}/{name}.gguf", seed, scaling))
    tokens, merges = pre_vocab()
    for seed, pre in enumerate(PRE_TYPES, start=len(ARCHS) + len(SCALED)):
        model("llama", f"{out}/tiny-pre-{pre}.gguf", seed, vocab=(tokens, merges, pre))
    for seed, (name, arch, pooling) in enumerate(EMBEDDERS, start=len(ARCHS) + len(SCALED) + len(PRE_TYPES)):
        model(arch, f"{out}/{name}.gguf", seed, pooling=pooling)
    for arch, seed in HYBRIDS:
        hybrid(f"{out}/tiny-{arch}.gguf", seed, arch)
        hybrid(f"{out}/tiny-{arch}-f32.gguf", seed, arch, f32=True)
    gemma4(f"{out}/tiny-gemma4.gguf", 400)
    gemma4(f"{out}/tiny-gemma4-f32.gguf", 400, f32=True)
    gemma4(f"{out}/tiny-gemma4-moe.gguf", 401, moe=True)
    gemma4(f"{out}/tiny-gemma4-moe-f32.gguf", 401, f32=True, moe=True)
    gemma4(f"{out}/tiny-gemma4-vocab.gguf", 402, own_vocab=True)
