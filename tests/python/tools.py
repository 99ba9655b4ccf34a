"""Tool calling through the official clients, unchanged but for their transport: a required
and a named call (whole and streamed), the call's result sent back for the answer, refusals;
the Ollama client's tools and a conversation with a call in it. Prints what it found as JSON
for daemon/tests/daemon/clients.rs to check.

    python3 tests/python/tools.py SOCKET
"""
import json
import sys

import jsonschema
import openai

from clients import ollama_client, openai_client

socket = sys.argv[1]
client = openai_client(socket)
model = client.models.list().data[0].id
weather = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
clock = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False},
    },
}
ask = [{"role": "user", "content": "What is the weather like in Paris today?"}]
out = {}


def call_of(c):
    args = json.loads(c.function.arguments)
    schema = weather["function"]["parameters"] if c.function.name == "get_weather" else clock["function"]["parameters"]
    try:
        jsonschema.validate(args, schema)
        error = None
    except jsonschema.ValidationError as e:
        error = e.message
    return {"id": c.id, "type": c.type, "name": c.function.name, "arguments": args, "error": error}


for name, choice in [("required", "required"), ("named", {"type": "function", "function": {"name": "get_time"}})]:
    r = client.chat.completions.create(model=model, messages=ask, tools=[weather, clock], tool_choice=choice, temperature=0, max_tokens=100)
    m = r.choices[0].message
    out[name] = {"finish": r.choices[0].finish_reason, "content": m.content, "calls": [call_of(c) for c in m.tool_calls or []]}

# Streamed: the deltas the client accumulates give the same call.
calls, finish = {}, None
for chunk in client.chat.completions.create(model=model, messages=ask, tools=[weather, clock], tool_choice="required", temperature=0, max_tokens=100, stream=True):
    if not chunk.choices:
        continue
    d = chunk.choices[0].delta
    for tc in d.tool_calls or []:
        c = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
        c["id"] = tc.id or c["id"]
        c["name"] += tc.function.name or ""
        c["arguments"] += tc.function.arguments or ""
    finish = chunk.choices[0].finish_reason or finish
out["stream"] = {"finish": finish, "calls": [{"name": c["name"], "arguments": json.loads(c["arguments"])} for c in calls.values()]}

# The round trip: the call and its result go back; the model answers from the result.
first = client.chat.completions.create(model=model, messages=ask, tools=[weather], tool_choice="required", temperature=0, max_tokens=100)
call = first.choices[0].message.tool_calls[0]
history = ask + [
    {"role": "assistant", "content": None, "tool_calls": [{"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
    {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"city": "Paris", "weather": "sunny", "temperature": 18})},
]
r = client.chat.completions.create(model=model, messages=history, tools=[weather], tool_choice="none", temperature=0, max_tokens=60)
empty = history[:-1] + [dict(history[-1], content="")]
e = client.chat.completions.create(model=model, messages=empty, tools=[weather], tool_choice="none", temperature=0, max_tokens=1)
out["round_trip"] = {
    "finish": r.choices[0].finish_reason,
    "content": r.choices[0].message.content,
    "calls": len(r.choices[0].message.tool_calls or []),
    "prompt_tokens": r.usage.prompt_tokens,
    "prompt_tokens_empty_result": e.usage.prompt_tokens,
}
# Auto: the model decides; whatever it does comes back as text or as calls that parse.
r = client.chat.completions.create(model=model, messages=ask, tools=[weather], temperature=0, max_tokens=100)
m = r.choices[0].message
out["auto"] = {"finish": r.choices[0].finish_reason, "content": m.content, "calls": [call_of(c) for c in m.tool_calls or []]}

refused = {}
for name, kwargs in {
    "unknown_tool": {"tools": [weather], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
    "no_tools": {"tool_choice": "required"},
    "bad_tool": {"tools": [{"type": "function", "function": {"name": "has space"}}]},
    "with_response_format": {"tools": [weather], "tool_choice": "required", "response_format": {"type": "json_object"}},
}.items():
    try:
        client.chat.completions.create(model=model, messages=ask, max_tokens=4, **kwargs)
        refused[name] = None
    except openai.BadRequestError as e:
        refused[name] = [e.status_code, (e.body or {}).get("message")]
out["refused"] = refused

# Ollama: tools offered, and a conversation that holds a call and its result.
oc = ollama_client(socket)
name = oc.list().models[0].model
r = oc.chat(model=name, messages=ask, tools=[weather], options={"temperature": 0, "num_predict": 100})
out["ollama_auto"] = {"done_reason": r.done_reason, "content": r.message.content, "calls": [{"name": c.function.name, "arguments": dict(c.function.arguments)} for c in r.message.tool_calls or []]}
convo = ask + [
    {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]},
    {"role": "tool", "content": "sunny, 18 degrees", "tool_name": "get_weather"},
]
r = oc.chat(model=name, messages=convo, tools=[weather], options={"temperature": 0, "num_predict": 60})
out["ollama_round_trip"] = {"done_reason": r.done_reason, "content": r.message.content}
print(json.dumps(out))
