"""Anthropic's Messages API through the official `anthropic` client, unchanged but for its
transport: a message whole and streamed (text and event sequence), stop sequences, max_tokens,
a prefill, tools (a forced call whole and streamed, its result sent back), count_tokens, and
errors. The same question asked through the OpenAI client gives the reference answer. Prints
what it found as JSON for daemon/tests/daemon/clients.rs to check.

    python3 tests/python/anthropic_client.py SOCKET
"""
import json
import sys

import anthropic
import jsonschema

from clients import anthropic_client, openai_client

socket = sys.argv[1]
client = anthropic_client(socket)
oa = openai_client(socket)
model = oa.models.list().data[0].id
system = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
ask = [{"role": "user", "content": "What is the capital of France?"}]
out = {}
# This SDK has no sampling arguments of its own (Anthropic's newest models fix them); the API
# still takes them, as extra body fields.
t0 = {"temperature": 0}


def text_of(m):
    return "".join(b.text for b in m.content if b.type == "text")


# Whole, and the same chat through the OpenAI client.
m = client.messages.create(model=model, max_tokens=24, system=system, messages=ask, extra_body=t0)
ref = oa.chat.completions.create(model=model, messages=[{"role": "system", "content": system}] + ask, max_tokens=24, extra_body=t0)
out["whole"] = {
    "id": m.id, "type": m.type, "role": m.role, "model": m.model, "text": text_of(m),
    "blocks": [b.type for b in m.content], "stop_reason": m.stop_reason,
    "input_tokens": m.usage.input_tokens, "output_tokens": m.usage.output_tokens,
}
out["openai"] = {
    "text": ref.choices[0].message.content, "finish": ref.choices[0].finish_reason,
    "prompt_tokens": ref.usage.prompt_tokens, "completion_tokens": ref.usage.completion_tokens,
}

# Streamed: the SDK's own accumulation, and the events it saw.
events = []
with client.messages.stream(model=model, max_tokens=24, system=system, messages=ask, extra_body=t0) as s:
    for ev in s:
        events.append(ev.type)
    final = s.get_final_message()
out["stream"] = {"text": text_of(final), "stop_reason": final.stop_reason, "events": events,
                 "input_tokens": final.usage.input_tokens, "output_tokens": final.usage.output_tokens}

# A stop sequence taken from the answer itself: the answer ends before it.
words = out["whole"]["text"].split()
stop = words[len(words) // 2] if words else "Paris"
m = client.messages.create(model=model, max_tokens=24, system=system, messages=ask, stop_sequences=[stop], extra_body=t0)
out["stop_sequence"] = {"stop": stop, "text": text_of(m), "stop_reason": m.stop_reason, "stop_sequence": m.stop_sequence}

m = client.messages.create(model=model, max_tokens=3, messages=ask, extra_body=t0)
out["max_tokens"] = {"stop_reason": m.stop_reason, "output_tokens": m.usage.output_tokens}

# A prefill: the answer goes on from the assistant's own start.
pre = ask + [{"role": "assistant", "content": "The capital of France is"}]
m = client.messages.create(model=model, max_tokens=8, messages=pre, extra_body=t0)
out["prefill"] = {"text": text_of(m), "input_tokens": m.usage.input_tokens,
                  "counted": client.messages.count_tokens(model=model, messages=pre).input_tokens,
                  "counted_without": client.messages.count_tokens(model=model, messages=ask).input_tokens}

# count_tokens is the prompt the message is answered from.
out["count_tokens"] = client.messages.count_tokens(model=model, system=system, messages=ask).input_tokens

# Structured output: output_config.format's schema shapes the answer.
point = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
         "required": ["city", "country"], "additionalProperties": False}
m = client.messages.create(model=model, max_tokens=60, messages=ask, extra_body=t0,
                           output_config={"format": {"type": "json_schema", "schema": point}})
try:
    jsonschema.validate(json.loads(text_of(m)), point)
    out["structured"] = {"stop_reason": m.stop_reason, "error": None}
except (ValueError, jsonschema.ValidationError) as e:
    out["structured"] = {"stop_reason": m.stop_reason, "error": str(e), "text": text_of(m)}

# Tools: a forced call, whole and streamed; its result sent back.
weather = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "description": "The city, e.g. Paris"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
wq = [{"role": "user", "content": "What is the weather like in Paris today?"}]
m = client.messages.create(model=model, max_tokens=100, messages=wq, tools=[weather], tool_choice={"type": "any"}, extra_body=t0)
uses = [b for b in m.content if b.type == "tool_use"]


def valid(inp):
    try:
        jsonschema.validate(inp, weather["input_schema"])
        return None
    except jsonschema.ValidationError as e:
        return e.message


out["tool"] = {"stop_reason": m.stop_reason, "blocks": [b.type for b in m.content],
               "uses": [{"id": u.id, "name": u.name, "input": u.input, "error": valid(u.input)} for u in uses],
               "input_tokens": m.usage.input_tokens,
               "counted": client.messages.count_tokens(model=model, messages=wq, tools=[weather], tool_choice={"type": "any"}).input_tokens}
with client.messages.stream(model=model, max_tokens=100, messages=wq, tools=[weather], tool_choice={"type": "any"}, extra_body=t0) as s:
    events = [ev.type for ev in s]
    final = s.get_final_message()
out["tool_stream"] = {"stop_reason": final.stop_reason, "events": events,
                      "uses": [{"name": b.name, "input": b.input} for b in final.content if b.type == "tool_use"]}
if uses:
    def answer(result):
        history = wq + [
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": result}]},
        ]
        return client.messages.create(model=model, max_tokens=40, messages=history, tools=[weather], tool_choice={"type": "none"}, extra_body=t0)
    r = answer(json.dumps({"city": "Paris", "weather": "sunny", "temperature": 18}))
    e = answer("")
    out["round_trip"] = {"stop_reason": r.stop_reason, "text": text_of(r), "blocks": [b.type for b in r.content],
                         "input_tokens": r.usage.input_tokens, "input_tokens_empty_result": e.usage.input_tokens}

# Errors in Anthropic's shape, as the SDK raises them.
errors = {}
for name, kwargs in {
    "unknown_model": {"model": "no-such-model", "max_tokens": 4, "messages": ask},
    "image": {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]},
    "server_tool": {"model": model, "max_tokens": 4, "messages": ask,
                    "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
}.items():
    try:
        client.messages.create(**kwargs)
        errors[name] = None
    except anthropic.APIStatusError as e:
        errors[name] = {"status": e.status_code, "type": (e.body or {}).get("error", {}).get("type"),
                        "message": (e.body or {}).get("error", {}).get("message")}
out["errors"] = errors
print(json.dumps(out))
