"""Fill-in-the-middle through the official OpenAI and Ollama clients, unchanged but for their
transport: `suffix` on Ollama's generate and OpenAI's completions, the same gap written as a raw
prompt in the model's special tokens (Ollama `raw`, a completion's text prompt), the prompt as
token ids, and what `show` reports. Prints what it got as JSON for the Rust test to compare.

    python3 tests/python/fim.py SOCKET MODEL PREFIX SUFFIX
"""
import json
import sys

import httpx

from clients import ollama_client, openai_client

socket, model, prefix, suffix = sys.argv[1:5]
oa, ol = openai_client(socket), ollama_client(socket)
greedy = {"temperature": 0, "num_predict": 40}
special = f"<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>"
out = {"capabilities": ol.show(model).capabilities}
g = ol.generate(model=model, prompt=prefix, suffix=suffix, options=greedy)
out["ollama_suffix"] = g.response
out["ollama_context"] = g.context[: len(g.context) - g.eval_count]
out["ollama_raw"] = ol.generate(model=model, prompt=special, raw=True, options=greedy).response
c = oa.completions.create(model=model, prompt=prefix, suffix=suffix, max_tokens=40, temperature=0)
out["openai_suffix"] = c.choices[0].text
out["openai_suffix_prompt_tokens"] = c.usage.prompt_tokens
c = oa.completions.create(model=model, prompt=special, max_tokens=40, temperature=0)
out["openai_special"] = c.choices[0].text
with httpx.Client(transport=httpx.HTTPTransport(uds=socket)) as h:
    ids = h.post("http://inferd/tokenize", json={"content": special}).json()["tokens"]
out["tokenized"] = ids
c = oa.completions.create(model=model, prompt=ids, max_tokens=40, temperature=0)
out["openai_ids"] = c.choices[0].text
print(json.dumps(out))
