"""OpenAI's Responses API through the official `openai` client, unchanged but for its
transport: a response whole and streamed (the SDK's own accumulation of the events),
`instructions`, `max_output_tokens`, `text.format` with a JSON schema, function tools (a
forced call whole and streamed, its output sent back through `previous_response_id`), a
conversation continued by `previous_response_id`, stored responses retrieved and deleted,
`store: false`, and refusals. The same conversations asked through the chat route give the
reference answers. Prints what it found as JSON for daemon/tests/daemon/clients.rs to check.

    python3 tests/python/responses_client.py SOCKET
"""
import json
import sys

import jsonschema
import openai

from clients import openai_client

socket = sys.argv[1]
client = openai_client(socket)
model = client.models.list().data[0].id
question = "What is the capital of France?"
out = {}


def chat(messages, **kw):
    r = client.chat.completions.create(model=model, messages=messages, temperature=0, **kw)
    return {"text": r.choices[0].message.content, "finish": r.choices[0].finish_reason,
            "prompt_tokens": r.usage.prompt_tokens, "completion_tokens": r.usage.completion_tokens}


def summary(r):
    return {"id": r.id, "object": r.object, "status": r.status, "text": r.output_text, "model": r.model,
            "items": [i.type for i in r.output], "input_tokens": r.usage.input_tokens,
            "output_tokens": r.usage.output_tokens,
            "incomplete": r.incomplete_details.reason if r.incomplete_details else None}


# Whole, with instructions, and the chat route's answer to the same conversation.
r = client.responses.create(model=model, instructions="You are a helpful AI assistant named SmolLM, trained by Hugging Face",
                            input=question, max_output_tokens=24, temperature=0)
out["whole"] = summary(r)
out["chat"] = chat([{"role": "system", "content": "You are a helpful AI assistant named SmolLM, trained by Hugging Face"},
                    {"role": "user", "content": question}], max_tokens=24)

# Streamed: the SDK accumulates the events into the same response.
events = []
with client.responses.stream(model=model, instructions="You are a helpful AI assistant named SmolLM, trained by Hugging Face",
                             input=question, max_output_tokens=24, temperature=0) as s:
    for ev in s:
        events.append(ev.type)
        # The SDK's get_final_response() wants response.completed; an answer cut by
        # max_output_tokens ends with response.incomplete, which carries the response too.
        if ev.type in ("response.completed", "response.incomplete"):
            final = ev.response
out["stream"] = dict(summary(final), events=events)

r = client.responses.create(model=model, input=question, max_output_tokens=3, temperature=0)
out["max_output_tokens"] = summary(r)

# A JSON schema in text.format.
city = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
        "required": ["city", "country"], "additionalProperties": False}
r = client.responses.create(model=model, input=question, temperature=0, max_output_tokens=60,
                            text={"format": {"type": "json_schema", "name": "city", "schema": city, "strict": True}})
try:
    jsonschema.validate(json.loads(r.output_text), city)
    out["structured"] = {"error": None}
except (ValueError, jsonschema.ValidationError) as e:
    out["structured"] = {"error": str(e), "text": r.output_text}

# A conversation: the second turn continues the stored first, as the chat route answers the
# same turns written out.
first = client.responses.create(model=model, input="My name is Ada. Say hello to me.", max_output_tokens=20, temperature=0)
second = client.responses.create(model=model, previous_response_id=first.id, input="What is my name?",
                                 max_output_tokens=20, temperature=0)
out["conversation"] = {
    "first": summary(first), "second": summary(second), "previous": second.previous_response_id,
    "chat": chat([{"role": "user", "content": "My name is Ada. Say hello to me."},
                  {"role": "assistant", "content": first.output_text},
                  {"role": "user", "content": "What is my name?"}], max_tokens=20),
}
got = client.responses.retrieve(first.id)
out["retrieved"] = {"id": got.id, "text": got.output_text, "status": got.status}
out["kept"] = second.id

# store: false keeps nothing; a deleted response is gone.
def status_of(call):
    try:
        call()
        return 200
    except openai.APIStatusError as e:
        return e.status_code


gone = client.responses.create(model=model, input=question, max_output_tokens=2, store=False)
out["not_stored"] = {
    "retrieve": status_of(lambda: client.responses.retrieve(gone.id)),
    "continue": status_of(lambda: client.responses.create(model=model, previous_response_id=gone.id, input="x", max_output_tokens=1)),
}
client.responses.delete(first.id)
out["deleted"] = {"retrieve": status_of(lambda: client.responses.retrieve(first.id)),
                  "again": status_of(lambda: client.responses.delete(first.id))}

# Function tools: a forced call whole and streamed; its output sent back.
weather = {
    "type": "function", "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False},
}
wq = "What is the weather like in Paris today?"
r = client.responses.create(model=model, input=wq, tools=[weather], tool_choice="required", temperature=0, max_output_tokens=100)
calls = [i for i in r.output if i.type == "function_call"]


def valid(args):
    try:
        jsonschema.validate(json.loads(args), weather["parameters"])
        return None
    except (ValueError, jsonschema.ValidationError) as e:
        return str(e)


out["tool"] = {"status": r.status, "items": [i.type for i in r.output],
               "calls": [{"call_id": c.call_id, "name": c.name, "arguments": json.loads(c.arguments), "error": valid(c.arguments)} for c in calls]}
with client.responses.stream(model=model, input=wq, tools=[weather], tool_choice="required", temperature=0, max_output_tokens=100) as s:
    events = [ev.type for ev in s]
    final = s.get_final_response()
out["tool_stream"] = {"events": events, "calls": [{"name": c.name, "arguments": json.loads(c.arguments)} for c in final.output if c.type == "function_call"]}
if calls:
    def answer(result):
        return client.responses.create(model=model, previous_response_id=r.id, tools=[weather], tool_choice="none",
                                       input=[{"type": "function_call_output", "call_id": c.call_id, "output": result} for c in calls],
                                       temperature=0, max_output_tokens=40)
    a = answer(json.dumps({"city": "Paris", "weather": "sunny", "temperature": 18}))
    e = answer("")
    out["round_trip"] = {"status": a.status, "items": [i.type for i in a.output], "text": a.output_text,
                         "input_tokens": a.usage.input_tokens, "input_tokens_empty_result": e.usage.input_tokens}

refused = {}
for name, kwargs in {
    "web_search": {"tools": [{"type": "web_search"}]},
    "image": {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA=="}]}]},
    "unknown_previous": {"previous_response_id": "resp_" + "0" * 32},
}.items():
    kwargs.setdefault("input", question)
    try:
        client.responses.create(model=model, max_output_tokens=2, **kwargs)
        refused[name] = None
    except openai.APIStatusError as e:
        refused[name] = [e.status_code, (e.body or {}).get("message")]
out["refused"] = refused
print(json.dumps(out))
