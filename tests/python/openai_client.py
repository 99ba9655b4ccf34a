"""The official OpenAI Python client against inferd, unchanged: only its HTTP transport is pointed
at the daemon's Unix socket. Prints what it got as JSON for the Rust test to check.

    python3 tests/python/openai_client.py SOCKET
"""
import json
import sys

import openai

try:  # the client's HTTP library: httpx2 in newer releases, httpx before
    import httpx2 as httpx
except ImportError:
    import httpx

socket = sys.argv[1]
client = openai.OpenAI(
    base_url="http://inferd/v1",
    api_key="not-needed",
    http_client=httpx.Client(transport=httpx.HTTPTransport(uds=socket)),
)
out = {}
out["models"] = [m.id for m in client.models.list().data]
model = out["models"][0]
c = client.completions.create(model=model, prompt="The capital of France is", max_tokens=3, temperature=0)
out["completion"] = c.choices[0].text
out["completion_stream"] = "".join(
    chunk.choices[0].text
    for chunk in client.completions.create(model=model, prompt="The capital of France is", max_tokens=3, temperature=0, stream=True)
    if chunk.choices
)
messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
chat = client.chat.completions.create(model=model, messages=messages, max_tokens=40, temperature=0)
out["chat"] = chat.choices[0].message.content
out["chat_stream"] = "".join(
    chunk.choices[0].delta.content or ""
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=40, temperature=0, stream=True)
    if chunk.choices
)
try:
    client.completions.create(model=model, prompt="hi", temperature=7)
    out["bad_status"] = None
except openai.BadRequestError as e:
    out["bad_status"] = e.status_code
print(json.dumps(out))
