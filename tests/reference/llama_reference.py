"""Reference data from llama.cpp (its Python bindings over the shared library that
tests/bench/build-llama-cpp builds), for tests/e2e/reference.rs. Run by tests/reference/regen.

    python3 llama_reference.py OUT.json TINY_DIR GEMMA3_GGUF REQUANTIZED_DIR

For every model: the sha256 of the file, and per case the prompt's tokens, the top logits at a
few positions, and a greedy continuation with the margin between llama.cpp's top two logits at
each step (the comparison stops at a near-tie); for the long-context variants the context
llama.cpp ran with. For the Gemma 3 file and the pre-tokenizer files, tokenizations.
REQUANTIZED_DIR holds the default model requantized by requantize.py (Q4_K_M, Q5_K_M, Q6_K)."""
import hashlib
import json
import os
import sys

import numpy as np
from llama_cpp import Llama

TOP = 16


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def run(llm, tokens, positions, steps):
    llm.reset()
    llm.eval(tokens)
    scores = np.array(llm.scores[: len(tokens)])
    logits = []
    for p in positions:
        row = scores[p]
        top = np.argsort(-row, kind="stable")[:TOP]
        logits.append({"pos": p, "ids": [int(i) for i in top], "values": [float(row[i]) for i in top]})
    greedy, margins = [], []
    row = scores[-1]
    for _ in range(steps):
        top = np.argsort(-row, kind="stable")[:2]
        greedy.append(int(top[0]))
        margins.append(float(row[top[0]] - row[top[1]]))
        llm.eval([int(top[0])])
        row = np.array(llm.scores[llm.n_tokens - 1])
    return {"tokens": tokens, "logits": logits, "greedy": greedy, "margins": margins}


def positions(n):
    return sorted(set(list(range(0, n, max(1, n // 6))) + [n - 1]))


# Long enough to pass Gemma 3's 512-token window.
LONG = " ".join(
    f"Paragraph {i}: the river keeps its own counsel, and the mill counts {i * 7} turns before the bell."
    for i in range(40)
)
GEMMA_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    LONG + " What does the mill count before the bell?",
]
TOKENIZE = [
    "Hello world",
    " leading space and  double  spaces",
    "Tabs\tand\nnewlines\n\n  indented",
    "Numbers 1234567 and 3.14159, dates 2026-11-30.",
    "Ünïcödé: 日本語のテキスト, emoji 🎉🚀, Ελληνικά",
    "<start_of_turn>user\nnot parsed as special<end_of_turn>",
    "",
]


def text_cases(llm, prompts):
    cases = []
    for prompt in prompts:
        tokens = llm.tokenize(prompt.encode(), add_bos=True, special=False)
        case = run(llm, tokens, positions(len(tokens)), 24)
        case["prompt"] = prompt
        cases.append(case)
    return cases


def main():
    out, tiny_dir, gemma, requantized = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
    models = []
    for arch in ["llama", "qwen2", "qwen3", "gemma3", "phi3", "qwen35", "qwen35moe", "qwen3next", "qwen35-f32",
                 "qwen35moe-f32", "qwen3next-f32", "gemma4", "gemma4-f32", "gemma4-moe", "gemma4-moe-f32"]:
        path = f"{tiny_dir}/tiny-{arch}.gguf"
        llm = Llama(path, n_ctx=256, logits_all=True, verbose=False, n_threads=2, seed=0)
        rng = np.random.default_rng(100)
        cases = []
        for n in (5, 40):
            tokens = [0] + [int(x) for x in rng.integers(3, 259, n - 1)]
            cases.append(run(llm, tokens, positions(n), 12))
        models.append({"name": f"tiny-{arch}", "file": f"tiny-{arch}.gguf", "sha256": sha256(path), "cases": cases})
        del llm
    # The long-context variants: LongRoPE's long factors (a context past the trained 256) and
    # its short ones (a context of 256), YaRN's scaling at any context.
    for name, n_ctx, suffix, lengths in [
        ("tiny-phi3-longrope", 512, "", (5, 40, 150)),
        ("tiny-phi3-longrope", 256, "-short", (5, 40)),
        ("tiny-qwen2-yarn", 512, "", (5, 40, 150)),
    ]:
        path = f"{tiny_dir}/{name}.gguf"
        llm = Llama(path, n_ctx=n_ctx, logits_all=True, verbose=False, n_threads=2, seed=0)
        rng = np.random.default_rng(101)
        cases = []
        for n in lengths:
            tokens = [0] + [int(x) for x in rng.integers(3, 259, n - 1)]
            cases.append(run(llm, tokens, positions(n), 12))
        models.append({"name": name + suffix, "file": f"{name}.gguf", "sha256": sha256(path), "context": n_ctx, "cases": cases})
        del llm
    # Every GGUF pre-tokenizer inferd knows, on texts whose splits differ between them.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from tiny_models import GEMMA4_TEXTS, PRE_TEXTS, PRE_TYPES

    for pre in PRE_TYPES:
        path = f"{tiny_dir}/tiny-pre-{pre}.gguf"
        llm = Llama(path, vocab_only=True, verbose=False)
        tokenizations = [{"text": t, "tokens": llm.tokenize(t.encode(), add_bos=True, special=False)} for t in PRE_TEXTS]
        models.append({"name": f"tiny-pre-{pre}", "file": f"tiny-pre-{pre}.gguf", "sha256": sha256(path), "cases": [],
                       "tokenizations": tokenizations})
        del llm
    # Gemma 4's own kind of vocabulary (`tokenizer.ggml.model = gemma4`).
    path = f"{tiny_dir}/tiny-gemma4-vocab.gguf"
    llm = Llama(path, vocab_only=True, verbose=False)
    tokenizations = [
        {"text": t, "tokens": llm.tokenize(t.encode(), add_bos=True, special=False)} for t in PRE_TEXTS + GEMMA4_TEXTS
    ]
    models.append({"name": "tiny-gemma4-vocab", "file": "tiny-gemma4-vocab.gguf", "sha256": sha256(path), "cases": [],
                   "tokenizations": tokenizations})
    del llm
    llm = Llama(gemma, n_ctx=2048, logits_all=True, verbose=False, n_threads=2, seed=0)
    cases = text_cases(llm, GEMMA_PROMPTS)
    tokenizations = [
        {"text": t, "tokens": llm.tokenize(t.encode(), add_bos=True, special=False)} for t in TOKENIZE
    ]
    models.append(
        {
            "name": "gemma-3-270m-Q4_K_M",
            "file": "gemma-3-270m-Q4_K_M.gguf",
            "sha256": sha256(gemma),
            "cases": cases,
            "tokenizations": tokenizations,
        }
    )
    del llm
    for t in ["Q4_K_M", "Q5_K_M", "Q6_K"]:
        path = os.path.join(requantized, f"SmolLM2-135M-Instruct.{t}.gguf")
        llm = Llama(path, n_ctx=2048, logits_all=True, verbose=False, n_threads=2, seed=0)
        models.append(
            {
                "name": f"SmolLM2-135M-Instruct.{t}",
                "file": os.path.basename(path),
                "sha256": sha256(path),
                "cases": text_cases(llm, GEMMA_PROMPTS),
            }
        )
        del llm
    with open(out, "w") as f:
        json.dump({"generator": "llama.cpp via llama-cpp-python " + __import__("llama_cpp").__version__, "models": models}, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
