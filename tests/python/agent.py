"""An agent's loop in `auto` mode, as agents run it, through the official clients unchanged but
for their transport: three user turns, each answered by tool calls the model chooses to make
(executed here, their results sent back) and then by text that uses the results; the same tools through the ollama
client, the Anthropic client and LangChain's bind_tools. Prints what it found as JSON for daemon/tests/daemon/agent.rs.

    python3 tests/python/agent.py SOCKET
"""
import json
import sys

import jsonschema

from clients import anthropic_client, ollama_client, openai_client

socket = sys.argv[1]
client = openai_client(socket)
model = client.models.list().data[0].id
schemas = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string", "description": "The city, e.g. Paris"}},
                    "required": ["city"]},
    "get_time": {"type": "object", "properties": {"city": {"type": "string", "description": "The city, e.g. Tokyo"}},
                 "required": ["city"]},
}
descriptions = {"get_weather": "Get the current weather in a city.", "get_time": "Get the current local time in a city."}
tools = [{"type": "function", "function": {"name": n, "description": descriptions[n], "parameters": s}} for n, s in schemas.items()]


def run(name, args):
    if name == "get_weather":
        return json.dumps({"city": args.get("city"), "weather": "sunny", "temperature_c": 21})
    return json.dumps({"city": args.get("city"), "time": "14:05"})


def checked(name, arguments):
    try:
        args = json.loads(arguments) if isinstance(arguments, str) else arguments
        jsonschema.validate(args, schemas[name])
        return args, None
    except (ValueError, KeyError, jsonschema.ValidationError) as e:
        return None, str(e)


messages = [{"role": "system", "content": "You are a helpful assistant. Use the tools to answer."}]
turns = []
for question, tool in [("What is the weather like in Paris right now?", "get_weather"),
                       ("And what time is it in Tokyo?", "get_time"),
                       ("What about the weather in Rome?", "get_weather")]:
    messages.append({"role": "user", "content": question})
    turn = {"question": question, "tool": tool, "calls": [], "answer": None}
    # The model decides (auto). Its calls are run and their results sent back; asked again, it
    # answers in text (kept) or calls again (this small model repeats its call rather than
    # answer after a result: the agent's step limit then ends the turn, and the repeat stays
    # out of the conversation), or echoes the result as a `<tool_response>` block of its own
    # (which agents drop as they drop the repeat: kept, it teaches the next turn to answer so
    # instead of calling; which of the two it does turns on the last bits of its arithmetic).
    r = client.chat.completions.create(model=model, messages=messages, tools=tools, temperature=0, max_tokens=200)
    m = r.choices[0].message
    turn["finish"] = r.choices[0].finish_reason
    turn["content"] = m.content
    if m.tool_calls:
        messages.append({"role": "assistant", "content": m.content, "tool_calls": [
            {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}} for c in m.tool_calls]})
        for c in m.tool_calls:
            args, error = checked(c.function.name, c.function.arguments)
            turn["calls"].append({"name": c.function.name, "arguments": args, "error": error})
            messages.append({"role": "tool", "tool_call_id": c.id, "content": run(c.function.name, args or {})})
        r = client.chat.completions.create(model=model, messages=messages, tools=tools, temperature=0, max_tokens=200)
        m = r.choices[0].message
        turn["then"] = {"finish": r.choices[0].finish_reason, "content": m.content,
                        "calls": [{"name": c.function.name, "arguments": checked(c.function.name, c.function.arguments)[0]} for c in m.tool_calls or []]}
        if m.content and not m.tool_calls and not m.content.lstrip().startswith("<tool_response>"):
            messages.append({"role": "assistant", "content": m.content})
    turns.append(turn)
out = {"turns": turns}

# The ollama client, auto mode.
oc = ollama_client(socket)
r = oc.chat(model=model, messages=[{"role": "user", "content": "What is the weather like in Paris right now?"}],
            tools=tools, options={"temperature": 0, "num_predict": 200})
out["ollama"] = {"content": r.message.content, "calls": [
    {"name": c.function.name, "arguments": dict(c.function.arguments)} for c in r.message.tool_calls or []]}

# The Anthropic client, auto mode.
ac = anthropic_client(socket)
m = ac.messages.create(model=model, max_tokens=200, extra_body={"temperature": 0},
                       messages=[{"role": "user", "content": "What is the weather like in Paris right now?"}],
                       tools=[{"name": n, "description": descriptions[n], "input_schema": s} for n, s in schemas.items()])
out["anthropic"] = {"stop_reason": m.stop_reason, "blocks": [b.type for b in m.content],
                    "uses": [{"name": b.name, "input": b.input} for b in m.content if b.type == "tool_use"]}
# LangChain's bind_tools, its ChatOpenAI on the OpenAI client's transport.
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

from clients import httpx2


@tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return run("get_weather", {"city": city})


@tool
def get_time(city: str) -> str:
    """Get the current local time in a city."""
    return run("get_time", {"city": city})


llm = ChatOpenAI(model=model, base_url="http://inferd/v1", api_key="not-needed", temperature=0, max_tokens=200,
                 http_client=httpx2.Client(transport=httpx2.HTTPTransport(uds=socket)))
bound = llm.bind_tools([get_weather, get_time])
history = [HumanMessage("What time is it in Tokyo?")]
ai = bound.invoke(history)
out["langchain"] = {"calls": [{"name": c["name"], "args": c["args"]} for c in ai.tool_calls], "content": ai.content}
if ai.tool_calls:
    history += [ai] + [ToolMessage(run(c["name"], c["args"]), tool_call_id=c["id"]) for c in ai.tool_calls]
    after = bound.invoke(history)
    out["langchain"]["after"] = {"calls": len(after.tool_calls), "content": after.content}
print(json.dumps(out))
