"""Embeddings through the official clients, unchanged but for their transport: the OpenAI
client's default (base64, decoded by the client) and floats, several inputs and token ids;
Ollama's embed; refusals. Prints what it got as JSON for daemon/tests/daemon/clients.rs.

    python3 tests/python/embeddings.py SOCKET
"""
import json
import sys

import openai

from clients import ollama_client, openai_client

socket = sys.argv[1]
client = openai_client(socket)
model = client.models.list().data[0].id
texts = ["The cat sat on the mat.", "A cat was sitting on the mat.", "Stock markets fell sharply today."]
out = {}
r = client.embeddings.create(model=model, input=texts)  # the client asks for base64 and decodes it
out["default"] = [list(map(float, d.embedding)) for d in r.data]
out["usage"] = r.usage.prompt_tokens
r = client.embeddings.create(model=model, input=texts[0], encoding_format="float")
out["float"] = list(r.data[0].embedding)
out["object"] = [r.object, r.data[0].object, r.data[0].index]
# Token ids instead of text: "Hello 12 world" in the default model's vocabulary.
out["hello_text"] = list(client.embeddings.create(model=model, input="Hello 12 world", encoding_format="float").data[0].embedding)
out["hello_ids"] = list(client.embeddings.create(model=model, input=[19556, 216, 33, 34, 905], encoding_format="float").data[0].embedding)
refused = {}
for name, kwargs in {
    "dimensions": {"input": "hi", "dimensions": 8},
    "empty": {"input": []},
    "format": {"input": "hi", "encoding_format": "int8"},
}.items():
    try:
        client.embeddings.create(model=model, **kwargs)
        refused[name] = None
    except openai.BadRequestError as e:
        refused[name] = [e.status_code, (e.body or {}).get("message")]
out["refused"] = refused
oc = ollama_client(socket)
r = oc.embed(model=oc.list().models[0].model, input=texts)
out["ollama"] = [list(v) for v in r.embeddings]
out["ollama_count"] = r.prompt_eval_count
# The legacy route older clients and LangChain's Ollama embeddings call: one prompt, one vector.
out["ollama_legacy"] = list(oc.embeddings(model=oc.list().models[0].model, prompt=texts[0])["embedding"])
print(json.dumps(out))
