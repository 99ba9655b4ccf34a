"""The daemon serving a model on the GPU (`backend = "cuda"`), asked through the official OpenAI
Python client over its Unix socket: the model list, a completion, the same completion streamed,
a streamed chat, and four requests at once, each of whose greedy texts must equal the same
request's text alone (batched decode on the GPU is batch-invariant: every token's products and
attention are computed as they are alone, as long as a step stays within the kernels' matvec
path, which the scheduler's token budget of 32 here ensures). /v1/status must say the model
runs on "cuda" with no request failed. Prints what it saw as JSON; exits 1 on a failed check.

    python3 tests/gpu/serve_check.py INFERD MODEL.gguf WORKDIR
"""
import json
import os
import socket as socketlib
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import openai

try:  # the OpenAI client's HTTP library: httpx2 in newer releases, httpx before
    import httpx2 as httpx
except ImportError:
    import httpx

inferd, model_path, work = sys.argv[1:4]
os.makedirs(work, exist_ok=True)
sock = os.path.join(work, "inferd.sock")
cfg = os.path.join(work, "inferd.toml")
with open(cfg, "w") as f:
    f.write(f"""[server]
dbus = false
keep_alive = "-1"
[scheduler]
token_budget = 32
[[model]]
path = "{model_path}"
name = "gpu"
backend = "cuda"
kv_cache_mib = 256
""")
env = dict(os.environ, XDG_DATA_HOME=work, XDG_STATE_HOME=work, DBUS_SESSION_BUS_ADDRESS="unix:path=/nonexistent")
for k in ("NOTIFY_SOCKET", "LISTEN_FDS", "WATCHDOG_USEC"):
    env.pop(k, None)
log = open(os.path.join(work, "daemon.log"), "w")
daemon = subprocess.Popen([inferd, "serve", "--user", "--config", cfg, "--socket", sock], env=env, stdout=log, stderr=log)

failures = []
out = {}


def check(ok, what):
    if not ok:
        failures.append(what)


try:
    deadline = time.time() + 120
    while True:
        try:
            s = socketlib.socket(socketlib.AF_UNIX)
            s.connect(sock)
            s.close()
            break
        except OSError:
            if daemon.poll() is not None or time.time() > deadline:
                raise SystemExit(f"the daemon did not come up (exit {daemon.poll()}); see {log.name}")
            time.sleep(0.2)
    http = httpx.Client(transport=httpx.HTTPTransport(uds=sock), timeout=120)
    client = openai.OpenAI(base_url="http://inferd/v1", api_key="not-needed", http_client=http)

    out["models"] = [m.id for m in client.models.list().data]
    check(out["models"] == ["gpu"], "the model list")
    prompt = "The capital of France is"
    c = client.completions.create(model="gpu", prompt=prompt, max_tokens=12, temperature=0)
    out["completion"] = c.choices[0].text
    out["completion_tokens"] = c.usage.completion_tokens
    check(c.usage.completion_tokens > 0, "a completion generated nothing")
    streamed = "".join(
        ch.choices[0].text
        for ch in client.completions.create(model="gpu", prompt=prompt, max_tokens=12, temperature=0, stream=True)
        if ch.choices
    )
    out["completion_stream"] = streamed
    check(streamed == c.choices[0].text, "the streamed completion differs from the whole one")
    messages = [{"role": "user", "content": "Name three primary colors."}]
    chat = "".join(
        ch.choices[0].delta.content or ""
        for ch in client.chat.completions.create(model="gpu", messages=messages, max_tokens=16, temperature=0, stream=True)
        if ch.choices
    )
    out["chat_stream"] = chat

    prompts = [f"Request {i}: count from {i} upwards:" for i in range(4)]

    def complete(p):
        r = client.completions.create(model="gpu", prompt=p, max_tokens=24, temperature=0)
        return r.choices[0].text

    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(complete, prompts))
    alone = [complete(p) for p in prompts]
    out["together"], out["alone"] = together, alone
    check(together == alone, "four requests at once differ from the same requests alone")

    status = http.get("http://inferd/v1/status").json()
    m = status["models"][0]
    out["backend"] = m.get("backend")
    out["device_memory"] = m.get("device_memory")
    out["requests"] = m.get("requests")
    check("cuda" in json.dumps(m.get("backend")), "the model does not run on cuda")
    check(m["requests"]["failed"] == 0, "a request failed")
finally:
    daemon.terminate()
    try:
        daemon.wait(30)
    except subprocess.TimeoutExpired:
        daemon.kill()
    log.close()
    if failures or sys.exc_info()[0] is not None:
        with open(log.name) as f:
            sys.stderr.write("the daemon's log, last 60 lines:\n" + "".join(f.readlines()[-60:]))

out["failures"] = failures
print(json.dumps(out, indent=2))
sys.exit(1 if failures else 0)
