"""The official Ollama Python client's `pull` against inferd, unchanged but for its transport: the
daemon fetches from the hub named by its HF_ENDPOINT (tests/python/hf_server.py). The first
transfer of each file is cut by that server. Prints what it saw as JSON for the Rust test.

    python3 tests/python/ollama_pull.py SOCKET
"""
import json
import sys

import ollama

from clients import ollama_client

client = ollama_client(sys.argv[1])
out = {}


def streamed(name):
    """The progress lines of a streamed pull, and its error if it failed."""
    parts, error = [], None
    try:
        for p in client.pull(name, stream=True):
            parts.append({"status": p.status, "digest": p.digest, "total": p.total, "completed": p.completed})
    except ollama.ResponseError as e:
        error = {"status": e.status_code, "error": e.error}
    return {"parts": parts, "error": error}


out["cut"] = streamed("hf.co/org/smol-GGUF:Q4_1")
out["resumed"] = streamed("hf.co/org/smol-GGUF:Q4_1")
out["tags"] = [m.model for m in client.list().models]
g = client.generate(model="smol-Q4_1", prompt="The capital of France is", raw=True,
                    options={"temperature": 0, "num_predict": 3})
out["generate"] = g.response
# Not streamed: one object. Already there: nothing is fetched.
out["again"] = client.pull("hf:org/smol-GGUF", stream=False).status

refused = {}
for name in ["llama3.2", "hf.co/org/none", "hf.co/org/smol-GGUF:Q8_0", "hf.co/org/bad-GGUF"]:
    try:
        client.pull(name)
        refused[name] = None
    except ollama.ResponseError as e:
        refused[name] = {"status": e.status_code, "error": e.error}
out["refused"] = refused
print(json.dumps(out))
