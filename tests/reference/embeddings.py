"""Text embeddings by llama.cpp itself, for tests/e2e/embed.rs: mean pooling of the final hidden
states (llama.cpp's LLAMA_POOLING_TYPE_MEAN), L2-normalized, as llama-embedding --pooling mean
gives them. The library comes from the llama-cpp-cffi wheel on PyPI (a CPU build of llama.cpp;
tests/run installs it), loaded as requantize.py loads it.

    python3 embeddings.py MODEL_GGUF TOKENS_JSON OUT_JSON
    python3 embeddings.py MODEL_GGUF TEXTS_JSON OUT_JSON --pooling=mean|cls|last

TOKENS_JSON is a list of token-id lists (the same ids inferd embeds, so tokenizers cannot
differ); OUT_JSON gets one vector per list. With --pooling, TEXTS_JSON is a list of texts that
llama.cpp tokenizes itself (with the vocabulary's BOS and EOS), pooled that way (named here: the
wheel's llama.cpp reads pooling_type from BERT-family files only); OUT_JSON gets
{"tokens": [...], "embeddings": [...]}."""
import json
import math
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
from requantize import quantizer  # noqa: E402  (the wheel's library, with its shim)

POOLING = {"mean": 1, "cls": 2, "last": 3}


def tokenize(lib, ffi, model, text):
    vocab = lib.llama_model_get_vocab(model)
    raw = text.encode()
    buf = ffi.new("llama_token[]", len(raw) + 8)
    n = lib.llama_tokenize(vocab, raw, len(raw), buf, len(raw) + 8, True, False)
    if n < 0:
        sys.exit(f"embeddings.py: llama_tokenize returned {n}")
    return [buf[i] for i in range(n)]


def main():
    model_path, tokens_path, out_path = sys.argv[1:4]
    named = [a.split("=", 1)[1] for a in sys.argv[4:] if a.startswith("--pooling=")]
    inputs = json.load(open(tokens_path))
    lib, ffi = quantizer(tempfile.mkdtemp())
    lib.llama_backend_init()
    mp = lib.llama_model_default_params()
    model = lib.llama_model_load_from_file(model_path.encode(), mp)
    if model == ffi.NULL:
        sys.exit(f"embeddings.py: llama.cpp cannot load {model_path}")
    n_embd = lib.llama_model_n_embd(model)
    if named:
        inputs = [tokenize(lib, ffi, model, t) for t in inputs]
    out = []
    for toks in inputs:
        cp = lib.llama_context_default_params()
        cp.embeddings = True
        cp.pooling_type = POOLING[named[0] if named else "mean"]
        cp.n_ctx = max(64, len(toks))
        cp.n_batch = cp.n_ubatch = max(64, len(toks))
        cp.n_threads = cp.n_threads_batch = 2
        ctx = lib.llama_init_from_model(model, cp)
        batch = lib.llama_batch_init(len(toks), 0, 1)
        for i, t in enumerate(toks):
            batch.token[i] = t
            batch.pos[i] = i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = 1
        batch.n_tokens = len(toks)
        rc = lib.llama_decode(ctx, batch)
        if rc != 0:
            sys.exit(f"embeddings.py: llama_decode returned {rc}")
        e = lib.llama_get_embeddings_seq(ctx, 0)
        v = [e[i] for i in range(n_embd)]
        norm = math.sqrt(sum(x * x for x in v)) or 1.0
        out.append([x / norm for x in v])
        lib.llama_batch_free(batch)
        lib.llama_free(ctx)
    lib.llama_model_free(model)
    json.dump({"tokens": inputs, "embeddings": out} if named else out, open(out_path, "w"))


main()
