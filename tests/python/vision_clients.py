"""The official OpenAI, Anthropic and Ollama Python clients asking about an image, unchanged: the
OpenAI client with a data: URL content part (chat) and an input_image (Responses), the
Anthropic client with a base64 image block,
the Ollama client with a file in `images` (chat and generate). Prints each answer as JSON for
the Rust test to compare.

    python3 tests/python/vision_clients.py SOCKET MODEL IMAGE
"""
import base64
import json
import sys

from clients import anthropic_client, ollama_client, openai_client

socket, model, image = sys.argv[1], sys.argv[2], sys.argv[3]
question = "What is this?"
out = {}
with open(image, "rb") as f:
    data = base64.b64encode(f.read()).decode()
url = "data:image/png;base64," + data
r = openai_client(socket).chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                           {"type": "text", "text": question}]}],
    max_tokens=8, temperature=0)
out["openai"] = r.choices[0].message.content
rs = openai_client(socket).responses.create(
    model=model, max_output_tokens=8, temperature=0,
    input=[{"role": "user", "content": [{"type": "input_image", "image_url": url},
                                        {"type": "input_text", "text": question}]}])
out["responses"] = rs.output_text
a = anthropic_client(socket).messages.create(
    model=model, max_tokens=8, extra_body={"temperature": 0},
    messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
        {"type": "text", "text": question}]}])
out["anthropic"] = "".join(b.text for b in a.content if b.type == "text")
ollama = ollama_client(socket)
out["capabilities"] = ollama.show(model).capabilities
options = {"temperature": 0, "num_predict": 8}
c = ollama.chat(model=model, messages=[{"role": "user", "content": question, "images": [image]}], options=options)
out["ollama_chat"] = c.message.content
g = ollama.generate(model=model, prompt=question, images=[image], options=options)
out["ollama_generate"] = g.response
print(json.dumps(out))
