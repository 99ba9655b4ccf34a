"""The official Ollama Python client against inferd, unchanged: only its HTTP transport is pointed
at the daemon's Unix socket. Prints what it got as JSON for the Rust test to check.

    python3 tests/python/ollama_client.py SOCKET
"""
import json
import sys

import ollama

from clients import ollama_client

client = ollama_client(sys.argv[1])
out = {}
tags = client.list()
out["tags"] = [m.model for m in tags.models]
out["details"] = tags.models[0].details.model_dump()
model = tags.models[0].model
out["version"] = client._client.get("/api/version").json()["version"]
show = client.show(model)
out["show"] = {"capabilities": show.capabilities, "family": show.details.family, "has_template": bool(show.template),
               "context_length": show.modelinfo.get(f"{show.details.family}.context_length")}
out["ps"] = [m.model for m in client.ps().models]

question = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
r = client.chat(model=model, messages=question, options={"temperature": 0, "num_predict": 40}, stream=False)
out["chat"] = {"content": r.message.content, "role": r.message.role, "done": r.done, "done_reason": r.done_reason,
               "eval_count": r.eval_count, "prompt_eval_count": r.prompt_eval_count}
parts = list(client.chat(model=model, messages=question, options={"temperature": 0, "num_predict": 40}, stream=True))
out["chat_stream"] = {"content": "".join(p.message.content or "" for p in parts), "chunks": len(parts),
                      "last_done": parts[-1].done, "others_done": any(p.done for p in parts[:-1])}

g = client.generate(model=model, prompt="The capital of France is", raw=True, options={"temperature": 0, "num_predict": 3})
out["generate_raw"] = {"response": g.response, "done_reason": g.done_reason, "eval_count": g.eval_count,
                       "prompt_eval_count": g.prompt_eval_count, "context": len(g.context or [])}
# `context` continues where the answer stopped.
g2 = client.generate(model=model, prompt="", raw=True, context=g.context, options={"temperature": 0, "num_predict": 3})
out["generate_context"] = {"response": g2.response, "done_reason": g2.done_reason}
# The prompt through the chat template, streamed (the server streams unless told not to; the
# client asks for one object unless told to stream).
out["generate_stream"] = "".join(p.response for p in client.generate(model=model, prompt="What is the capital of France? Answer in one word.",
                                                                  options={"temperature": 0, "num_predict": 40}, stream=True))
# An empty prompt loads the model.
out["load"] = client.generate(model=model, prompt="").done_reason
# The model's name with its tag or without.
out["untagged"] = client.chat(model=model.removesuffix(":latest"), messages=question,
                              options={"temperature": 0, "num_predict": 40}).message.content

refused = {}
for name, kwargs in {
    "format": {"format": {"type": "integer", "minimum": 5, "maximum": 1}},
    "images": {"messages": [{"role": "user", "content": "What is this?", "images": ["aGk="]}]},
    "mirostat": {"options": {"mirostat": 2}},
    "unknown_model": {"model": "llama9:70b"},
}.items():
    args = {"model": model, "messages": question, "options": {"num_predict": 2}}
    args.update(kwargs)
    try:
        client.chat(**args)
        refused[name] = None
    except ollama.ResponseError as e:
        refused[name] = [e.status_code, e.error]
out["refused"] = refused
print(json.dumps(out))
