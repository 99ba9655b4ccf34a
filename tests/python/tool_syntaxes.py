"""Tool calls through the official OpenAI client from a daemon whose model has a chat template
in the Llama 3.1 or the Mistral convention (tests/templates/, set with `chat_template`): a
required call, whole and streamed, and the call with its result sent back. Prints what it
found as JSON for daemon/tests/daemon/clients.rs to check.

    python3 tests/python/tool_syntaxes.py SOCKET
"""
import json
import sys

from clients import openai_client

client = openai_client(sys.argv[1])
model = client.models.list().data[0].id
weather = {"type": "function", "function": {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                   "required": ["city"], "additionalProperties": False},
}}
ask = [{"role": "user", "content": "What is the weather like in Paris today?"}]
out = {}
r = client.chat.completions.create(model=model, messages=ask, tools=[weather], tool_choice="required",
                                   parallel_tool_calls=False, temperature=0, max_tokens=120)
m = r.choices[0].message
out["whole"] = {"finish": r.choices[0].finish_reason, "content": m.content, "prompt_tokens": r.usage.prompt_tokens,
                "calls": [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in m.tool_calls or []]}
calls, finish = {}, None
for chunk in client.chat.completions.create(model=model, messages=ask, tools=[weather], tool_choice="required",
                                            parallel_tool_calls=False, temperature=0, max_tokens=120, stream=True):
    if not chunk.choices:
        continue
    ch = chunk.choices[0]
    for d in ch.delta.tool_calls or []:
        c = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
        c["id"] = d.id or c["id"]
        c["name"] += (d.function.name or "") if d.function else ""
        c["arguments"] += (d.function.arguments or "") if d.function else ""
    finish = ch.finish_reason or finish
out["stream"] = {"finish": finish, "calls": [calls[i] for i in sorted(calls)]}
if m.tool_calls:
    history = ask + [m.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "18 degrees and sunny"}]
    r = client.chat.completions.create(model=model, messages=history, tools=[weather], tool_choice="none",
                                       temperature=0, max_tokens=30)
    out["answer"] = {"finish": r.choices[0].finish_reason, "content": r.choices[0].message.content,
                     "prompt_tokens": r.usage.prompt_tokens}
print(json.dumps(out))
