#!/usr/bin/env python3
"""Produce independent reference ("golden") data for SmolLM2-135M-Instruct (Q4_1 GGUF).

What it does
------------
This script shares no code with the inferd engine. It reads the GGUF file with the
``gguf`` package (``gguf.GGUFReader``), dequantizes every weight tensor with
``gguf.quants.dequantize`` and runs a plain numpy forward pass of the Llama
architecture in float64 (full-precision activations, no activation quantization,
float64 KV cache). From that it writes two files next to this script:

* ``smollm2-135m-instruct-q4_1.json``: for a handful of prompts, the prompt token
  ids, a 24-token greedy continuation, the top-1/top-2 logit margin at every greedy
  step, and for the first step the top-20 (id, logit) pairs, the logits of token
  ids 0..255, the full-vocabulary logit mean / standard deviation / log-sum-exp.
  It also contains a small "tolerance study": the same prompts re-run with
  (a) float32 activations, (b) activations rounded to 8-bit blocks of 32 before
  every quantized matmul (like an engine that quantizes activations to Q8 for
  integer dot products), and (c) (b) plus an f16 KV cache, reporting how far
  their logits move (first step, and all 24 steps teacher-forced on the reference
  tokens) and whether the greedy tokens change.
* ``tokenizer-smollm2.json``: tokenizer reference cases (text, whether special
  tokens are parsed, ids, token strings).

Tokenizer reference
-------------------
The ids come from the Hugging Face ``tokenizers`` library, configured the way the
upstream SmolLM2 ``tokenizer.json`` is: byte-level BPE (no unk token, no byte
fallback), pre-tokenizer Sequence[Digits(individual_digits=True),
ByteLevel(add_prefix_space=False, use_regex=True)], ByteLevel decoder, the 17
control tokens (GGUF token_type 3) registered as special added tokens. Vocabulary
and merges are taken from the GGUF file (``tokenizer.ggml.tokens`` /
``tokenizer.ggml.merges``). For "specials not parsed" a second instance without
the added tokens is used, so "<|im_start|>" is tokenized as plain text.
Every case is cross-checked against a small pure-Python BPE written in this file;
the script aborts if the two disagree.

Model details honoured here (all read from GGUF metadata, nothing hard-coded):
block count, embedding length, heads / KV heads (GQA), FFN length, RoPE base,
RMSNorm epsilon, vocab size, add_bos_token. RoPE is applied to adjacent pairs
(x[2i], x[2i+1]) with theta_i = base^(-2i/head_dim) ("normal"/GPT-J style),
because llama.cpp's converter permutes the Q/K rows of Llama checkpoints for that
layout. The output projection is the (tied) token embedding, since the file has
no output.weight tensor.

How to run (from the repository root)
-------------------------------------
    python3 -m venv /tmp/golden-venv
    /tmp/golden-venv/bin/pip install -r tests/golden/requirements.txt
    /tmp/golden-venv/bin/python tests/golden/make_golden.py PATH_TO_GGUF

Options: ``--out-dir DIR`` (default: this script's folder), ``--skip-study``
(skip the tolerance study, about 3x faster). A full run takes about a minute on two
CPU cores and needs about 3 GB of memory. The output is deterministic.
"""

import argparse
import collections
import hashlib
import json
import math
import os
import sys
import time
from importlib import metadata as importlib_metadata

import numpy as np
import gguf
import regex
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

SCRIPT_NAME = "tests/golden/make_golden.py"
N_GENERATE = 24
TOP_K = 20

# --------------------------------------------------------------------------------------
# Prompts for the generation golden data.
# --------------------------------------------------------------------------------------

CHATML_PROMPT = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    "<|im_start|>assistant\n"
)

LONG_PARAGRAPH = (
    "The history of computing is a story of steadily shrinking machines and steadily "
    "growing ambitions. In the 1940s, a single computer filled a room, consumed enormous "
    "amounts of power, and could perform only a few thousand operations per second. "
    "Engineers replaced vacuum tubes with transistors, then packed transistors onto "
    "integrated circuits, and each step made computers smaller, cheaper, and faster. "
    "Today a phone in your pocket is millions of times more powerful than those early "
    "machines, and"
)

PROMPTS = [
    {"name": "capital_of_france", "text": "The capital of France is", "parse_special": False},
    {"name": "code_fibonacci", "text": "def fibonacci(n):", "parse_special": False},
    {"name": "counting", "text": "1, 2, 3, 4,", "parse_special": False},
    {"name": "chatml_capital", "text": CHATML_PROMPT, "parse_special": True},
    {"name": "long_paragraph", "text": LONG_PARAGRAPH, "parse_special": False},
]

# --------------------------------------------------------------------------------------
# Tokenizer reference cases.
# --------------------------------------------------------------------------------------

TOKENIZER_CASES = [
    ("english_simple", "Hello world", False),
    ("english_sentence", "The quick brown fox jumps over the lazy dog.", False),
    ("english_contractions", "I'm sure they'll say it's what we've done, isn't it? You'd know.", False),
    ("english_mixed_case", "HTTP requests and JSONParser objects in CamelCase", False),
    ("code_python_indent", "def add(a, b):\n    return a + b\n\nif __name__ == \"__main__\":\n    print(add(1, 2))\n", False),
    ("code_tabs", "fn main() {\n\tlet x = 5;\n\t\tif x > 3 {\n\t\t\tprintln!(\"{}\", x);\n\t\t}\n}\n", False),
    ("code_symbols", "a->b != c && d <= e || f >>= 2; // comment #tag @user $var", False),
    ("numbers", "3.14159 and 1234567", False),
    ("digits_only", "12345", False),
    ("numbers_mixed", "In 2024, 42% of 1,000 people paid $19.99 (v3.2.1).", False),
    ("whitespace_runs", "a  b   c\n\n\n  d", False),
    ("whitespace_trailing", "end with spaces   ", False),
    ("whitespace_only", "   \n\t ", False),
    ("leading_space", " Hello", False),
    ("leading_spaces_multi", "   Hello world", False),
    ("leading_newline", "\nHello", False),
    ("single_space", " ", False),
    ("empty", "", False),
    ("unicode_accents", "Café déjà vu, naïve façade, Ærøskøbing, señor", False),
    ("unicode_cjk", "日本語のテキスト", False),
    ("unicode_chinese", "你好，世界！", False),
    ("unicode_cyrillic", "Привет, как дела? Москва", False),
    ("unicode_greek_arabic", "αβγ δέλτα مرحبا", False),
    ("emoji", "I love 🦀 and 👍🏽", False),
    ("emoji_zwj", "family: 👨‍👩‍👧 flag: 🇫🇷", False),
    ("unicode_superscript_fraction", "x² + ½ = ३", False),
    ("chatml_specials_parsed", CHATML_PROMPT, True),
    ("chatml_specials_not_parsed", CHATML_PROMPT, False),
    ("specials_adjacent_parsed", "<|im_start|><|im_end|><|endoftext|>x<jupyter_code>", True),
    ("special_lookalike_parsed", "<|im_start |> <im_start> <|im_start", True),
    ("long_paragraph", LONG_PARAGRAPH, False),
]

# Cases whose behaviour is implementation-defined; kept apart so that an engine can
# decide whether to match them.
TOKENIZER_EDGE_CASES = [
    (
        "byte_without_vocab_entry",
        "a\x04b",
        False,
        "Byte 0x04 has no token in this vocabulary (neither do 0x06, 0x13, 0x14, 0x16, "
        "0x1d, nor the never-valid UTF-8 bytes 0xC0, 0xC1, 0xF1-0xFF). The HF reference "
        "(BPE without unk token or byte fallback) silently drops it.",
    ),
]

# --------------------------------------------------------------------------------------
# GGUF helpers
# --------------------------------------------------------------------------------------


def sha256_of(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def field_value(reader, key, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def describe_metadata(reader):
    """Scalar keys with their values, array keys with their lengths."""
    scalars, arrays = {}, {}
    for key, field in reader.fields.items():
        if field.types and field.types[0] == gguf.GGUFValueType.ARRAY:
            arrays[key] = len(field.data)
        else:
            value = field.contents()
            if isinstance(value, float):
                value = float(np.float32(value))
            scalars[key] = value
    return scalars, arrays


def read_config(reader):
    arch = field_value(reader, "general.architecture")
    if arch != "llama":
        raise SystemExit(f"expected a llama-architecture GGUF, got {arch!r}")

    def req(key):
        value = field_value(reader, f"{arch}.{key}")
        if value is None:
            raise SystemExit(f"missing GGUF key {arch}.{key}")
        return value

    n_embd = int(req("embedding_length"))
    n_head = int(req("attention.head_count"))
    n_head_kv = int(field_value(reader, f"{arch}.attention.head_count_kv", n_head))
    head_dim = n_embd // n_head
    rope_dim = int(field_value(reader, f"{arch}.rope.dimension_count", head_dim))
    n_vocab = field_value(reader, f"{arch}.vocab_size")
    if n_vocab is None:
        n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    return {
        "architecture": arch,
        "n_layer": int(req("block_count")),
        "n_embd": n_embd,
        "n_head": n_head,
        "n_head_kv": n_head_kv,
        "head_dim": head_dim,
        "rope_dim": rope_dim,
        "n_ff": int(req("feed_forward_length")),
        "n_vocab": int(n_vocab),
        "context_length": int(req("context_length")),
        # GGUF stores these as float32; keep exactly that value.
        "rope_freq_base": float(np.float32(field_value(reader, f"{arch}.rope.freq_base", 10000.0))),
        "rms_norm_eps": float(np.float32(req("attention.layer_norm_rms_epsilon"))),
    }


def load_weights(reader, cfg):
    """Dequantize every tensor to float32 (then float64 for the matmuls)."""
    raw = {}
    types = {}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        # GGUF shape is (ne0, ne1, ...) with ne0 the fastest dimension; numpy rows are ne1.
        w = np.asarray(w, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])
        raw[t.name] = w
        types[t.name] = t.tensor_type.name
    weights = {
        "tok_embd": raw["token_embd.weight"],
        "output_norm": raw["output_norm.weight"],
        "output": raw.get("output.weight", raw["token_embd.weight"]),
        "layers": [],
    }
    for i in range(cfg["n_layer"]):
        p = f"blk.{i}."
        weights["layers"].append(
            {
                "attn_norm": raw[p + "attn_norm.weight"],
                "wq": raw[p + "attn_q.weight"],
                "wk": raw[p + "attn_k.weight"],
                "wv": raw[p + "attn_v.weight"],
                "wo": raw[p + "attn_output.weight"],
                "ffn_norm": raw[p + "ffn_norm.weight"],
                "w_gate": raw[p + "ffn_gate.weight"],
                "w_up": raw[p + "ffn_up.weight"],
                "w_down": raw[p + "ffn_down.weight"],
            }
        )
    d = cfg["n_embd"]
    assert weights["tok_embd"].shape == (cfg["n_vocab"], d), weights["tok_embd"].shape
    assert weights["layers"][0]["wq"].shape == (cfg["n_head"] * cfg["head_dim"], d)
    assert weights["layers"][0]["wk"].shape == (cfg["n_head_kv"] * cfg["head_dim"], d)
    assert weights["layers"][0]["w_down"].shape == (d, cfg["n_ff"])
    return weights, types, "output.weight" in raw


def cast_weights(weights, dtype):
    out = {k: v.astype(dtype) for k, v in weights.items() if k != "layers"}
    out["layers"] = [{k: v.astype(dtype) for k, v in layer.items()} for layer in weights["layers"]]
    return out


# --------------------------------------------------------------------------------------
# Forward pass
# --------------------------------------------------------------------------------------


def quantize_blocks_q8(x, block=32):
    """Round each row of x to int8 in blocks of `block` values with a per-block scale
    (absmax / 127), then return the dequantized values. Simulates an engine that feeds
    quantized activations to integer dot products."""
    shape = x.shape
    xb = x.reshape(-1, block)
    amax = np.max(np.abs(xb), axis=1, keepdims=True)
    # the scale is stored as f16 in Q8 block formats
    d = (amax / 127.0).astype(np.float16).astype(x.dtype)
    safe = np.where(d == 0, 1, d)
    q = np.clip(np.round(xb / safe), -127, 127)
    return (q * d).reshape(shape)


class Llama:
    def __init__(self, cfg, weights, dtype=np.float64, act_q8=False, kv_f16=False):
        self.cfg = cfg
        self.w = cast_weights(weights, dtype)
        self.dtype = dtype
        self.act_q8 = act_q8
        self.kv_f16 = kv_f16
        hd = cfg["head_dim"]
        rd = cfg["rope_dim"]
        i = np.arange(rd // 2, dtype=np.float64)
        self.inv_freq = cfg["rope_freq_base"] ** (-2.0 * i / rd)  # theta_i

    def mm(self, x, w):
        """x: (T, in), w: (out, in) -> (T, out)."""
        if self.act_q8:
            x = quantize_blocks_q8(x)
        return x @ w.T

    def rmsnorm(self, x, w):
        ms = np.mean(x * x, axis=-1, keepdims=True)
        return x / np.sqrt(ms + self.cfg["rms_norm_eps"]) * w

    def rope(self, x, positions):
        """x: (T, H, head_dim); rotate adjacent pairs (x[2i], x[2i+1])."""
        rd = self.cfg["rope_dim"]
        ang = positions[:, None].astype(np.float64) * self.inv_freq[None, :]  # (T, rd/2)
        cos = np.cos(ang).astype(self.dtype)[:, None, :]
        sin = np.sin(ang).astype(self.dtype)[:, None, :]
        out = x.copy()
        x0 = x[..., 0:rd:2]
        x1 = x[..., 1:rd:2]
        out[..., 0:rd:2] = x0 * cos - x1 * sin
        out[..., 1:rd:2] = x0 * sin + x1 * cos
        return out

    def new_cache(self):
        return [{"k": None, "v": None} for _ in range(self.cfg["n_layer"])]

    def forward(self, tokens, start_pos, cache):
        """Run `tokens` at positions start_pos.. and return logits of the last token."""
        cfg = self.cfg
        T = len(tokens)
        H, Hkv, hd = cfg["n_head"], cfg["n_head_kv"], cfg["head_dim"]
        group = H // Hkv
        positions = np.arange(start_pos, start_pos + T)
        x = self.w["tok_embd"][np.asarray(tokens)].astype(self.dtype)  # (T, d)
        scale = 1.0 / math.sqrt(hd)
        for li, L in enumerate(self.w["layers"]):
            h = self.rmsnorm(x, L["attn_norm"])
            q = self.mm(h, L["wq"]).reshape(T, H, hd)
            k = self.mm(h, L["wk"]).reshape(T, Hkv, hd)
            v = self.mm(h, L["wv"]).reshape(T, Hkv, hd)
            q = self.rope(q, positions)
            k = self.rope(k, positions)
            if self.kv_f16:
                k = k.astype(np.float16).astype(self.dtype)
                v = v.astype(np.float16).astype(self.dtype)
            c = cache[li]
            c["k"] = k if c["k"] is None else np.concatenate([c["k"], k], axis=0)
            c["v"] = v if c["v"] is None else np.concatenate([c["v"], v], axis=0)
            K, V = c["k"], c["v"]  # (S, Hkv, hd), S = start_pos + T
            S = K.shape[0]
            # causal mask: query at position p sees keys at positions <= p
            key_pos = np.arange(S)
            mask = key_pos[None, :] > positions[:, None]  # (T, S)
            attn_out = np.empty((T, H, hd), dtype=self.dtype)
            for hh in range(H):
                kv = hh // group
                scores = (q[:, hh, :] @ K[:, kv, :].T) * scale  # (T, S)
                scores = np.where(mask, -np.inf, scores)
                scores = scores - scores.max(axis=1, keepdims=True)
                p = np.exp(scores)
                p /= p.sum(axis=1, keepdims=True)
                attn_out[:, hh, :] = p @ V[:, kv, :]
            x = x + self.mm(attn_out.reshape(T, H * hd), L["wo"])
            h = self.rmsnorm(x, L["ffn_norm"])
            g = self.mm(h, L["w_gate"])
            u = self.mm(h, L["w_up"])
            act = g / (1.0 + np.exp(-g)) * u  # SiLU(gate) * up
            x = x + self.mm(act, L["w_down"])
        last = self.rmsnorm(x[-1:], self.w["output_norm"])
        logits = self.mm(last, self.w["output"])[0]
        return logits.astype(np.float64)

    def generate(self, prompt_ids, n, forced=None):
        """Greedy decoding of n tokens. Returns (per-step logits, tokens, margins, top-1 logits).
        With `forced` (a token list), those tokens are fed instead of the argmax
        (teacher forcing); the returned tokens are still this model's argmax."""
        cache = self.new_cache()
        logits = self.forward(prompt_ids, 0, cache)
        pos = len(prompt_ids)
        all_logits, out, margins, top1 = [], [], [], []
        for step in range(n):
            all_logits.append(logits)
            order = np.argsort(-logits, kind="stable")
            a, b = int(order[0]), int(order[1])
            out.append(a)
            margins.append(float(logits[a] - logits[b]))
            top1.append(float(logits[a]))
            if step + 1 < n:
                nxt = a if forced is None else int(forced[step])
                logits = self.forward([nxt], pos, cache)
                pos += 1
        return all_logits, out, margins, top1


# --------------------------------------------------------------------------------------
# Tokenizers: HF `tokenizers` reference + a tiny pure-Python cross-check
# --------------------------------------------------------------------------------------


def gguf_vocab(reader):
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    merges = reader.fields["tokenizer.ggml.merges"].contents()
    return tokens, types, merges


def build_hf_tokenizer(tokens, types, merges, with_specials):
    vocab = {t: i for i, t in enumerate(tokens)}
    assert len(vocab) == len(tokens), "duplicate token strings in vocabulary"
    pairs = []
    for m in merges:
        a, b = m.split(" ")
        pairs.append((a, b))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    if with_specials:
        specials = [t for t, ty in zip(tokens, types) if ty == 3]  # CONTROL tokens
        tok.add_special_tokens(
            [AddedToken(s, special=True, normalized=False, lstrip=False, rstrip=False, single_word=False) for s in specials]
        )
    return tok


def bytes_to_unicode():
    """GPT-2's reversible byte -> printable character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


class MiniBPE:
    """Small independent byte-level BPE used only to cross-check the HF reference."""

    WORD_RE = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
    DIGIT_RE = regex.compile(r"\p{N}")

    def __init__(self, tokens, types, merges):
        self.vocab = {t: i for i, t in enumerate(tokens)}
        self.ranks = {tuple(m.split(" ")): r for r, m in enumerate(merges)}
        self.b2u = bytes_to_unicode()
        self.specials = sorted((t for t, ty in zip(tokens, types) if ty == 3), key=len, reverse=True)
        self.special_re = regex.compile("|".join(regex.escape(s) for s in self.specials))

    def bpe(self, word):
        syms = [c for c in word if c in self.vocab]  # unknown bytes are dropped (as HF does)
        while len(syms) > 1:
            best = None
            for i in range(len(syms) - 1):
                r = self.ranks.get((syms[i], syms[i + 1]))
                if r is not None and (best is None or r < best[0]):
                    best = (r, i)
            if best is None:
                break
            a, b = syms[best[1]], syms[best[1] + 1]
            merged, i = [], 0
            while i < len(syms):
                if i < len(syms) - 1 and syms[i] == a and syms[i + 1] == b:
                    merged.append(a + b)
                    i += 2
                else:
                    merged.append(syms[i])
                    i += 1
            syms = merged
        return [self.vocab[s] for s in syms]

    def encode_plain(self, text):
        ids = []
        # Digits(individual_digits=True): every numeric character is its own piece.
        pieces, last = [], 0
        for m in self.DIGIT_RE.finditer(text):
            if m.start() > last:
                pieces.append(text[last : m.start()])
            pieces.append(m.group())
            last = m.end()
        if last < len(text):
            pieces.append(text[last:])
        for piece in pieces:
            for w in self.WORD_RE.findall(piece):
                ids.extend(self.bpe("".join(self.b2u[b] for b in w.encode("utf-8"))))
        return ids

    def encode(self, text, parse_special):
        if not parse_special:
            return self.encode_plain(text)
        ids, last = [], 0
        for m in self.special_re.finditer(text):
            ids.extend(self.encode_plain(text[last : m.start()]))
            ids.append(self.vocab[m.group()])
            last = m.end()
        ids.extend(self.encode_plain(text[last:]))
        return ids


class RefTokenizer:
    def __init__(self, reader):
        tokens, types, merges = gguf_vocab(reader)
        self.tokens = tokens
        self.hf_special = build_hf_tokenizer(tokens, types, merges, with_specials=True)
        self.hf_plain = build_hf_tokenizer(tokens, types, merges, with_specials=False)
        self.mini = MiniBPE(tokens, types, merges)

    def encode(self, text, parse_special):
        tok = self.hf_special if parse_special else self.hf_plain
        ids = tok.encode(text, add_special_tokens=False).ids
        check = self.mini.encode(text, parse_special)
        if ids != check:
            raise SystemExit(f"tokenizer cross-check failed for {text!r}:\n  hf:   {ids}\n  mini: {check}")
        return ids

    def decode(self, ids):
        # skip_special_tokens=False so that e.g. <|im_end|> shows up in the text
        return self.hf_special.decode(ids, skip_special_tokens=False)


# --------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------


def pkg_version(name):
    try:
        return importlib_metadata.version(name)
    except importlib_metadata.PackageNotFoundError:
        return None


def logsumexp(x):
    m = np.max(x)
    return float(m + np.log(np.sum(np.exp(x - m))))


def r6(x):
    return round(float(x), 6)


def first_step_summary(logits):
    order = np.argsort(-logits, kind="stable")[:TOP_K]
    return {
        "argmax": int(order[0]),
        "top20": [[int(i), r6(logits[i])] for i in order],
        "logits_0_255": [round(float(v), 5) for v in logits[:256]],
        "mean": r6(np.mean(logits)),
        "std": r6(np.std(logits)),
        "logsumexp": r6(logsumexp(logits)),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("gguf_path")
    ap.add_argument("--out-dir", default=os.path.dirname(os.path.abspath(__file__)))
    ap.add_argument("--skip-study", action="store_true", help="skip the f32 / q8-activation tolerance study")
    args = ap.parse_args()

    t_start = time.time()
    sha = sha256_of(args.gguf_path)
    reader = gguf.GGUFReader(args.gguf_path)
    cfg = read_config(reader)
    scalars, arrays = describe_metadata(reader)
    add_bos = bool(field_value(reader, "tokenizer.ggml.add_bos_token", False))
    add_eos = field_value(reader, "tokenizer.ggml.add_eos_token")
    bos_id = field_value(reader, "tokenizer.ggml.bos_token_id")
    eos_id = field_value(reader, "tokenizer.ggml.eos_token_id")
    print(f"config: {cfg}", file=sys.stderr)

    tok = RefTokenizer(reader)
    # end-of-generation tokens: the GGUF eos plus <|endoftext|> / <|im_end|> if present
    end_ids = sorted({int(eos_id)} | {i for i, t in enumerate(tok.tokens) if t in ("<|endoftext|>", "<|im_end|>")})

    packages = {p: pkg_version(p) for p in ("numpy", "gguf", "tokenizers", "regex")}
    packages["python"] = sys.version.split()[0]

    # ---------------- tokenizer golden ----------------
    def tok_case(name, text, special, note=None):
        ids = tok.encode(text, special)
        case = {
            "name": name,
            "text": text,
            "parse_special": special,
            "ids": ids,
            "tokens": [tok.tokens[i] for i in ids],
            "decoded_equals_text": tok.decode(ids) == text,
        }
        if note:
            case["note"] = note
        return case

    tok_golden = {
        "format_version": 1,
        "generator": SCRIPT_NAME,
        "model": {"file": os.path.basename(args.gguf_path), "sha256": sha},
        "tokenizer": {
            "gguf_model": field_value(reader, "tokenizer.ggml.model"),
            "gguf_pre": field_value(reader, "tokenizer.ggml.pre"),
            "reference": "HF tokenizers BPE; pre-tokenizer Sequence[Digits(individual_digits=True), "
            "ByteLevel(add_prefix_space=False, use_regex=True)]; no normalizer; control tokens "
            "(token_type 3) as special added tokens when parse_special is true; no BOS/EOS added; "
            "cross-checked against an in-script pure-Python BPE",
            "add_bos_token": add_bos,
            "add_eos_token": add_eos,
        },
        "packages": packages,
        "cases": [tok_case(n, t, s) for n, t, s in TOKENIZER_CASES],
        "edge_cases": [tok_case(n, t, s, note) for n, t, s, note in TOKENIZER_EDGE_CASES],
    }
    digits = tok.encode("12345", False)
    assert len(digits) == 5, f"digits are not split individually: {digits}"

    # ---------------- model golden ----------------
    t0 = time.time()
    weights, tensor_types, has_output = load_weights(reader, cfg)
    print(f"weights dequantized in {time.time() - t0:.1f}s", file=sys.stderr)

    prompts = []
    for p in PROMPTS:
        ids = tok.encode(p["text"], p["parse_special"])
        if add_bos:
            ids = [int(bos_id)] + ids
        prompts.append((p, ids))

    ref = Llama(cfg, weights, dtype=np.float64)
    cases = []
    ref_runs = {}
    for p, ids in prompts:
        t0 = time.time()
        ref_logits, gen, margins, top1 = ref.generate(ids, N_GENERATE)
        first = ref_logits[0]
        ref_runs[p["name"]] = (ref_logits, gen, margins)
        eos_at = next((i for i, t in enumerate(gen) if t in end_ids), None)
        text = tok.decode(gen)
        print(f"[{p['name']}] {time.time() - t0:.1f}s min margin {min(margins):.4f}: {text!r}", file=sys.stderr)
        cases.append(
            {
                "name": p["name"],
                "prompt": p["text"],
                "parse_special": p["parse_special"],
                "prompt_ids": ids,
                "generated_ids": gen,
                "generated_text": text,
                "first_end_token_index": eos_at,
                "margins": [r6(m) for m in margins],
                "top1_logits": [r6(v) for v in top1],
                "min_margin": r6(min(margins)),
                "first_step": first_step_summary(first),
            }
        )

    study = None
    if not args.skip_study:
        study = {
            "description": "The same prompts re-run with lower-precision variants of this forward pass. "
            "free_running_agree_prefix: how many of the 24 reference greedy tokens the variant reproduces "
            "when it decodes on its own. All other fields are teacher-forced (the variant is fed the "
            "reference tokens) and compare with the float64 reference at every one of the 24 steps: "
            "first_step_* only step 0; forced_* all steps. *_top20_* look at the reference's top-20 ids of "
            "that step; logprob = logit - logsumexp(logits). forced_argmax_mismatches lists "
            "[step, reference margin at that step] wherever the variant's argmax differs.",
            "variants": {},
        }
        variants = {
            "f32_activations": dict(dtype=np.float32),
            "f32_q8_activations": dict(dtype=np.float32, act_q8=True),
            "f32_q8_activations_f16_kv": dict(dtype=np.float32, act_q8=True, kv_f16=True),
        }
        for vname, kw in variants.items():
            model = Llama(cfg, weights, **kw)
            per_prompt = {}
            for p, ids in prompts:
                ref_logits, rgen, rmargins = ref_runs[p["name"]]
                _, free_gen, _, _ = model.generate(ids, N_GENERATE)
                agree = 0
                for a, b in zip(free_gen, rgen):
                    if a != b:
                        break
                    agree += 1
                var_logits, var_argmax, _, _ = model.generate(ids, N_GENERATE, forced=rgen)
                top20_diff, top20_lp_diff, max_diff, rms = [], [], [], []
                mismatches = []
                for step, (rl, vl) in enumerate(zip(ref_logits, var_logits)):
                    diff = np.abs(vl - rl)
                    rtop = np.argsort(-rl, kind="stable")[:TOP_K]
                    lp_diff = np.abs((vl[rtop] - logsumexp(vl)) - (rl[rtop] - logsumexp(rl)))
                    top20_diff.append(diff[rtop].max())
                    top20_lp_diff.append(lp_diff.max())
                    max_diff.append(diff.max())
                    rms.append(np.sqrt(np.mean(diff**2)))
                    if var_argmax[step] != rgen[step]:
                        mismatches.append([step, r6(rmargins[step])])
                rl0, vl0 = ref_logits[0], var_logits[0]
                rtop0 = np.argsort(-rl0, kind="stable")[:TOP_K]
                vtop0 = np.argsort(-vl0, kind="stable")[:TOP_K]
                per_prompt[p["name"]] = {
                    "free_running_agree_prefix": agree,
                    "first_step_max_abs_diff": r6(max_diff[0]),
                    "first_step_rms_diff": r6(rms[0]),
                    "first_step_top20_max_abs_diff": r6(top20_diff[0]),
                    "first_step_top20_logprob_max_abs_diff": r6(top20_lp_diff[0]),
                    "first_step_logsumexp_diff": r6(logsumexp(vl0) - logsumexp(rl0)),
                    "first_step_mean_diff": r6(np.mean(vl0) - np.mean(rl0)),
                    "first_step_std_diff": r6(np.std(vl0) - np.std(rl0)),
                    "first_step_ids_0_255_max_abs_diff": r6(np.abs(vl0[:256] - rl0[:256]).max()),
                    "first_step_top20_same_set": set(rtop0.tolist()) == set(vtop0.tolist()),
                    "first_step_top5_same_order": rtop0[:5].tolist() == vtop0[:5].tolist(),
                    "forced_max_abs_diff": r6(max(max_diff)),
                    "forced_top20_max_abs_diff": r6(max(top20_diff)),
                    "forced_top20_logprob_max_abs_diff": r6(max(top20_lp_diff)),
                    "forced_argmax_mismatches": mismatches,
                }
                print(f"  study {vname} {p['name']}: {per_prompt[p['name']]}", file=sys.stderr)
            study["variants"][vname] = per_prompt
            del model

    golden = {
        "format_version": 1,
        "generator": SCRIPT_NAME,
        "model": {
            "file": os.path.basename(args.gguf_path),
            "sha256": sha,
            "size_bytes": os.path.getsize(args.gguf_path),
            "tensor_types": dict(sorted(collections.Counter(tensor_types.values()).items())),
            "has_output_weight": has_output,
        },
        "config": cfg,
        "gguf_metadata": {"scalars": scalars, "array_lengths": arrays},
        "rope_style": "adjacent pairs (x[2i], x[2i+1]), theta_i = freq_base^(-2i/rope_dim), position p rotates by p*theta_i",
        "bos": {
            "add_bos_token": add_bos,
            "bos_token_id": bos_id,
            "prepended": add_bos,
            "note": "prompt_ids are exactly what is fed to the model (BOS is included only if add_bos_token is true)",
        },
        "end_token_ids": end_ids,
        "precision": "weights dequantized by gguf.quants.dequantize (float32, exact for Q4_1/Q8_0), "
        "all activations, attention and KV cache in float64; no activation quantization",
        "greedy": f"{N_GENERATE} tokens, argmax each step, generation does NOT stop at end tokens "
        "(first_end_token_index marks the first one, if any); margins[i] = top1 - top2 logit at step i",
        "n_generate": N_GENERATE,
        "packages": packages,
        "cases": cases,
        "tolerance_study": study,
    }

    os.makedirs(args.out_dir, exist_ok=True)
    gpath = os.path.join(args.out_dir, "smollm2-135m-instruct-q4_1.json")
    tpath = os.path.join(args.out_dir, "tokenizer-smollm2.json")
    with open(gpath, "w", encoding="utf-8") as f:
        write_json(f, golden)
    with open(tpath, "w", encoding="utf-8") as f:
        write_json(f, tok_golden)
    print(f"wrote {gpath} and {tpath} in {time.time() - t_start:.1f}s", file=sys.stderr)


def write_json(f, obj):
    """Indented JSON, but lists of numbers (and [id, logit] pairs) stay on one line."""

    def enc(o, indent):
        pad = "  " * indent
        if isinstance(o, dict):
            if not o:
                return "{}"
            items = [f"{pad}  {json.dumps(k)}: {enc(v, indent + 1)}" for k, v in o.items()]
            return "{\n" + ",\n".join(items) + "\n" + pad + "}"
        if isinstance(o, list):
            if all(not isinstance(x, (dict, list)) or (isinstance(x, list) and all(not isinstance(y, (dict, list)) for y in x)) for x in o):
                return json.dumps(o, ensure_ascii=False)
            items = [f"{pad}  {enc(v, indent + 1)}" for v in o]
            return "[\n" + ",\n".join(items) + "\n" + pad + "]"
        return json.dumps(o, ensure_ascii=False)

    f.write(enc(obj, 0) + "\n")


if __name__ == "__main__":
    main()
