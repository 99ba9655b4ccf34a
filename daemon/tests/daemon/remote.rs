//! Remote models: a `[[model]]` served by another inferd over loopback TCP, reached through the
//! front daemon's socket with the same answers, limits and cancellation, and an unreachable
//! upstream that is an explicit error.

use super::*;

pub(super) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn text(body: &str) -> String {
    let v: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"));
    v["choices"][0]["text"].as_str().or(v["choices"][0]["message"]["content"].as_str()).unwrap().to_owned()
}

fn in_flight(d: &Daemon) -> u64 {
    d.status()["requests_per_user"].as_object().unwrap().values().filter_map(Value::as_u64).sum()
}

#[test]
fn a_remote_model_answers_as_its_upstream_does_and_cancels_there() {
    // The upstream asks TCP clients for a key, which the front has in a file of its own.
    use std::os::unix::fs::PermissionsExt;
    let port = free_port();
    let (up_dir, front_dir) = (scratch("remote-upstream"), scratch("remote-front"));
    let key = front_dir.join("upstream-key");
    std::fs::write(&key, "sk-remote-test\n").unwrap();
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
    let up = Daemon::start(
        &up_dir,
        &format!("[server]\ntcp = \"127.0.0.1:{port}\"\ntcp_key_file = \"{}\"\n", key.display()),
        &[],
    );
    let up_name = up.status()["models"][0]["name"].as_str().unwrap().to_owned();
    let dead = free_port();
    let front = Daemon::start(
        &front_dir,
        &format!(
            "[[model]]\nname = \"far\"\nupstream = \"http://127.0.0.1:{port}/v1/\"\nupstream_model = \"{up_name}\"\n\
             upstream_key_file = \"{}\"\n\n\
             [[model]]\nname = \"gone\"\nupstream = \"http://127.0.0.1:{dead}/v1\"\n\n\
             [[model]]\nname = \"spare\"\nupstream = \"http://127.0.0.1:{dead}/v1\"\nfallback = \"{up_name}\"\n\n\
             [[model]]\npath = \"{}\"\n\n[limits]\nmax_requests_per_user = 2\n",
            key.display(),
            model()
        ),
        &[],
    );
    let models: Value = serde_json::from_str(&front.http("GET", "/v1/models", "").1).unwrap();
    let far = models["data"].as_array().unwrap().iter().find(|m| m["id"] == "far").expect("far is listed");
    assert_eq!((far["remote"].as_bool(), far["owned_by"].as_str()), (Some(true), Some("remote")));

    // The same answer as the upstream's own, whole and streamed, completion and chat.
    let completion = |model: &str| {
        format!(r#"{{"model": "{model}", "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}}"#)
    };
    let (code, direct) = up.http("POST", "/v1/completions", &completion(&up_name));
    assert_eq!(code, 200, "{direct}");
    let (code, via) = front.http("POST", "/v1/completions", &completion("far"));
    assert_eq!(code, 200, "{via}");
    assert_eq!(text(&via), text(&direct));
    let chat = |model: &str| {
        format!(
            r#"{{"model": "{model}", "messages": [{{"role": "user", "content": "Name a colour."}}], "max_tokens": 10, "temperature": 0, "stream": true}}"#
        )
    };
    let (_, direct) = up.http("POST", "/v1/chat/completions", &chat(&up_name));
    let (code, via) = front.http("POST", "/v1/chat/completions", &chat("far"));
    assert_eq!(code, 200, "{via}");
    assert!(!deltas(&direct).is_empty());
    assert_eq!(deltas(&via), deltas(&direct));
    assert!(via.contains("data: [DONE]"));

    // A client that leaves mid-stream cancels the upstream's request.
    let long = r#"{"model": "far", "prompt": "Count from one to one thousand: one, two, three,", "max_tokens": 3000, "temperature": 0, "stream": true}"#;
    let mut s = open_stream(&front.socket, long);
    let mut first = [0u8; 64];
    s.read_exact(&mut first).unwrap();
    assert_eq!(in_flight(&up), 1);
    drop(s);
    let t0 = Instant::now();
    wait_for("the upstream to cancel", Duration::from_secs(5), || in_flight(&up) == 0);
    eprintln!("remote: the upstream freed the request {:?} after the client left", t0.elapsed());
    wait_for("the front to free the user's place", Duration::from_secs(5), || in_flight(&front) == 0);

    // The per-user limit counts remote requests too.
    let held = [open_stream(&front.socket, long), open_stream(&front.socket, long)];
    let (code, body) = front.http("POST", "/v1/completions", &completion("far"));
    assert_eq!(code, 429, "{body}");
    drop(held);
    wait_for("the held places to come back", Duration::from_secs(5), || in_flight(&front) == 0);

    // An upstream nobody listens on is a 502 that says so, at once.
    let t0 = Instant::now();
    let (code, body) = front.http("POST", "/v1/completions", &completion("gone"));
    assert_eq!(code, 502, "{body}");
    assert!(body.contains(&format!("127.0.0.1:{dead}")), "{body}");
    assert!(t0.elapsed() < Duration::from_secs(5));
    // With a fallback, the local model answers while the upstream is down.
    let (code, body) = front.http("POST", "/v1/completions", &completion("spare"));
    assert_eq!(code, 200, "{body}");
    assert_eq!(text(&body), text(&front.http("POST", "/v1/completions", &completion(&up_name)).1));
    // Per remote model in /metrics: requests, errors, time to the upstream's answer.
    let metrics = front.http("GET", "/metrics", "").1;
    for line in ["inferd_upstream_requests_total{model=\"gone\"} 1", "inferd_upstream_errors_total{model=\"gone\"} 1"] {
        assert!(metrics.contains(line), "{line} in {metrics}");
    }
    assert!(metrics.contains("inferd_upstream_response_seconds_count{model=\"far\"} 5"), "{metrics}");
    assert!(metrics.contains("inferd_upstream_fallbacks_total{model=\"spare\"} 1"), "{metrics}");
    // The local model is served beside them.
    assert_eq!(front.http("POST", "/v1/completions", &completion(&up_name)).0, 200);
}

/// The JSON lines of an NDJSON body (chunk-size lines left out).
fn ndjson(body: &str) -> Vec<Value> {
    body.lines().filter(|l| l.starts_with('{')).map(|l| serde_json::from_str(l).unwrap()).collect()
}

/// An Ollama answer's text: its streamed pieces joined, or its one object's.
fn ollama_text(body: &str) -> String {
    ndjson(body)
        .iter()
        .map(|v| v["message"]["content"].as_str().or(v["response"].as_str()).unwrap_or("").to_owned())
        .collect()
}

/// Ollama's routes, tools and JSON schemas, and D-Bus, for a remote model: each answer equals
/// the upstream's own answer to the same request.
#[test]
fn a_remote_model_speaks_ollama_and_dbus_and_passes_tools_and_schemas() {
    use std::collections::HashMap;
    use zbus::zvariant::Value as V;
    let port = free_port();
    let up = Daemon::start(&scratch("remote2-upstream"), &format!("[server]\ntcp = \"127.0.0.1:{port}\"\n"), &[]);
    let up_name = up.status()["models"][0]["name"].as_str().unwrap().to_owned();
    let dir = scratch("remote2-front");
    let bus = super::dbus::Bus::start(&dir);
    let front = Daemon::start(
        &dir,
        &format!(
            "[[model]]\nname = \"far\"\nupstream = \"http://127.0.0.1:{port}/v1\"\nupstream_model = \"{up_name}\"\n\n\
             [[model]]\npath = \"{}\"\n",
            model()
        ),
        &[("DBUS_SESSION_BUS_ADDRESS", &bus.address)],
    );
    // Listed by Ollama's tags, marked remote.
    let tags: Value = serde_json::from_str(&front.http("GET", "/api/tags", "").1).unwrap();
    let far = tags["models"].as_array().unwrap().iter().find(|m| m["name"] == "far:latest").expect("far in /api/tags");
    assert_eq!(far["remote_model"], up_name.as_str());
    assert_eq!(far["remote_host"], format!("http://127.0.0.1:{port}/v1").as_str());
    let (code, show) = front.http("POST", "/api/show", r#"{"model": "far"}"#);
    assert_eq!(code, 200, "{show}");
    let (ok, out, err) = super::clients::inferctl(&front.socket, &["models"], "");
    assert!(ok, "{err}");
    assert!(out.lines().any(|l| l.starts_with("far\tremote\t")), "{out}");

    // Ollama's chat and generate, streamed and whole, as the upstream's own Ollama routes answer.
    for (route, body) in [
        ("/api/chat", r#""messages": [{"role": "user", "content": "Name a colour."}]"#),
        ("/api/generate", r#""system": "You are terse.", "prompt": "Name a fruit.""#),
        ("/api/generate", r#""raw": true, "prompt": "The capital of France is""#),
    ] {
        for stream in [true, false] {
            let ask = |model: &str| {
                format!(
                    r#"{{"model": "{model}", {body}, "stream": {stream}, "options": {{"temperature": 0, "num_predict": 12}}}}"#
                )
            };
            let (code, direct) = up.http("POST", route, &ask(&up_name));
            assert_eq!(code, 200, "{direct}");
            let (code, via) = front.http("POST", route, &ask("far:latest"));
            assert_eq!(code, 200, "{route} {via}");
            assert!(!ollama_text(&direct).is_empty());
            assert_eq!(ollama_text(&via), ollama_text(&direct), "{route} stream={stream}");
            let (last, want) = (ndjson(&via).pop().unwrap(), ndjson(&direct).pop().unwrap());
            assert_eq!(last["done"], true, "{via}");
            assert_eq!(last["done_reason"], want["done_reason"]);
            assert_eq!(last["eval_count"], want["eval_count"], "{via}");
            assert_eq!(last["prompt_eval_count"], want["prompt_eval_count"], "{via}");
            assert_eq!(last["model"], "far:latest");
        }
    }
    // Anthropic's Messages, whole and streamed, as the upstream's own /v1/messages answers.
    let ask = |model: &str, stream: bool| {
        format!(
            r#"{{"model": "{model}", "max_tokens": 12, "temperature": 0, "stream": {stream}, "system": "You are terse.",
                "messages": [{{"role": "user", "content": "Name a colour."}}]}}"#
        )
    };
    let (code, direct) = up.http("POST", "/v1/messages", &ask(&up_name, false));
    assert_eq!(code, 200, "{direct}");
    let (code, via) = front.http("POST", "/v1/messages", &ask("far", false));
    assert_eq!(code, 200, "{via}");
    let (direct, via): (Value, Value) = (serde_json::from_str(&direct).unwrap(), serde_json::from_str(&via).unwrap());
    assert!(!direct["content"][0]["text"].as_str().unwrap().is_empty(), "{direct}");
    assert_eq!(via["content"], direct["content"], "{via}");
    assert_eq!((&via["stop_reason"], &via["usage"]), (&direct["stop_reason"], &direct["usage"]), "{via}");
    assert_eq!(via["model"], "far");
    let streamed = |body: &str| -> String {
        body.lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter_map(|d| serde_json::from_str::<Value>(d).ok())
            .filter_map(|e| e.pointer("/delta/text").and_then(Value::as_str).map(str::to_owned))
            .collect()
    };
    let (code, via) = front.http("POST", "/v1/messages", &ask("far", true));
    assert_eq!(code, 200, "{via}");
    assert_eq!(streamed(&via), direct["content"][0]["text"].as_str().unwrap(), "{via}");
    assert!(via.contains("event: message_stop"), "{via}");
    // OpenAI's Responses, whole and streamed, and a second turn through previous_response_id:
    // the conversation is kept here, the upstream answers it as its own Responses route does.
    let ask = |model: &str, stream: bool, prev: &str| {
        let prev = if prev.is_empty() { String::new() } else { format!(r#""previous_response_id": "{prev}", "#) };
        format!(
            r#"{{"model": "{model}", {prev}"max_output_tokens": 12, "temperature": 0, "stream": {stream},
                "instructions": "You are terse.", "input": "Name a colour."}}"#
        )
    };
    let output = |body: &str| -> Value { serde_json::from_str::<Value>(body).unwrap()["output"].clone() };
    let (code, direct) = up.http("POST", "/v1/responses", &ask(&up_name, false, ""));
    assert_eq!(code, 200, "{direct}");
    let (code, via) = front.http("POST", "/v1/responses", &ask("far", false, ""));
    assert_eq!(code, 200, "{via}");
    let said = |out: &Value| out[0]["content"][0]["text"].as_str().unwrap().to_owned();
    assert!(!said(&output(&direct)).is_empty(), "{direct}");
    assert_eq!(said(&output(&via)), said(&output(&direct)), "{via}");
    let (first_up, first_via) = (
        serde_json::from_str::<Value>(&direct).unwrap()["id"].as_str().unwrap().to_owned(),
        serde_json::from_str::<Value>(&via).unwrap()["id"].as_str().unwrap().to_owned(),
    );
    let (code, direct) = up.http("POST", "/v1/responses", &ask(&up_name, false, &first_up));
    assert_eq!(code, 200, "{direct}");
    let (code, via) = front.http("POST", "/v1/responses", &ask("far", true, &first_via));
    assert_eq!(code, 200, "{via}");
    let streamed: String = via
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter(|e| e["type"] == "response.output_text.delta")
        .filter_map(|e| e["delta"].as_str().map(str::to_owned))
        .collect();
    assert_eq!(streamed, said(&output(&direct)), "the second turn, streamed: {via}");
    let (code, body) = front.http("POST", "/v1/messages/count_tokens", r#"{"model": "far", "messages": []}"#);
    assert!(code == 400 && body.contains("counted there"), "{body}");

    // Ollama's embeddings.
    let embed = |model: &str| format!(r#"{{"model": "{model}", "input": ["Hello", "Hi there"]}}"#);
    let direct: Value = serde_json::from_str(&up.http("POST", "/api/embed", &embed(&up_name)).1).unwrap();
    let (code, via) = front.http("POST", "/api/embed", &embed("far"));
    assert_eq!(code, 200, "{via}");
    let via: Value = serde_json::from_str(&via).unwrap();
    assert_eq!(via["embeddings"].as_array().unwrap().len(), 2);
    for (a, b) in via["embeddings"][1].as_array().unwrap().iter().zip(direct["embeddings"][1].as_array().unwrap()) {
        assert!((a.as_f64().unwrap() - b.as_f64().unwrap()).abs() < 1e-6);
    }
    // Token ids do not cross to another tokenizer.
    let (code, body) = front.http("POST", "/api/generate", r#"{"model": "far", "prompt": "x", "context": [1, 2]}"#);
    assert_eq!(code, 400, "{body}");

    // Tools and a JSON schema pass through OpenAI's chat as they are, and Ollama's.
    let tools = r#"[{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"], "additionalProperties": false}}}]"#;
    let weather = r#"[{"role": "user", "content": "What is the weather in Paris?"}]"#;
    let calls = |body: &str| -> Vec<(String, Value)> {
        let v: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"));
        let list = v["choices"][0]["message"]["tool_calls"].as_array().cloned().unwrap_or_default();
        list.iter()
            .map(|c| {
                let f = &c["function"];
                (
                    f["name"].as_str().unwrap().to_owned(),
                    serde_json::from_str(f["arguments"].as_str().unwrap()).unwrap(),
                )
            })
            .collect()
    };
    let ask = |model: &str| {
        format!(
            r#"{{"model": "{model}", "messages": {weather}, "tools": {tools}, "tool_choice": "required", "max_tokens": 60, "temperature": 0}}"#
        )
    };
    let direct = calls(&up.http("POST", "/v1/chat/completions", &ask(&up_name)).1);
    assert_eq!(direct.len(), 1, "{direct:?}");
    assert_eq!(calls(&front.http("POST", "/v1/chat/completions", &ask("far")).1), direct);
    let ask = |model: &str| {
        format!(
            r#"{{"model": "{model}", "messages": {weather}, "tools": {tools}, "stream": false, "options": {{"temperature": 0, "num_predict": 60}}}}"#
        )
    };
    let ollama_calls = |body: &str| ndjson(body).pop().unwrap()["message"]["tool_calls"].clone();
    let direct = ollama_calls(&up.http("POST", "/api/chat", &ask(&up_name)).1);
    assert_eq!(ollama_calls(&front.http("POST", "/api/chat", &ask("far")).1), direct);
    let schema = r#"{"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"], "additionalProperties": false}"#;
    let ask = |model: &str| {
        format!(
            r#"{{"model": "{model}", "messages": [{{"role": "user", "content": "Name a city."}}], "max_tokens": 30, "temperature": 0,
                "response_format": {{"type": "json_schema", "json_schema": {{"name": "c", "schema": {schema}}}}}}}"#
        )
    };
    let (_, direct) = up.http("POST", "/v1/chat/completions", &ask(&up_name));
    let (code, via) = front.http("POST", "/v1/chat/completions", &ask("far"));
    assert_eq!(code, 200, "{via}");
    let city: Value = serde_json::from_str(&text(&via)).unwrap();
    assert!(city["city"] == "Paris" || city["city"] == "Rome", "{city}");
    assert_eq!(text(&via), text(&direct));
    let ask = |model: &str| {
        format!(
            r#"{{"model": "{model}", "prompt": "Name a city.", "format": {schema}, "stream": false, "options": {{"temperature": 0, "num_predict": 30}}}}"#
        )
    };
    let (_, direct) = up.http("POST", "/api/generate", &ask(&up_name));
    assert_eq!(ollama_text(&front.http("POST", "/api/generate", &ask("far")).1), ollama_text(&direct));

    // D-Bus: listed, and Complete, Chat (its tool call too) and Embed answer as the upstream.
    bus.wait_for_name();
    let completion = |model: &str| {
        format!(r#"{{"model": "{model}", "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}}"#)
    };
    let want = text(&up.http("POST", "/v1/completions", &completion(&up_name)).1);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let caller = zbus::connection::Builder::address(bus.address.as_str()).unwrap().build().await.unwrap();
        let iface = Some("org.inferd.Inference1");
        let p = zbus::Proxy::new(&caller, "org.inferd.Inference1", "/org/inferd/Inference1", "org.inferd.Inference1")
            .await
            .unwrap();
        let models: Vec<String> = p.get_property("Models").await.unwrap();
        assert!(models.contains(&"far".to_owned()), "{models:?}");
        let opts = HashMap::from([("max_tokens", V::U32(12)), ("temperature", V::F64(0.0))]);
        let r = caller
            .call_method(iface, "/org/inferd/Inference1", iface, "Complete", &("far", "The capital of France is", &opts))
            .await
            .unwrap();
        assert_eq!(r.body().deserialize::<String>().unwrap(), want);
        let heard = super::dbus::signals(&caller, "Generate", &("far", "The capital of France is", &opts)).await;
        assert_eq!(heard.text, want);
        assert_eq!(heard.reason, "length");
        assert_eq!(heard.completion_tokens, 12);
        let ask = HashMap::from([("role", "user"), ("content", "What is the weather in Paris?")]);
        let opts = HashMap::from([
            ("max_tokens", V::U32(60)),
            ("temperature", V::F64(0.0)),
            ("tools", V::from(tools)),
            ("tool_choice", V::from("required")),
        ]);
        let heard = super::dbus::signals(&caller, "Chat", &("far", &[ask][..], &opts)).await;
        let mine: Vec<(String, Value)> =
            heard.calls.iter().map(|(_, n, a)| (n.clone(), serde_json::from_str(a).unwrap())).collect();
        let ask = format!(
            r#"{{"model": "{up_name}", "messages": {weather}, "tools": {tools}, "tool_choice": "required", "max_tokens": 60, "temperature": 0}}"#
        );
        let direct = up.http("POST", "/v1/chat/completions", &ask).1;
        assert_eq!(mine, calls(&direct));
        let reason = serde_json::from_str::<Value>(&direct).unwrap()["choices"][0]["finish_reason"].clone();
        assert_eq!(heard.reason, reason.as_str().unwrap());
        let r = caller
            .call_method(iface, "/org/inferd/Inference1", iface, "Embed", &("far", vec!["Hello", "Hi there"]))
            .await
            .unwrap();
        let vectors: Vec<Vec<f64>> = r.body().deserialize().unwrap();
        let want = direct_embedding(&up, &up_name);
        assert_eq!(vectors.len(), 2);
        for (a, b) in vectors[1].iter().zip(&want) {
            assert!((a - b).abs() < 1e-6);
        }
    });
    drop(front);
    drop(bus);
    let _ = std::fs::remove_dir_all(dir);
}

/// The upstream's embedding of "Hi there" (OpenAI's route).
fn direct_embedding(up: &Daemon, name: &str) -> Vec<f64> {
    let body = format!(r#"{{"model": "{name}", "input": "Hi there"}}"#);
    let v: Value = serde_json::from_str(&up.http("POST", "/v1/embeddings", &body).1).unwrap();
    v["data"][0]["embedding"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()
}

/// llama.cpp's `llama-server`, built by tests/build-llama-server (`INFERD_LLAMA_SERVER` names
/// another).
pub(super) fn llama_server() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("INFERD_LLAMA_SERVER") {
        return Some(PathBuf::from(p));
    }
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cache"));
    let p = cache.join("inferd/llama-server-0.3.36/llama-server");
    p.exists().then_some(p)
}

/// A llama-server process, killed when dropped (a failed assertion included).
pub(super) struct LlamaServer(pub std::process::Child);

impl Drop for LlamaServer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// llama-server `bin` serving `model` on 127.0.0.1:`port` with two threads, its log in `dir`,
/// once its health check answers; `extra` arguments after the common ones.
pub(super) fn spawn_llama_server(
    bin: &std::path::Path,
    model: &str,
    port: u16,
    dir: &std::path::Path,
    extra: &[&str],
) -> LlamaServer {
    let log = std::fs::File::create(dir.join("llama-server.log")).unwrap();
    let server = Command::new(bin)
        .args(["-m", model, "--host", "127.0.0.1", "--port", &port.to_string(), "-t", "2", "-c", "4096"])
        .args(extra)
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap();
    let server = LlamaServer(server);
    wait_for("llama-server", Duration::from_secs(60), || tcp_http(port, "GET", "/health", "").0 == 200);
    server
}

/// One HTTP/1.1 request to 127.0.0.1:`port`: (status, body).
pub(super) fn tcp_http(port: u16, method: &str, path: &str, body: &str) -> (u16, String) {
    let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else { return (0, String::new()) };
    write!(s, "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len()).unwrap();
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let out = String::from_utf8_lossy(&out).into_owned();
    let status = out.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (status, out.split_once("\r\n\r\n").map(|x| x.1.to_owned()).unwrap_or_default())
}

/// The content of a chat stream's deltas.
fn deltas(body: &str) -> String {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|l| *l != "[DONE]")
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|v| v["choices"][0]["delta"]["content"].as_str().map(str::to_owned))
        .collect()
}

/// llama.cpp's server upstream of inferd, serving the default model: streamed answers equal to
/// its own, its slot freed when inferd's client leaves, and its death mid-stream an explicit
/// error that leaves nothing held.
#[test]
fn llama_server_upstream_streams_cancels_and_dies_explicitly() {
    let Some(bin) = llama_server() else {
        eprintln!("skipped: no llama-server (tests/build-llama-server builds one)");
        return;
    };
    let dir = scratch("remote-llama");
    let bus = super::dbus::Bus::start(&dir);
    let port = free_port();
    let mut server = spawn_llama_server(&bin, &model(), port, &dir, &["-np", "2", "--slots"]);
    let front = Daemon::start(
        &dir,
        &format!("[[model]]\nname = \"cpp\"\nupstream = \"http://127.0.0.1:{port}/v1\"\nupstream_model = \"smol\"\n"),
        &[("DBUS_SESSION_BUS_ADDRESS", &bus.address)],
    );
    // The same stream as llama-server's own, through OpenAI's route and Ollama's.
    let chat = |model: &str, stream: bool| {
        format!(
            r#"{{"model": "{model}", "messages": [{{"role": "user", "content": "Name three colours."}}], "max_tokens": 24, "temperature": 0, "stream": {stream}}}"#
        )
    };
    let (code, direct) = tcp_http(port, "POST", "/v1/chat/completions", &chat("smol", true));
    assert_eq!(code, 200, "{direct}");
    let want = deltas(&direct);
    assert!(!want.is_empty(), "{direct}");
    let (code, via) = front.http("POST", "/v1/chat/completions", &chat("cpp", true));
    assert_eq!(code, 200, "{via}");
    assert_eq!(deltas(&via), want);
    assert!(via.contains("data: [DONE]"));
    let ollama = r#"{"model": "cpp", "messages": [{"role": "user", "content": "Name three colours."}], "options": {"temperature": 0, "num_predict": 24}}"#;
    let (code, via) = front.http("POST", "/api/chat", ollama);
    assert_eq!(code, 200, "{via}");
    assert_eq!(ollama_text(&via), want);
    let last = ndjson(&via).pop().unwrap();
    assert_eq!((last["done"].as_bool(), last["eval_count"].as_u64()), (Some(true), Some(24)), "{last}");

    // A client that leaves frees llama-server's slot.
    let busy = || {
        let (_, slots) = tcp_http(port, "GET", "/slots", "");
        let v: Value = serde_json::from_str(&slots).unwrap_or(Value::Null);
        v.as_array().map_or(0, |a| a.iter().filter(|s| s["is_processing"] == true).count())
    };
    let long = r#"{"model": "cpp", "prompt": "Count from one to one thousand: one, two, three,", "max_tokens": 2000, "temperature": 0, "stream": true}"#;
    let mut s = open_stream(&front.socket, long);
    let mut first = [0u8; 64];
    s.read_exact(&mut first).unwrap();
    assert_eq!(busy(), 1);
    drop(s);
    let t0 = Instant::now();
    wait_for("llama-server's slot to free", Duration::from_secs(10), || busy() == 0);
    eprintln!("remote: llama-server freed its slot {:?} after the client left", t0.elapsed());
    wait_for("the front to free the user's place", Duration::from_secs(5), || in_flight(&front) == 0);
    // So does an Ollama client, and a D-Bus caller that cancels its request.
    let ollama_long = r#"{"model": "cpp", "raw": true, "prompt": "Count from one to one thousand: one, two, three,",
        "options": {"temperature": 0, "num_predict": 2000}}"#;
    let mut s = open_stream_at(&front.socket, "/api/generate", ollama_long);
    s.read_exact(&mut first).unwrap();
    assert_eq!(busy(), 1);
    drop(s);
    wait_for("llama-server's slot to free (Ollama)", Duration::from_secs(10), || busy() == 0);
    bus.wait_for_name();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        use zbus::zvariant::Value as V;
        let caller = zbus::connection::Builder::address(bus.address.as_str()).unwrap().build().await.unwrap();
        let iface = Some("org.inferd.Inference1");
        let opts = std::collections::HashMap::from([("max_tokens", V::U32(2000)), ("temperature", V::F64(0.0))]);
        let prompt = "Count from one to one thousand: one, two, three,";
        let r = caller.call_method(iface, "/org/inferd/Inference1", iface, "Generate", &("cpp", prompt, &opts)).await;
        let path: zbus::zvariant::OwnedObjectPath = r.unwrap().body().deserialize().unwrap();
        wait_for("llama-server to take the D-Bus request", Duration::from_secs(10), || busy() == 1);
        let request = Some("org.inferd.Inference1.Request");
        caller.call_method(iface, path.as_str(), request, "Cancel", &()).await.unwrap();
        wait_for("llama-server's slot to free (D-Bus)", Duration::from_secs(10), || busy() == 0);
    });
    wait_for("the front to free the user's places", Duration::from_secs(5), || in_flight(&front) == 0);

    // llama-server killed mid-stream: the stream ends with an error event, not [DONE], and the
    // next request is a 502 at once.
    let mut s = open_stream(&front.socket, long);
    s.read_exact(&mut first).unwrap();
    server.0.kill().unwrap();
    server.0.wait().unwrap();
    // The response's end: its last chunk (the connection itself stays open for the next).
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut rest = Vec::new();
    let mut buf = [0u8; 4096];
    while !rest.ends_with(b"\r\n0\r\n\r\n") {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => rest.extend_from_slice(&buf[..n]),
            Err(e) => panic!("the stream did not end: {e}; so far: {}", String::from_utf8_lossy(&rest)),
        }
    }
    let rest = String::from_utf8_lossy(&rest);
    assert!(rest.contains("failed mid-stream"), "{rest}");
    assert!(!rest.contains("[DONE]"), "{rest}");
    wait_for("the front to free the user's place", Duration::from_secs(5), || in_flight(&front) == 0);
    let (code, body) = front.http("POST", "/v1/chat/completions", &chat("cpp", false));
    assert_eq!(code, 502, "{body}");
    let (code, body) = front.http("POST", "/api/chat", ollama);
    assert_eq!(code, 502, "{body}");
    assert!(body.contains(&format!("127.0.0.1:{port}")), "{body}");
    let metrics = front.http("GET", "/metrics", "").1;
    assert!(metrics.contains("inferd_upstream_errors_total{model=\"cpp\"} 3"), "{metrics}");
    drop(front);
    drop(bus);
    let _ = std::fs::remove_dir_all(dir);
}
