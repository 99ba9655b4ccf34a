//! `inferd serve` as a process, the way applications and systemd meet it: the OpenAI HTTP API on
//! a Unix socket (and the official Python client), status and metrics, per-user limits and
//! socket permissions from the config, sd_notify and signals, socket activation, and D-Bus on a
//! real `dbus-daemon` (a zbus client, `gdbus` and `busctl`).

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

mod accuracy;
mod agent;
mod bounds;
mod clients;
mod dbus;
mod fim;
mod gemma4;
mod hostile;
mod http;
mod hybrid;
mod isolation;
mod models;
mod moe;
mod reasoning;
mod remote;
mod rerank;
mod sampling;
mod soak;
mod store;
mod systemd;
mod vision;

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

/// Where tests/run installs the test's Python packages (`INFERD_TEST_PYTHONPATH` overrides).
fn test_pythonpath() -> String {
    std::env::var("INFERD_TEST_PYTHONPATH")
        .unwrap_or_else(|_| format!("{}/.cache/inferd/python", std::env::var("HOME").unwrap_or_default()))
}

/// Runs `tests/reference/tiny_models.py WHAT DIR`: tiny random-weight models of a kind into `dir`.
fn tiny_models(what: &str, dir: &Path) {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/reference/tiny_models.py");
    let out =
        Command::new("python3").arg(script).arg(what).arg(dir).env("PYTHONPATH", test_pythonpath()).output().unwrap();
    assert!(out.status.success(), "tiny_models.py {what}: {}", String::from_utf8_lossy(&out.stderr));
}

/// A JSON answer, parsed (a test fails naming the text that is not JSON).
fn json(s: &str) -> Value {
    serde_json::from_str(s).unwrap_or_else(|e| panic!("{e}: {s}"))
}

/// A fresh directory for one test (removed by a later run once this process has ended).
fn scratch(name: &str) -> PathBuf {
    inferd_e2e::temp_dir(name)
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
    /// its socket answers. The default model serves (alone) unless the config has `[[model]]`s
    /// or a `model_store`.
    fn start(dir: &Path, config: &str, env: &[(&str, &str)]) -> Daemon {
        let socket = dir.join("inferd.sock");
        let cfg = dir.join("inferd.toml");
        std::fs::write(&cfg, config).unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_inferd"));
        cmd.args(["serve", "--user", "--config", cfg.to_str().unwrap()]);
        if !config.contains("[[model]]") && !config.contains("model_store") {
            cmd.args(["--model", &model()]);
        }
        cmd.args(["--socket", socket.to_str().unwrap(), "--threads", "2"]);
        // The user's model store is this test's directory (empty unless the test fills it).
        cmd.env("XDG_DATA_HOME", dir)
            .env("XDG_STATE_HOME", dir)
            .env_remove("NOTIFY_SOCKET")
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

/// The daemon's resident memory, in MiB.
fn rss_mib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .unwrap()
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .unwrap();
    kib >> 10
}

/// One HTTP/1.1 request over a Unix socket: (status, body). Chunked bodies (SSE) keep their
/// chunk-size lines; callers read the `data: ` lines.
fn http(socket: &Path, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = UnixStream::connect(socket).unwrap();
    // The daemon may answer (413) and close before a large body is all written: the write
    // fails, the answer is read all the same.
    let _ = write!(s, "{method} {path} HTTP/1.1\r\nHost: inferd\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len());
    let mut out = Vec::new();
    // Closing with part of the body unread resets the connection: the answer already read
    // stands, only the end of the stream is an error then.
    if let Err(e) = s.read_to_end(&mut out) {
        assert!(e.kind() == std::io::ErrorKind::ConnectionReset && !out.is_empty(), "{e}");
    }
    let out = String::from_utf8_lossy(&out).into_owned();
    let status = out.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = out.split_once("\r\n\r\n").map(|x| x.1.to_owned()).unwrap_or_default();
    (status, body)
}

/// A streaming request left open: the connection, after the response headers.
fn open_stream(socket: &Path, body: &str) -> UnixStream {
    open_stream_at(socket, "/v1/completions", body)
}

/// A POST sent on a connection of its own, nothing read back yet.
fn send_post(socket: &Path, route: &str, body: &str) -> UnixStream {
    let mut s = UnixStream::connect(socket).unwrap();
    write!(
        s,
        "POST {route} HTTP/1.1\r\nHost: inferd\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    s
}

/// Whether the test runs as root (to act as another user); if not, it says it is skipped.
fn root_or_skip() -> bool {
    let root = inferd::serve::config::effective_uid() == Some(0);
    if !root {
        eprintln!("skipped: needs root to act as another user");
    }
    root
}

/// [`open_stream`] on another route.
fn open_stream_at(socket: &Path, route: &str, body: &str) -> UnixStream {
    let mut s = send_post(socket, route, body);
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
