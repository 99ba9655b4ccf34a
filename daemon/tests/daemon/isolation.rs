//! Plugins that crash or hang, in a running daemon: a third-party library in its helper process
//! takes down its own requests and nothing else; one loaded into the daemon (`isolate = "none"`)
//! that crashes or hangs it is quarantined when the daemon comes back, and a hung one does not
//! keep SIGTERM from completing.

use super::*;

/// Compiles the C test plugin with `defines` into `dir/plugins` and returns the config that
/// serves it next to inferd's own strategies, with `plugins` as the `[plugins]` table.
fn setup(dir: &Path, defines: &[&str], plugins: &str) -> String {
    let lib_dir = dir.join("plugins");
    std::fs::create_dir_all(&lib_dir).unwrap();
    inferd_e2e::compile_c_plugin(&lib_dir, "cgreedy", defines);
    let own = Path::new(env!("CARGO_BIN_EXE_inferd")).parent().unwrap();
    format!("plugin_dirs = [{lib_dir:?}, {own:?}]\n\n[plugins]\n{plugins}\n\n[server]\nshutdown_grace_secs = 1\n")
}

fn strategy<'a>(status: &'a Value, name: &str) -> &'a Value {
    status["strategies"].as_array().unwrap().iter().find(|s| s["name"] == name).unwrap()
}

fn refused(status: &Value) -> String {
    status["plugins_refused"].to_string()
}

const GREEDY: &str = r#"{"prompt": "The capital of France is", "max_tokens": 24, "temperature": 0}"#;
const C_GREEDY: &str = r#"{"prompt": "The capital of France is", "max_tokens": 24, "decoder": "c-greedy"}"#;

#[test]
fn an_isolated_plugin_that_crashes_fails_its_own_stream_and_nothing_else() {
    let dir = scratch("isolated-crash");
    let cfg = setup(&dir, &["FAULT_SEGV"], "call_timeout_ms = 2000");
    let d = Daemon::start(&dir, &cfg, &[]);
    let st = d.status();
    assert_eq!(strategy(&st, "c-greedy")["isolated"], true);
    assert_eq!(strategy(&st, "greedy")["isolated"], false);
    let (code, alone) = d.http("POST", "/v1/completions", GREEDY);
    assert_eq!(code, 200, "{alone}");
    // A greedy stream runs while the plugin crashes under another request.
    let mut other = open_stream(&d.socket, &GREEDY.replace('}', r#", "stream": true}"#));
    let (code, body) = d.http("POST", "/v1/completions", &C_GREEDY.replace('}', r#", "stream": true}"#));
    assert_eq!(code, 200);
    assert!(body.contains("killed by signal 11 (SIGSEGV)"), "an error event names the crash: {body}");
    let mut rest = String::new();
    let mut buf = [0u8; 4096];
    while !rest.contains("data: [DONE]") {
        let n = other.read(&mut buf).unwrap();
        assert!(n > 0, "the stream ended early: {rest}");
        rest.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    let v: Value = serde_json::from_str(&alone).unwrap();
    assert_eq!(sse_text(&rest), format!("{}[DONE]", v["choices"][0]["text"].as_str().unwrap()));
    // Quarantined now, and after a restart too.
    let (code, body) = d.http("POST", "/v1/completions", C_GREEDY);
    assert!(code >= 400 && body.contains("quarantined"), "{code} {body}");
    drop(d);
    let d = Daemon::start(&dir, &cfg, &[]);
    let st = d.status();
    assert!(refused(&st).contains("quarantined since"), "{st}");
    assert!(st["strategies"].as_array().unwrap().iter().all(|s| s["name"] != "c-greedy"));
    let (code, again) = d.http("POST", "/v1/completions", GREEDY);
    let again: Value = serde_json::from_str(&again).unwrap();
    assert_eq!((code, &again["choices"]), (200, &v["choices"]));
}

#[test]
fn a_plugin_that_crashes_the_daemon_is_not_loaded_when_it_comes_back() {
    let dir = scratch("inprocess-crash");
    let cfg = setup(&dir, &["FAULT_SEGV"], "isolate = \"none\"");
    let mut d = Daemon::start(&dir, &cfg, &[]);
    assert_eq!(strategy(&d.status(), "c-greedy")["isolated"], false);
    let mut s = UnixStream::connect(&d.socket).unwrap();
    write!(s, "POST /v1/completions HTTP/1.1\r\nHost: inferd\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{C_GREEDY}", C_GREEDY.len()).unwrap();
    let status = d.child.wait().unwrap();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(11), "{status:?}");
    let d = Daemon::start(&dir, &cfg, &[]);
    let st = d.status();
    assert!(refused(&st).contains("died of signal 11 (SIGSEGV) inside a call into it"), "{st}");
}

#[test]
fn sigterm_completes_past_a_plugin_that_hangs_the_daemon_and_the_plugin_stays_out() {
    let dir = scratch("inprocess-hang");
    let cfg = setup(&dir, &["FAULT_HANG"], "isolate = \"none\"\ncall_timeout_ms = 500");
    let mut d = Daemon::start(&dir, &cfg, &[]);
    let _stuck = open_stream(&d.socket, &C_GREEDY.replace('}', r#", "stream": true}"#));
    // Two tokens go out, then the engine thread spins in the plugin.
    std::thread::sleep(Duration::from_secs(2));
    let t0 = Instant::now();
    d.signal("TERM");
    let status = d.child.wait().unwrap();
    let took = t0.elapsed();
    // The grace time (1 s), the listeners' 5 s, then the engines' 5 s.
    assert!(took < Duration::from_secs(20), "stopped after {took:?}");
    assert!(!status.success(), "{status:?}");
    let d = Daemon::start(&dir, &cfg, &[]);
    let st = d.status();
    assert!(refused(&st).contains("had not returned after"), "{st}");
    assert_eq!(d.http("POST", "/v1/completions", GREEDY).0, 200);
}
