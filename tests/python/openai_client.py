"""The official OpenAI Python client against inferd, unchanged: only its HTTP transport is pointed
at the daemon's Unix socket. Prints what it got as JSON for the Rust test to check.

    python3 tests/python/openai_client.py SOCKET
"""
import json
import sys

import openai

from clients import openai_client

socket = sys.argv[1]
client = openai_client(socket)
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

# Content parts, as agents send them: the same prompt as the string content.
parts = [{"role": "user", "content": [
    {"type": "text", "text": "What is the capital of France? "},
    {"type": "text", "text": "Answer in one word."},
]}]
out["chat_parts"] = client.chat.completions.create(model=model, messages=parts, max_tokens=40, temperature=0).choices[0].message.content

# No max_tokens: up to the end of the turn.
long = [{"role": "user", "content": "Describe the water cycle in two sentences."}]
c = client.chat.completions.create(model=model, messages=long, temperature=0)
out["unbounded"] = {"finish": c.choices[0].finish_reason, "tokens": c.usage.completion_tokens, "text": c.choices[0].message.content}

# max_completion_tokens, and stream_options.include_usage.
c = client.chat.completions.create(model=model, messages=long, temperature=0, max_completion_tokens=5)
out["max_completion_tokens"] = {"finish": c.choices[0].finish_reason, "tokens": c.usage.completion_tokens}
chunks = list(client.chat.completions.create(model=model, messages=long, temperature=0, max_completion_tokens=5,
                                             stream=True, stream_options={"include_usage": True}))
out["stream_usage"] = {"last_choices": len(chunks[-1].choices), "tokens": chunks[-1].usage.completion_tokens if chunks[-1].usage else None,
                       "text": "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)}

# The request's sampling fields reach a named strategy: speculative decoding at temperature 0
# is greedy decoding, token for token.
story = [{"role": "user", "content": "Tell me a short story about a cat."}]
greedy = client.chat.completions.create(model=model, messages=story, temperature=0, max_tokens=48)
spec = client.chat.completions.create(model=model, messages=story, temperature=0, max_tokens=48, extra_body={"decoder": "speculative"})
out["speculative_t0"] = {"greedy": greedy.choices[0].message.content, "speculative": spec.choices[0].message.content}

# Each token's log-probability, whole and streamed; completions' logprobs=0 too.
c = client.chat.completions.create(model=model, messages=parts, max_tokens=5, temperature=0, logprobs=True)
lp = c.choices[0].logprobs.content
out["logprobs"] = {"text": c.choices[0].message.content, "tokens": [x.token for x in lp], "values": [x.logprob for x in lp]}
chunks = list(client.chat.completions.create(model=model, messages=parts, max_tokens=5, temperature=0, logprobs=True, stream=True))
out["logprobs_stream"] = [x.logprob for ch in chunks if ch.choices and ch.choices[0].logprobs for x in ch.choices[0].logprobs.content]
c = client.completions.create(model=model, prompt="The capital of France is", max_tokens=3, temperature=0, logprobs=0)
out["completion_logprobs"] = {"tokens": c.choices[0].logprobs.tokens, "values": c.choices[0].logprobs.token_logprobs, "text": c.choices[0].text}

# top_logprobs: each token's most probable alternatives, from every strategy, whole and
# streamed; completions' logprobs=N.
def tops(content):
    return [{"token": x.token, "logprob": x.logprob, "top": [[a.token, a.logprob] for a in x.top_logprobs]} for x in content]


top = {}
for name, kwargs in {
    "greedy": {"temperature": 0},
    "speculative": {"temperature": 0, "extra_body": {"decoder": "speculative"}},
    "nucleus": {"temperature": 0.8, "top_p": 0.9, "seed": 7},
    "min_p": {"temperature": 0.8, "seed": 7, "extra_body": {"decoder": "min-p"}},
    "beam": {"extra_body": {"decoder": "beam", "decoder_params": {"beam_width": 3}}},
}.items():
    c = client.chat.completions.create(model=model, messages=story, max_tokens=12, logprobs=True, top_logprobs=5, **kwargs)
    top[name] = {"text": c.choices[0].message.content, "content": tops(c.choices[0].logprobs.content)}
chunks = list(client.chat.completions.create(model=model, messages=story, max_tokens=12, temperature=0, logprobs=True,
                                             top_logprobs=5, stream=True))
top["greedy_stream"] = {"content": tops([x for ch in chunks if ch.choices and ch.choices[0].logprobs for x in ch.choices[0].logprobs.content])}
c = client.completions.create(model=model, prompt="The capital of France is", max_tokens=3, temperature=0, logprobs=3)
top["completion"] = {"tokens": c.choices[0].logprobs.tokens, "values": c.choices[0].logprobs.token_logprobs,
                     "top": c.choices[0].logprobs.top_logprobs}
out["top_logprobs"] = top

# `user` is an accepted no-op; what inferd does not implement is a 400 that names it.
out["user_ok"] = client.chat.completions.create(model=model, messages=parts, max_tokens=2, temperature=0, user="ana").choices[0].finish_reason
refused = {}
for name, kwargs in {
    "functions": {"extra_body": {"functions": [{"name": "f", "parameters": {"type": "object"}}]}},
    "response_format": {"response_format": {"type": "xml"}},
    "image_url": {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
    "colour": {"extra_body": {"colour": "blue"}},
    "stream_options": {"stream_options": {"include_usage": True}},
    "top_logprobs_alone": {"top_logprobs": 3},
    "top_logprobs_21": {"logprobs": True, "top_logprobs": 21},
}.items():
    args = {"model": model, "messages": parts, "max_tokens": 2}
    args.update(kwargs)
    try:
        client.chat.completions.create(**args)
        refused[name] = None
    except openai.BadRequestError as e:
        refused[name] = [e.status_code, e.message]
out["refused"] = refused
print(json.dumps(out))
