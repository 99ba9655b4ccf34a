"""Structured output through the official clients, unchanged but for their transport: every
schema of tests/python/schemas.json asked of the default model through the OpenAI client
(response_format json_schema, strict), checked with the jsonschema package; one schema streamed,
through each strategy, and through the client's own `parse` with a Pydantic model; json_object;
a schema the engine cannot enforce; Ollama's `format` through the ollama client. Prints what it
found as JSON for the Rust test (daemon/tests/daemon/clients.rs) to check.

    python3 tests/python/structured.py SOCKET
"""
import json
import os
import sys
from typing import Literal

import jsonschema
import openai
import pydantic

from clients import ollama_client, openai_client

socket = sys.argv[1]
client = openai_client(socket)
model = client.models.list().data[0].id
corpus = json.load(open(os.path.join(os.path.dirname(__file__), "schemas.json")))["schemas"]


def check(text, schema):
    """None when `text` is JSON valid under `schema`, else why not."""
    try:
        jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())
        return None
    except (ValueError, jsonschema.ValidationError) as e:
        return str(e).splitlines()[0]


def ask(entry, stream=False, **extra):
    messages = [{"role": "user", "content": entry["prompt"] + " Answer in JSON."}]
    rf = {"type": "json_schema", "json_schema": {"name": entry["name"], "strict": True, "schema": entry["schema"]}}
    args = dict(model=model, messages=messages, response_format=rf, max_tokens=300, **extra)
    if not stream:
        c = client.chat.completions.create(**args)
        return c.choices[0].message.content, c.choices[0].finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **args):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


# Every schema of the corpus. The mask makes whatever the model writes follow the schema, but
# a 135M model does not always end what it writes: greedy decoding loops inside a string, an
# array or a recursive object for a third of the corpus, until max_tokens cuts it. So each
# schema is asked with seeded sampling and a frequency penalty (the usual remedy for loops), up
# to four seeds until an answer ends; every answer that ended must validate.
out = {"corpus": []}
for entry in corpus:
    tries = []
    for seed in range(1, 5):
        text, finish = ask(entry, temperature=0.7, frequency_penalty=0.5, seed=seed)
        tries.append({"seed": seed, "finish": finish, "error": check(text, entry["schema"]) if finish == "stop" else None, "text": text})
        if finish == "stop":
            break
    out["corpus"].append({"name": entry["name"], "tries": tries})

# One schema streamed, and through every strategy. The sampling ones are asked as the corpus
# is (its schema has an unbounded array the small model can repeat): up to four seeds with a
# frequency penalty until an answer ends; the tries before it all ran to max_tokens.
person = next(e for e in corpus if e["name"] == "person_with_pets")
text, finish = ask(person, stream=True, temperature=0)
out["stream"] = {"text": text, "finish": finish, "error": check(text, person["schema"])}
out["strategies"] = {}
for name, extra, seeds in [
    ("nucleus", {"temperature": 0.9, "top_p": 0.95, "frequency_penalty": 0.5}, range(3, 7)),
    ("min-p", {"temperature": 0.9, "extra_body": {"min_p": 0.05}, "frequency_penalty": 0.5}, range(4, 8)),
    ("beam", {"extra_body": {"decoder": "beam", "decoder_params": {"beam_width": 3}}}, [None]),
    ("speculative", {"temperature": 0, "extra_body": {"decoder": "speculative"}}, [None]),
]:
    for tries, seed in enumerate(seeds, 1):
        text, finish = ask(person, **extra, **({} if seed is None else {"seed": seed}))
        if finish == "stop":
            break
    out["strategies"][name] = {"text": text, "finish": finish, "error": check(text, person["schema"]), "tries": tries}

# The client's own structured-output helper: a Pydantic model becomes a strict schema.
class Step(pydantic.BaseModel):
    explanation: str
    output: str


class Pet(pydantic.BaseModel):
    name: str
    species: Literal["cat", "dog", "bird", "fish"]


class Owner(pydantic.BaseModel):
    name: str
    age: int
    pets: list[Pet]


parsed = client.chat.completions.parse(
    model=model,
    messages=[{"role": "user", "content": "Describe a person who owns two pets."}],
    response_format=Owner,
    temperature=0,
    max_tokens=300,
)
p = parsed.choices[0].message.parsed
out["parse"] = {"type": type(p).__name__, "pets": len(p.pets) if p else None, "finish": parsed.choices[0].finish_reason}

# Any JSON object, sampled as the corpus is: up to four seeds until an answer ends (a small
# model can repeat array items until max_tokens); every answer that ended must parse as an object.
tries = []
for seed in range(1, 5):
    c = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "List three colours as JSON."}],
        response_format={"type": "json_object"},
        temperature=0.7,
        frequency_penalty=0.5,
        seed=seed,
        max_tokens=300,
    )
    text, finish = c.choices[0].message.content, c.choices[0].finish_reason
    try:
        tries.append({"seed": seed, "finish": finish, "is_object": isinstance(json.loads(text), dict)})
    except ValueError as e:
        tries.append({"seed": seed, "finish": finish, "error": str(e), "text": text})
    if finish == "stop":
        break
out["json_object"] = tries

# A schema the engine cannot enforce: a 400 that names the field.
try:
    client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 5, "maximum": 1}}},
    )
    out["unenforceable"] = None
except openai.BadRequestError as e:
    out["unenforceable"] = {"status": e.status_code, "param": (e.body or {}).get("param"), "message": (e.body or {}).get("message")}

# Ollama's `format`: a schema, and "json".
oc = ollama_client(socket)
name = oc.list().models[0].model
r = oc.chat(model=name, messages=[{"role": "user", "content": person["prompt"]}], format=person["schema"], options={"temperature": 0, "num_predict": 400})
out["ollama_schema"] = {"error": check(r.message.content, person["schema"]), "done_reason": r.done_reason, "text": r.message.content}
# "json" as json_object above: sampled with a frequency penalty, a few seeds until an answer
# ends (greedy, this small model can repeat inside one string until the token limit).
tries = []
for seed in range(4):
    r = oc.generate(
        model=name,
        prompt="Three colours as a JSON object:",
        format="json",
        options={"temperature": 0.7, "frequency_penalty": 0.5, "seed": seed, "num_predict": 300},
    )
    try:
        tries.append({"seed": seed, "is_object": isinstance(json.loads(r.response), dict), "done_reason": r.done_reason})
    except ValueError as e:
        tries.append({"seed": seed, "done_reason": r.done_reason, "error": str(e), "text": r.response})
    if r.done_reason == "stop":
        break
out["ollama_json"] = tries
print(json.dumps(out))
