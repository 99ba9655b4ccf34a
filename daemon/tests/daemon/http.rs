//! The OpenAI HTTP API on the Unix socket, its errors, status and metrics; socket permissions
//! and per-user limits from the config.

use super::*;
use serde_json::json;

#[test]
fn openai_api_status_and_metrics_on_the_unix_socket() {
    let dir = scratch("serve");
    let d = Daemon::start(&dir, "", &[]);
    let (st, body) = d.http("GET", "/health", "");
    assert_eq!((st, body.contains(r#""status":"ok""#)), (200, true), "{body}");
    // The same greedy text as `inferd run`.
    let (st, body) = d.http(
        "POST",
        "/v1/completions",
        r#"{"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}"#,
    );
    assert_eq!(st, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["choices"][0]["text"], " Paris.\n");
    assert_eq!(v["usage"]["completion_tokens"], 3);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    // At temperature 0 a bias still applies: the argmax of the biased logits (" London" is 4528).
    let (st, body) = d.http(
        "POST",
        "/v1/completions",
        r#"{"prompt": "The capital of France is", "max_tokens": 1, "temperature": 0, "logit_bias": {"4528": 100}}"#,
    );
    assert_eq!(st, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["choices"][0]["text"], " London", "{body}");
    // Streaming: SSE chunks whose texts add up to the same, then [DONE].
    let (st, body) = d.http(
        "POST",
        "/v1/completions",
        r#"{"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0, "stream": true}"#,
    );
    assert_eq!(st, 200);
    assert_eq!(sse_text(&body), " Paris.\n[DONE]");
    // Stop strings: the text ends before the stop string, whole or streamed.
    let (_, body) = d.http(
        "POST",
        "/v1/completions",
        r#"{"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "stop": ["\n", "zzz"]}"#,
    );
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        (v["choices"][0]["text"].as_str(), v["choices"][0]["finish_reason"].as_str()),
        (Some(" Paris."), Some("stop")),
        "{body}"
    );
    let (_, body) = d.http(
        "POST",
        "/v1/completions",
        r#"{"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0, "stop": "s.\nX", "stream": true}"#,
    );
    assert_eq!(sse_text(&body), " Paris.\n[DONE]", "text held back as a possible stop string is sent at the end");
    let (_, body) = d.http(
        "POST",
        "/v1/completions",
        r#"{"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "stop": "ris", "stream": true}"#,
    );
    assert_eq!(sse_text(&body), " Pa[DONE]");
    // Bad requests get the OpenAI error object with a fitting status.
    for (body, status, needle) in [
        ("{bad", 400, "malformed JSON"),
        ("\"just a string\"", 400, "must be a JSON object"),
        (r#"{"prompt": 3}"#, 400, "prompt must be a string"),
        (r#"{"prompt": "hi", "max_tokens": -1}"#, 400, "max_tokens"),
        (r#"{"prompt": "hi", "max_tokens": "many"}"#, 400, "max_tokens"),
        (r#"{"prompt": "hi", "n": 0}"#, 400, "n must be at least 1"),
        (r#"{"prompt": "hi", "decoder": "nope"}"#, 404, "unknown decoding strategy"),
        (r#"{"prompt": "hi", "model": "other"}"#, 404, "unknown model"),
        (r#"{"prompt": "hi", "temperature": 7}"#, 400, "temperature must be between 0 and 2"),
        (r#"{"prompt": "hi", "stop": [1]}"#, 400, "stop must be"),
        (r#"{"prompt": "hi", "priority": "urgent"}"#, 400, "priority"),
        (r#"{"prompt": "hi", "max_tokens": 5000}"#, 400, "max_tokens must be an integer between 0 and 4096"),
        ("LONG", 413, "exceed the context length"),
    ] {
        let long = format!(r#"{{"prompt": "{}", "max_tokens": 10}}"#, "hello ".repeat(8200));
        let (st, b) = d.http("POST", "/v1/completions", if body == "LONG" { &long } else { body });
        let v: Value = serde_json::from_str(&b).unwrap_or_default();
        assert_eq!(st, status, "{body}: {b}");
        assert!(v["error"]["message"].as_str().unwrap_or("").contains(needle), "{body}: {b}");
    }
    // Invalid UTF-8 in the body.
    let mut s = UnixStream::connect(&d.socket).unwrap();
    s.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 15\r\nConnection: close\r\n\r\n{\"prompt\": \"\xff\"}").unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).unwrap();
    let out = String::from_utf8_lossy(&out);
    assert!(out.starts_with("HTTP/1.1 400") && out.contains("not valid UTF-8"), "{out}");
    // Chat: the model's own template, an assistant message; streamed as deltas after a role.
    let chat = r#"{"messages": [{"role": "user", "content": "What is the capital of France? Answer in one word."}], "max_tokens": 40, "temperature": 0}"#;
    let (st, b) = d.http("POST", "/v1/chat/completions", chat);
    assert_eq!(st, 200, "{b}");
    let v: Value = serde_json::from_str(&b).unwrap();
    let answer = v["choices"][0]["message"]["content"].as_str().unwrap().to_owned();
    assert!(answer.contains("Paris") && !answer.contains("<|im_end|>"), "{answer}");
    assert_eq!(v["object"], "chat.completion");
    let (_, b) = d.http(
        "POST",
        "/v1/chat/completions",
        &chat.replace(r#""temperature": 0"#, r#""temperature": 0, "stream": true"#),
    );
    let chunks: Vec<Value> = b
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|l| *l != "[DONE]")
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let streamed: String = chunks[1..].iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(streamed, answer);
    let (st, _) = d.http("POST", "/v1/chat/completions", r#"{"messages": [{"role": "user"}]}"#);
    assert_eq!(st, 400);
    let (st, b) = d.http("POST", "/tokenize", r#"{"content": "Hello 12 world"}"#);
    assert_eq!((st, b.as_str()), (200, r#"{"tokens":[19556,216,33,34,905]}"#));
    let (st, b) = d.http("POST", "/detokenize", r#"{"tokens": [19556, 216, 33, 34, 905]}"#);
    assert_eq!((st, b.as_str()), (200, r#"{"content":"Hello 12 world"}"#));
    // Special-token text is read as the special tokens unless `parse_special` is false (as
    // llama-server's /tokenize); raw prompts read it so, and prompts come as token ids too.
    let ids = |body: &str| -> Vec<Value> {
        let (st, b) = d.http("POST", "/tokenize", body);
        assert_eq!(st, 200, "{b}");
        serde_json::from_str::<Value>(&b).unwrap()["tokens"].as_array().unwrap().clone()
    };
    let parsed = ids(r#"{"content": "<|im_start|>user"}"#);
    assert_eq!(parsed[0], 1, "<|im_start|> is token 1: {parsed:?}");
    let plain = ids(r#"{"content": "<|im_start|>user", "parse_special": false}"#);
    assert!(plain.len() > parsed.len() + 2 && plain[0] != 1, "{plain:?}");
    assert_eq!(
        ids(r#"{"content": "<|im_start|>user", "with_pieces": true}"#)[0],
        json!({"id": 1, "piece": "<|im_start|>"})
    );
    let turn = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n";
    let complete = |prompt: String| {
        let (st, b) = d.http(
            "POST",
            "/v1/completions",
            &format!(r#"{{"prompt": {prompt}, "max_tokens": 10, "temperature": 0}}"#),
        );
        assert_eq!(st, 200, "{b}");
        serde_json::from_str::<Value>(&b).unwrap()
    };
    let by_text = complete(json!(turn).to_string());
    let turn_ids = ids(&json!({ "content": turn }).to_string());
    assert_eq!(by_text["usage"]["prompt_tokens"], turn_ids.len(), "the raw prompt's specials are tokens");
    assert!(by_text["choices"][0]["text"].as_str().unwrap().contains("Paris"), "{by_text}");
    let by_ids = complete(json!(turn_ids).to_string());
    assert_eq!(by_ids["choices"][0]["text"], by_text["choices"][0]["text"]);
    assert_eq!(complete(json!([turn_ids]).to_string())["choices"], by_ids["choices"], "a list of one prompt");
    let (st, b) = d.http("POST", "/v1/completions", r#"{"prompt": ["a", "b"]}"#);
    assert!(st == 400 && b.contains("prompt lists 2 prompts"), "{b}");
    let (st, b) = d.http("POST", "/v1/completions", r#"{"prompt": [1, 99999999]}"#);
    assert!(st == 400 && b.contains("token ids below"), "{b}");
    let (_, b) = d.http("GET", "/v1/models", "");
    let v: Value = serde_json::from_str(&b).unwrap();
    assert_eq!(v["data"][0]["id"], "SmolLM2-135M-Instruct.Q4_1");
    // One model by id, as the list gives it; unknown ids, routes and methods are JSON errors.
    let (st, b) = d.http("GET", "/v1/models/SmolLM2-135M-Instruct.Q4_1", "");
    let one: Value = serde_json::from_str(&b).unwrap();
    assert_eq!((st, &one), (200, &v["data"][0]));
    let (st, b) = d.http("GET", "/v1/models/nope", "");
    assert_eq!(st, 404);
    assert!(serde_json::from_str::<Value>(&b).unwrap()["error"]["message"].as_str().unwrap().contains("nope"), "{b}");
    let (st, b) = d.http("POST", "/v1/nowhere", "{}");
    assert_eq!(st, 404);
    assert!(
        serde_json::from_str::<Value>(&b).unwrap()["error"]["message"].as_str().unwrap().contains("/v1/nowhere"),
        "{b}"
    );
    let (st, b) = d.http("DELETE", "/v1/chat/completions", "");
    assert_eq!(st, 405);
    assert!(serde_json::from_str::<Value>(&b).unwrap()["error"]["message"].is_string(), "{b}");

    // Status: KV blocks, requests, strategies, uptime. (The stop-string requests' ends
    // reach the engine a moment after their answers.)
    wait_for("idle", Duration::from_secs(10), || d.status()["models"][0]["requests"]["running"] == 0);
    let s = d.status();
    let m = &s["models"][0];
    assert!(m["kv_blocks"]["total"].as_u64().unwrap() > 100, "{s}");
    assert_eq!(m["requests"]["running"], 0);
    assert!(m["requests"]["finished"].as_u64().unwrap() >= 5, "{s}");
    assert_eq!(m["requests"]["cancelled"], 0, "requests ended by a stop string count as finished: {s}");
    assert!(m["tokens"]["generated"].as_u64().unwrap() >= 20, "{s}");
    assert!(m["kv_blocks"]["cached"].as_u64().unwrap() > 0, "finished prompts stay in the prefix cache: {s}");
    assert!(m["tokens"]["prompt_cached"].as_u64().unwrap() > 0, "the repeated prompt came from the prefix cache: {s}");
    let names: Vec<&str> = s["strategies"].as_array().unwrap().iter().map(|x| x["name"].as_str().unwrap()).collect();
    assert!(names.contains(&"greedy") && names.contains(&"beam"), "{names:?}");
    assert!(s["uptime_seconds"].as_f64().unwrap() > 0.0);
    // Metrics: Prometheus text with the counters the requests above moved.
    let (st, text) = d.http("GET", "/metrics", "");
    assert_eq!(st, 200);
    let metric = |name: &str| -> f64 {
        text.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{name} missing:\n{text}"))
    };
    assert!(metric("inferd_requests_total{model=\"SmolLM2-135M-Instruct.Q4_1\",outcome=\"finished\"}") >= 5.0);
    assert!(metric("inferd_time_to_first_token_seconds_count") >= 5.0);
    assert!(metric("inferd_request_duration_seconds_bucket{model=\"SmolLM2-135M-Instruct.Q4_1\",le=\"+Inf\"}") >= 5.0);
    assert!(metric("inferd_strategy_requests_total{model=\"SmolLM2-135M-Instruct.Q4_1\",strategy=\"greedy\",outcome=\"finished\"}") >= 5.0);
    assert!(metric("inferd_kv_blocks_total") > 100.0);
    assert_eq!(metric("inferd_requests_waiting"), 0.0);
    assert!(metric("inferd_http_responses_total{route=\"/v1/completions\",status=\"400\"}") >= 9.0);
    assert!(metric("inferd_http_responses_total{route=\"/v1/completions\",status=\"404\"}") >= 2.0);
    for l in text.lines().filter(|l| !l.starts_with('#')) {
        assert!(l.rsplit(' ').next().unwrap().parse::<f64>().is_ok(), "not a sample: {l}");
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn config_sets_socket_permissions_and_per_user_limits() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let dir = scratch("limits");
    let gid = std::fs::metadata("/proc/self").unwrap().gid();
    let group = std::fs::read_to_string("/etc/group").unwrap().lines().find_map(|l| {
        let f: Vec<&str> = l.split(':').collect();
        (f.len() > 2 && f[2] == gid.to_string()).then(|| f[0].to_owned())
    });
    let group_line = group.map(|g| format!("socket_group = \"{g}\"\n")).unwrap_or_default();
    let d = Daemon::start(
        &dir,
        &format!("[server]\nsocket_mode = \"0600\"\n{group_line}[limits]\nmax_requests_per_user = 2\n"),
        &[],
    );
    let meta = std::fs::metadata(&d.socket).unwrap();
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    assert_eq!(meta.gid(), gid);
    // Two long streams use up this user's limit: a third request gets 429 and loses nothing.
    // Prompts of several blocks each, and different (no shared prefix blocks): dropping one
    // frees more blocks than the other can take in the meantime.
    let long =
        |p: &str| format!(r#"{{"prompt": "{}", "max_tokens": 2000, "temperature": 0, "stream": true}}"#, p.repeat(30));
    let a = open_stream(&d.socket, &long("Once upon a time, "));
    let b = open_stream(&d.socket, &long("In a land far away, "));
    let uid = std::fs::metadata("/proc/self").unwrap().uid();
    assert_eq!(d.status()["requests_per_user"][uid.to_string()], 2, "the peer uid is recorded per request");
    let (st, body) = d.http("POST", "/v1/completions", r#"{"prompt": "hi", "max_tokens": 1}"#);
    assert_eq!(st, 429, "{body}");
    assert!(body.contains("max_requests_per_user") && body.contains("rate_limit_error"), "{body}");
    // A client that disconnects cancels its request and frees its place and its blocks.
    // (Once both hold blocks: the streams answer their headers before the engine's first step.)
    wait_for("both requests to run", Duration::from_secs(20), || {
        let m = &d.status()["models"][0];
        m["requests"]["running"] == 2 && m["kv_blocks"]["used"].as_u64().unwrap() >= 2
    });
    let free_before = d.status()["models"][0]["kv_blocks"]["free"].as_u64().unwrap();
    drop(a);
    wait_for("the cancellation", Duration::from_secs(20), || {
        d.status()["models"][0]["requests"]["cancelled"].as_u64().unwrap() >= 1
    });
    let s = d.status();
    assert_eq!(s["models"][0]["requests"]["running"], 1, "{s}");
    assert!(s["models"][0]["kv_blocks"]["free"].as_u64().unwrap() > free_before, "{s}");
    let (st, body) = d.http("POST", "/v1/completions", r#"{"prompt": "hi", "max_tokens": 1}"#);
    assert_eq!(st, 200, "{body}");
    drop(b);
    wait_for("both cancelled", Duration::from_secs(20), || d.status()["models"][0]["requests"]["running"] == 0);
    assert_eq!(d.status()["requests_per_user"], serde_json::json!({}));
    // An unknown key in the config is an error naming the key and the file.
    let bad = dir.join("bad.toml");
    std::fs::write(&bad, "[server]\nsocket_mod = \"0600\"\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_inferd"))
        .args(["serve", "--user", "--config", bad.to_str().unwrap(), "--model", &model()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("socket_mod") && err.contains("bad.toml"), "{err}");
    drop(d);
    let _ = std::fs::remove_dir_all(dir);
}
