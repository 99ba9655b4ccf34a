//! `inferd serve` as a process, the way applications and systemd meet it: the OpenAI HTTP API on
//! a Unix socket (and the official Python client), status and metrics, per-user limits and
//! socket permissions from the config, sd_notify and signals, socket activation, and D-Bus on a
//! real `dbus-daemon` (a zbus client, `gdbus` and `busctl`).

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use serde_json::Value;
use std::io::{Read, Write};
use std::os::unix::net::{UnixDatagram, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn model() -> String {
    let p = inferd_engine::paths::default_model().expect("the default model is installed (run packaging/fetch-model)");
    p.display().to_string()
}

/// A fresh directory for one test.
fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("inferd-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn wait_for(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A running `inferd serve --user`, killed when dropped.
struct Daemon {
    child: Child,
    socket: PathBuf,
}

impl Daemon {
    /// Starts the daemon with `config` (TOML text) in `dir`, extra environment, and waits until
    /// its socket answers.
    fn start(dir: &Path, config: &str, env: &[(&str, &str)]) -> Daemon {
        let socket = dir.join("inferd.sock");
        let cfg = dir.join("inferd.toml");
        std::fs::write(&cfg, config).unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_inferd"));
        cmd.args([
            "serve",
            "--user",
            "--config",
            cfg.to_str().unwrap(),
            "--model",
            &model(),
            "--socket",
            socket.to_str().unwrap(),
            "--threads",
            "2",
        ]);
        cmd.env_remove("NOTIFY_SOCKET")
            .env_remove("LISTEN_FDS")
            .env_remove("WATCHDOG_USEC")
            .env("DBUS_SESSION_BUS_ADDRESS", "unix:path=/nonexistent");
        cmd.envs(env.iter().copied());
        let child = cmd.spawn().unwrap();
        let d = Daemon { child, socket };
        wait_for("the socket", Duration::from_secs(60), || UnixStream::connect(&d.socket).is_ok());
        d
    }

    fn http(&self, method: &str, path: &str, body: &str) -> (u16, String) {
        http(&self.socket, method, path, body)
    }

    fn status(&self) -> Value {
        serde_json::from_str(&self.http("GET", "/v1/status", "").1).unwrap()
    }

    fn signal(&self, sig: &str) {
        assert!(Command::new("kill")
            .args([&format!("-{sig}"), &self.child.id().to_string()])
            .status()
            .unwrap()
            .success());
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One HTTP/1.1 request over a Unix socket: (status, body). Chunked bodies (SSE) keep their
/// chunk-size lines; callers read the `data: ` lines.
fn http(socket: &Path, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = UnixStream::connect(socket).unwrap();
    write!(s, "{method} {path} HTTP/1.1\r\nHost: inferd\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len()).unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).unwrap();
    let out = String::from_utf8_lossy(&out).into_owned();
    let status = out.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = out.split_once("\r\n\r\n").map(|x| x.1.to_owned()).unwrap_or_default();
    (status, body)
}

/// A streaming request left open: the connection, after the response headers.
fn open_stream(socket: &Path, body: &str) -> UnixStream {
    let mut s = UnixStream::connect(socket).unwrap();
    write!(s, "POST /v1/completions HTTP/1.1\r\nHost: inferd\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
    let mut head = Vec::new();
    let mut b = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        s.read_exact(&mut b).unwrap();
        head.push(b[0]);
    }
    assert!(String::from_utf8_lossy(&head).starts_with("HTTP/1.1 200"), "{}", String::from_utf8_lossy(&head));
    s
}

/// The texts of the SSE chunks of a completion stream, then "[DONE]".
fn sse_text(body: &str) -> String {
    let mut text = String::new();
    for line in body.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if line == "[DONE]" {
            text.push_str("[DONE]");
            break;
        }
        let c: Value = serde_json::from_str(line).unwrap();
        text.push_str(c["choices"][0]["text"].as_str().unwrap_or(""));
    }
    text
}

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
    let (_, b) = d.http("GET", "/v1/models", "");
    let v: Value = serde_json::from_str(&b).unwrap();
    assert_eq!(v["data"][0]["id"], "SmolLM2-135M-Instruct.Q4_1");

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
    let long = r#"{"prompt": "Once upon a time", "max_tokens": 2000, "temperature": 0, "stream": true}"#;
    let a = open_stream(&d.socket, long);
    let b = open_stream(&d.socket, long);
    let uid = std::fs::metadata("/proc/self").unwrap().uid();
    assert_eq!(d.status()["requests_per_user"][uid.to_string()], 2, "the peer uid is recorded per request");
    let (st, body) = d.http("POST", "/v1/completions", r#"{"prompt": "hi", "max_tokens": 1}"#);
    assert_eq!(st, 429, "{body}");
    assert!(body.contains("max_requests_per_user") && body.contains("rate_limit_error"), "{body}");
    // A client that disconnects cancels its request and frees its place and its blocks.
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

/// Datagrams sent to a fake NOTIFY_SOCKET, one message per datagram.
fn notifications(sock: &UnixDatagram, until: &str, limit: Duration) -> Vec<String> {
    sock.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
    let t0 = Instant::now();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while t0.elapsed() < limit {
        if let Ok(n) = sock.recv(&mut buf) {
            let m = String::from_utf8_lossy(&buf[..n]).into_owned();
            let done = m.lines().any(|l| l == until);
            got.push(m);
            if done {
                return got;
            }
        }
    }
    panic!("no {until} within {limit:?}; got {got:?}");
}

#[test]
fn sd_notify_ready_reload_watchdog_and_a_draining_stop() {
    let dir = scratch("notify");
    let path = dir.join("notify.sock");
    let sock = UnixDatagram::bind(&path).unwrap();
    let mut d = Daemon::start(
        &dir,
        "[server]\nshutdown_grace_secs = 30\n",
        &[("NOTIFY_SOCKET", path.to_str().unwrap()), ("WATCHDOG_USEC", "400000")],
    );
    let got = notifications(&sock, "READY=1", Duration::from_secs(60));
    let ready = got.iter().find(|m| m.contains("READY=1")).unwrap();
    assert!(ready.contains("STATUS=serving SmolLM2-135M-Instruct.Q4_1"), "{ready}");
    // The engine loop's heartbeat feeds the watchdog.
    notifications(&sock, "WATCHDOG=1", Duration::from_secs(5));
    // SIGHUP: RELOADING=1 (with the monotonic time), then READY=1 again; the daemon serves on.
    d.signal("HUP");
    let got = notifications(&sock, "READY=1", Duration::from_secs(10));
    let all = got.join("\n");
    assert!(all.contains("RELOADING=1") && all.contains("MONOTONIC_USEC="), "{all}");
    assert_eq!(d.http("GET", "/health", "").0, 200);
    // SIGTERM with a request in flight: STOPPING=1, new requests get 503, the running one
    // finishes, the process exits 0.
    let mut stream =
        open_stream(&d.socket, r#"{"prompt": "Once upon a time", "max_tokens": 48, "temperature": 0, "stream": true}"#);
    d.signal("TERM");
    notifications(&sock, "STOPPING=1", Duration::from_secs(10));
    let (st, body) = d.http("POST", "/v1/completions", r#"{"prompt": "hi", "max_tokens": 1}"#);
    assert_eq!(st, 503, "{body}");
    let mut rest = Vec::new();
    stream.read_to_end(&mut rest).unwrap();
    let rest = String::from_utf8_lossy(&rest);
    assert!(
        rest.contains(r#""finish_reason":"length""#) && rest.contains("[DONE]"),
        "the in-flight request completes: {rest}"
    );
    let status = d.child.wait().unwrap();
    assert!(status.success(), "{status:?}");
    assert!(!d.socket.exists(), "the socket file is removed");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn socket_activation_serves_on_the_passed_socket() {
    let dir = scratch("activate");
    let socket = dir.join("activated.sock");
    let m = model();
    let mut child = Command::new("systemd-socket-activate")
        .args([
            "-l",
            socket.to_str().unwrap(),
            "-E",
            "HOME",
            env!("CARGO_BIN_EXE_inferd"),
            "serve",
            "--user",
            "--model",
            &m,
            "--threads",
            "2",
            "--socket",
            "/nonexistent/not-used.sock",
        ])
        .stderr(Stdio::null())
        .spawn()
        .expect("systemd-socket-activate (apt-get install systemd)");
    wait_for("the activation socket", Duration::from_secs(10), || socket.exists());
    // The first connection starts the daemon, which serves it on the inherited socket.
    let (st, body) = http(
        &socket,
        "POST",
        "/v1/completions",
        r#"{"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}"#,
    );
    assert_eq!(st, 200, "{body}");
    assert!(body.contains(" Paris."), "{body}");
    assert!(!Path::new("/nonexistent/not-used.sock").exists());
    let _ = child.kill();
    let _ = child.wait();
    let _ = Command::new("pkill").args(["-f", socket.to_str().unwrap()]).status();
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn the_official_openai_python_client_works_unchanged() {
    let dir = scratch("openai");
    let d = Daemon::start(&dir, "", &[]);
    let pylib = std::env::var("INFERD_TEST_PYTHONPATH")
        .unwrap_or_else(|_| format!("{}/.cache/inferd/python", std::env::var("HOME").unwrap_or_default()));
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/openai_client.py");
    let out = Command::new("python3").arg(script).arg(&d.socket).env("PYTHONPATH", &pylib).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the openai package is installed by tests/run into {pylib}:\n{stderr}");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["models"][0], "SmolLM2-135M-Instruct.Q4_1");
    assert_eq!(v["completion"], " Paris.\n");
    assert_eq!(v["completion_stream"], " Paris.\n");
    assert!(v["chat"].as_str().unwrap().contains("Paris"), "{v}");
    assert_eq!(v["chat"], v["chat_stream"]);
    assert_eq!(v["bad_status"], 400);
    let _ = std::fs::remove_dir_all(dir);
}

/// A session `dbus-daemon` for one test, stopped when dropped.
struct Bus {
    child: Child,
    address: String,
}

impl Bus {
    fn start(dir: &Path) -> Bus {
        let path = dir.join("bus");
        let address = format!("unix:path={}", path.display());
        let child = Command::new("dbus-daemon")
            .args(["--session", "--nofork", "--nopidfile", &format!("--address={address}")])
            .spawn()
            .expect("dbus-daemon (apt-get install dbus)");
        wait_for("the bus", Duration::from_secs(10), || UnixStream::connect(&path).is_ok());
        Bus { child, address }
    }
}

impl Drop for Bus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The lines of `<interface name="NAME">` … `</interface>` in introspection XML, trimmed.
fn interface_xml(xml: &str, name: &str) -> Vec<String> {
    let lines: Vec<String> = xml.lines().map(|l| l.trim().to_owned()).filter(|l| !l.is_empty()).collect();
    let start = lines
        .iter()
        .position(|l| *l == format!("<interface name=\"{name}\">"))
        .unwrap_or_else(|| panic!("no interface {name} in:\n{xml}"));
    let len = lines[start..].iter().position(|l| l == "</interface>").unwrap();
    lines[start..=start + len].to_vec()
}

#[test]
fn dbus_generate_complete_properties_unicast_and_introspection() {
    use zbus::zvariant::{OwnedObjectPath, Value as V};
    let dir = scratch("dbus");
    let bus = Bus::start(&dir);
    let d = Daemon::start(&dir, "", &[("DBUS_SESSION_BUS_ADDRESS", &bus.address)]);
    let busctl = |args: &[&str]| -> String {
        let out = Command::new("busctl")
            .arg(format!("--address={}", bus.address))
            .args(args)
            .output()
            .expect("busctl (apt-get install systemd)");
        assert!(out.status.success(), "busctl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    wait_for("the bus name", Duration::from_secs(20), || {
        Command::new("busctl")
            .arg(format!("--address={}", bus.address))
            .args(["status", "org.inferd.Inference1"])
            .output()
            .is_ok_and(|o| o.status.success())
    });
    // An independent client: gdbus for Complete, busctl for properties and Tokenize.
    let out = Command::new("gdbus")
        .args([
            "call",
            "--session",
            "--dest",
            "org.inferd.Inference1",
            "--object-path",
            "/org/inferd/Inference1",
            "--method",
            "org.inferd.Inference1.Complete",
            "",
            "The capital of France is",
            "{'max_tokens': <uint32 3>, 'temperature': <0.0>}",
        ])
        .env("DBUS_SESSION_BUS_ADDRESS", &bus.address)
        .output()
        .expect("gdbus (apt-get install libglib2.0-bin)");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        r"(' Paris.\n',)",
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        busctl(&["get-property", "org.inferd.Inference1", "/org/inferd/Inference1", "org.inferd.Inference1", "Models"])
            .trim(),
        r#"as 1 "SmolLM2-135M-Instruct.Q4_1""#
    );
    assert!(busctl(&[
        "get-property",
        "org.inferd.Inference1",
        "/org/inferd/Inference1",
        "org.inferd.Inference1",
        "Strategies"
    ])
    .contains("\"greedy\""));
    assert!(busctl(&[
        "get-property",
        "org.inferd.Inference1",
        "/org/inferd/Inference1",
        "org.inferd.Inference1",
        "Status"
    ])
    .contains("\"state\" s \"ready\""));
    assert_eq!(
        busctl(&[
            "call",
            "org.inferd.Inference1",
            "/org/inferd/Inference1",
            "org.inferd.Inference1",
            "Tokenize",
            "ss",
            "",
            "Hello 12 world"
        ])
        .trim(),
        "au 5 19556 216 33 34 905"
    );
    let bad = Command::new("busctl")
        .arg(format!("--address={}", bus.address))
        .args([
            "call",
            "org.inferd.Inference1",
            "/org/inferd/Inference1",
            "org.inferd.Inference1",
            "Complete",
            "ssa{sv}",
            "",
            "hi",
            "1",
            "temperature",
            "d",
            "9",
        ])
        .output()
        .unwrap();
    assert!(
        !bad.status.success() && String::from_utf8_lossy(&bad.stderr).contains("temperature must be between 0 and 2"),
        "{}",
        String::from_utf8_lossy(&bad.stderr)
    );

    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        use tokio_stream::StreamExt;
        let connect =
            || async { zbus::connection::Builder::address(bus.address.as_str()).unwrap().build().await.unwrap() };
        let caller = connect().await;
        let other = connect().await;
        // Another connection asks for every Request signal: it must get none of the caller's.
        zbus::fdo::DBusProxy::new(&other)
            .await
            .unwrap()
            .add_match_rule(
                zbus::MatchRule::try_from("type='signal',interface='org.inferd.Inference1.Request'").unwrap(),
            )
            .await
            .unwrap();
        let mut snoop = zbus::MessageStream::from(&other);
        let mut mine = zbus::MessageStream::from(&caller);
        let opts = std::collections::HashMap::from([("max_tokens", V::U32(8)), ("temperature", V::F64(0.0))]);
        let reply = caller
            .call_method(
                Some("org.inferd.Inference1"),
                "/org/inferd/Inference1",
                Some("org.inferd.Inference1"),
                "Generate",
                &("", "The capital of France is", &opts),
            )
            .await
            .unwrap();
        let path: OwnedObjectPath = reply.body().deserialize().unwrap();
        assert!(path.as_str().starts_with("/org/inferd/Inference1/request/"), "{path}");
        let (mut text, mut ids, mut reason) = (String::new(), Vec::new(), String::new());
        let t0 = Instant::now();
        while reason.is_empty() {
            assert!(t0.elapsed() < Duration::from_secs(60), "no Finished signal");
            let Ok(Some(Ok(msg))) = tokio::time::timeout(Duration::from_secs(30), mine.next()).await else { continue };
            let h = msg.header();
            if h.message_type() != zbus::message::Type::Signal || h.path().map(|p| p.as_str()) != Some(path.as_str()) {
                continue;
            }
            match h.member().map(|m| m.as_str()) {
                Some("Token") => {
                    let (t, id): (String, u32) = msg.body().deserialize().unwrap();
                    text.push_str(&t);
                    ids.push(id);
                }
                Some("Finished") => {
                    let (r, usage): (String, std::collections::HashMap<String, zbus::zvariant::OwnedValue>) =
                        msg.body().deserialize().unwrap();
                    assert_eq!(u32::try_from(&usage["completion_tokens"]).unwrap(), 8);
                    reason = r;
                }
                Some("Failed") => panic!("failed: {:?}", msg.body().deserialize::<String>()),
                _ => {}
            }
        }
        let (_, body) = d.http(
            "POST",
            "/v1/completions",
            r#"{"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}"#,
        );
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(text, v["choices"][0]["text"].as_str().unwrap(), "the same text as over HTTP");
        assert_eq!(reason, "length");
        assert!(!ids.is_empty());
        while let Ok(Some(Ok(msg))) = tokio::time::timeout(Duration::from_millis(300), snoop.next()).await {
            let h = msg.header();
            assert!(
                !(h.message_type() == zbus::message::Type::Signal
                    && h.interface().is_some_and(|i| i.as_str() == "org.inferd.Inference1.Request")),
                "another connection received the caller's signal {:?}",
                h.member()
            );
        }

        // The introspection data the daemon serves is the checked-in XML, for both interfaces.
        let long = std::collections::HashMap::from([("max_tokens", V::U32(3000)), ("temperature", V::F64(0.0))]);
        let reply = caller
            .call_method(
                Some("org.inferd.Inference1"),
                "/org/inferd/Inference1",
                Some("org.inferd.Inference1"),
                "Generate",
                &("", "Once upon a time", &long),
            )
            .await
            .unwrap();
        let req: OwnedObjectPath = reply.body().deserialize().unwrap();
        let checked_in =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/dbus/org.inferd.Inference1.xml")).unwrap();
        let introspect = |p: String| {
            let c = caller.clone();
            async move {
                let r = c
                    .call_method(
                        Some("org.inferd.Inference1"),
                        p.as_str(),
                        Some("org.freedesktop.DBus.Introspectable"),
                        "Introspect",
                        &(),
                    )
                    .await
                    .unwrap();
                r.body().deserialize::<String>().unwrap()
            }
        };
        let root = introspect("/org/inferd/Inference1".into()).await;
        let obj = introspect(req.to_string()).await;
        assert_eq!(
            interface_xml(&root, "org.inferd.Inference1"),
            interface_xml(&checked_in, "org.inferd.Inference1"),
            "served:\n{root}"
        );
        assert_eq!(
            interface_xml(&obj, "org.inferd.Inference1.Request"),
            interface_xml(&checked_in, "org.inferd.Inference1.Request"),
            "served:\n{obj}"
        );
        // Only the caller may cancel its request; Cancel stops it.
        let denied = other
            .call_method(
                Some("org.inferd.Inference1"),
                req.as_str(),
                Some("org.inferd.Inference1.Request"),
                "Cancel",
                &(),
            )
            .await;
        assert!(denied.is_err());
        caller
            .call_method(
                Some("org.inferd.Inference1"),
                req.as_str(),
                Some("org.inferd.Inference1.Request"),
                "Cancel",
                &(),
            )
            .await
            .unwrap();
        wait_for("the cancelled request", Duration::from_secs(20), || {
            d.status()["models"][0]["requests"]["running"] == 0
        });

        // A caller that leaves the bus has its requests cancelled.
        let leaver = connect().await;
        leaver
            .call_method(
                Some("org.inferd.Inference1"),
                "/org/inferd/Inference1",
                Some("org.inferd.Inference1"),
                "Generate",
                &("", "Once upon a time", &long),
            )
            .await
            .unwrap();
        wait_for("the leaver's request to run", Duration::from_secs(20), || {
            d.status()["models"][0]["requests"]["running"] == 1
        });
        let uid = std::fs::metadata("/proc/self").map(|m| std::os::unix::fs::MetadataExt::uid(&m)).unwrap();
        assert_eq!(
            d.status()["requests_per_user"][uid.to_string()],
            1,
            "a D-Bus caller's uid counts like a socket peer's"
        );
        let cancelled = d.status()["models"][0]["requests"]["cancelled"].as_u64().unwrap();
        drop(leaver);
        wait_for("the leaver's request to be cancelled", Duration::from_secs(20), || {
            d.status()["models"][0]["requests"]["cancelled"].as_u64().unwrap() > cancelled
        });
        assert_eq!(d.status()["models"][0]["requests"]["running"], 0);
    });
    drop(d);
    drop(bus);
    let _ = std::fs::remove_dir_all(dir);
}

fn inferctl(socket: &Path, args: &[&str], stdin: &str) -> (bool, String, String) {
    // inferctl is another package of the workspace: its binary lies beside inferd's (tests/run
    // builds the whole workspace first).
    let mut child = Command::new(Path::new(env!("CARGO_BIN_EXE_inferd")).with_file_name("inferctl"))
        .arg("--socket")
        .arg(socket)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(stdin.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn inferctl_talks_to_the_daemon_and_says_when_it_cannot() {
    let dir = scratch("inferctl");
    let d = Daemon::start(&dir, "", &[]);
    let (ok, out, err) = inferctl(&d.socket, &["status"], "");
    assert!(ok, "{err}");
    assert!(
        out.contains("inferd: ready")
            && out.contains("model SmolLM2-135M-Instruct.Q4_1")
            && out.contains("KV blocks 0 used of"),
        "{out}"
    );
    let (_, out, _) = inferctl(&d.socket, &["models"], "");
    assert_eq!(out, "SmolLM2-135M-Instruct.Q4_1\ttarget\n");
    let (_, out, _) = inferctl(&d.socket, &["plugins"], "");
    assert!(out.lines().any(|l| l.starts_with("greedy\tinferd-greedy")), "{out}");
    let (_, out, _) = inferctl(&d.socket, &["tokenize", "Hello 12 world"], "");
    assert_eq!(out, "[19556,216,33,34,905]\n");
    // generate streams what the HTTP API answers.
    let (ok, out, err) = inferctl(&d.socket, &["generate", "--max-tokens", "3", "The capital of France is"], "");
    assert!(ok, "{err}");
    assert_eq!(out, " Paris.\n\n");
    let (ok, out, _) = inferctl(
        &d.socket,
        &["generate", "--chat", "--max-tokens", "40", "What is the capital of France? Answer in one word."],
        "",
    );
    assert!(ok && out.contains("Paris"), "{out}");
    let (ok, _, err) = inferctl(&d.socket, &["generate", "--decoder", "nope", "hi"], "");
    assert!(!ok && err.contains("404") && err.contains("unknown decoding strategy"), "{err}");
    // chat keeps the conversation: the second turn's prompt holds the first turn.
    let prompt_tokens = || d.status()["models"][0]["tokens"]["prompt"].as_u64().unwrap();
    let p0 = prompt_tokens();
    let (ok, out, err) = inferctl(&d.socket, &["chat", "--max-tokens", "8"], "My name is Ana.\n");
    assert!(ok && out.lines().count() == 1, "{out}{err}");
    let first_turn = prompt_tokens() - p0;
    let p1 = prompt_tokens();
    let (ok, out, _) = inferctl(&d.socket, &["chat", "--max-tokens", "8"], "My name is Ana.\nWhat is my name?\n");
    assert!(ok && out.lines().count() == 2, "{out}");
    let both_turns = prompt_tokens() - p1;
    assert!(
        both_turns - first_turn > first_turn + 4,
        "the second turn's prompt ({}) holds the first turn ({first_turn}) and its answer",
        both_turns - first_turn
    );
    // Clear messages when there is no daemon.
    let (ok, _, err) = inferctl(&dir.join("none.sock"), &["status"], "");
    assert!(!ok && err.contains("inferd is not running") && err.contains("none.sock"), "{err}");
    let stale = dir.join("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
    let (ok, _, err) = inferctl(&stale, &["status"], "");
    assert!(!ok && err.contains("nothing is listening"), "{err}");
    drop(d);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn several_models_each_with_its_engine_and_a_bound_draft_model() {
    let dir = scratch("models");
    let m = model();
    let cfg = format!("[[model]]\npath = \"{m}\"\nname = \"a\"\nkv_cache_mib = 64\ndraft = \"{m}\"\n\n[[model]]\npath = \"{m}\"\nname = \"b\"\nkv_cache_mib = 32\ncontext_len = 512\n");
    // No --model flag here: the models come from the config.
    let socket = dir.join("inferd.sock");
    std::fs::write(dir.join("inferd.toml"), &cfg).unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_inferd"))
        .args([
            "serve",
            "--user",
            "--config",
            dir.join("inferd.toml").to_str().unwrap(),
            "--socket",
            socket.to_str().unwrap(),
            "--threads",
            "2",
        ])
        .env("DBUS_SESSION_BUS_ADDRESS", "unix:path=/nonexistent")
        .spawn()
        .unwrap();
    let d = Daemon { child, socket };
    wait_for("the socket", Duration::from_secs(60), || UnixStream::connect(&d.socket).is_ok());
    let (_, b) = d.http("GET", "/v1/models", "");
    let v: Value = serde_json::from_str(&b).unwrap();
    let ids: Vec<&str> = v["data"].as_array().unwrap().iter().map(|x| x["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["a", "SmolLM2-135M-Instruct.Q4_1", "b"], "{b}");
    assert_eq!(v["data"][0]["roles"], serde_json::json!(["target", "speculative"]));
    assert_eq!(v["data"][1]["roles"], serde_json::json!(["draft"]));
    assert_eq!(v["data"][2]["context_length"], 512);
    // Each name reaches its own engine, with its own limits.
    let greedy = |model: &str| {
        let (st, b) = d.http(
            "POST",
            "/v1/completions",
            &format!(
                r#"{{"model": "{model}", "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}}"#
            ),
        );
        assert_eq!(st, 200, "{b}");
        serde_json::from_str::<Value>(&b).unwrap()["choices"][0]["text"].as_str().unwrap().to_owned()
    };
    assert_eq!(greedy("a"), greedy("b"));
    let long = format!(r#"{{"model": "b", "prompt": "{}", "max_tokens": 10}}"#, "hello ".repeat(600));
    let (st, b) = d.http("POST", "/v1/completions", &long);
    assert_eq!(st, 413, "{b}");
    assert_eq!(
        d.http("POST", "/v1/completions", &long.replace(r#""b""#, r#""a""#)).0,
        200,
        "a's context is the model's own"
    );
    // Larger than a's whole KV cache (64 MiB): 413 at admission, not a failure later.
    let (st, b) = d.http("POST", "/v1/completions", r#"{"model": "a", "prompt": "hi", "max_tokens": 4000, "n": 16}"#);
    assert_eq!(st, 413, "{b}");
    assert!(b.contains("KV cache blocks"), "{b}");
    // The draft model bound to "a" drafts for speculative decoding; "b" has none.
    let spec = |model: &str| {
        d.http("POST", "/v1/completions", &format!(r#"{{"model": "{model}", "prompt": "The capital of France is", "max_tokens": 6, "decoder": "speculative", "decoder_params": {{"drafter": "model", "temperature": 0}}}}"#))
    };
    let (st, b) = spec("a");
    assert_eq!(st, 200, "{b}");
    let v: Value = serde_json::from_str(&b).unwrap();
    assert_eq!(v["choices"][0]["text"].as_str().unwrap(), greedy("b"));
    assert!(v["inferd"]["stats"]["accepted_tokens"].as_f64().unwrap() > 0.0, "{b}");
    let (st, b) = spec("b");
    assert!(st == 400 && b.contains("draft"), "{st} {b}");
    let s = d.status();
    assert_eq!(s["models"].as_array().unwrap().len(), 2);
    assert!(
        s["models"][0]["kv_blocks"]["total"].as_u64().unwrap() > s["models"][1]["kv_blocks"]["total"].as_u64().unwrap(),
        "each model has the cache it was given: {s}"
    );
    drop(d);
    let _ = std::fs::remove_dir_all(dir);
}
