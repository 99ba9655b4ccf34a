//! Models that come and go: the model store listed loaded or not, loads on first use with their
//! progress in the stream, a memory budget that unloads the least recently used model, SIGHUP
//! picking up changed `[[model]]` entries without dropping requests, and `pull` / `rm` against a
//! Hugging Face-shaped server on 127.0.0.1 with an interrupted transfer to resume.

use super::*;

/// Gemma 3 270M Q4_K_M beside the default model (tests/run fetches both).
fn gemma() -> PathBuf {
    Path::new(&model()).with_file_name("gemma-3-270m-Q4_K_M.gguf")
}

fn models(d: &Daemon) -> Value {
    serde_json::from_str(&d.http("GET", "/v1/models", "").1).unwrap()
}

fn loaded(d: &Daemon, name: &str) -> bool {
    d.status()["models"].as_array().unwrap().iter().any(|m| m["name"] == name && m["loaded"] == true)
}

/// `dir/store` holding the default model and Gemma 3 270M (links to them).
fn two_model_store(dir: &Path) -> PathBuf {
    let store = dir.join("store");
    std::fs::create_dir_all(&store).unwrap();
    std::os::unix::fs::symlink(model(), store.join("SmolLM2-135M-Instruct.Q4_1.gguf")).unwrap();
    std::os::unix::fs::symlink(gemma(), store.join("gemma-3-270m-Q4_K_M.gguf")).unwrap();
    store
}

pub(super) fn ids(d: &Daemon) -> Vec<String> {
    models(d)["data"].as_array().unwrap().iter().map(|m| m["id"].as_str().unwrap().to_string()).collect()
}

#[test]
fn the_model_store_is_listed_loaded_or_not_and_loads_on_use_within_a_memory_budget() {
    let dir = scratch("store");
    let store = two_model_store(&dir);
    std::fs::write(store.join("half.gguf.partial"), "not yet").unwrap();
    // SmolLM2 takes 94 + 512 MiB, Gemma 241 + 512: not both in 900.
    let cfg = format!(
        "[server]\nmodel_store = \"{}\"\nmemory_budget_mib = 900\ndefault_model = \"SmolLM2-135M-Instruct.Q4_1\"\n",
        store.display()
    );
    let d = Daemon::start(&dir, &cfg, &[]);
    let rss_idle = rss_mib(d.child.id());

    // Listed with what their files say, none loaded.
    let v = models(&d);
    let data = v["data"].as_array().unwrap();
    assert_eq!(ids(&d), ["SmolLM2-135M-Instruct.Q4_1", "gemma-3-270m-Q4_K_M"], "the default model first: {v}");
    let (smol, gem) = (&data[0]["inferd"], &data[1]["inferd"]);
    assert!(data.iter().all(|m| m["loaded"] == false), "{v}");
    assert_eq!(smol["size"], std::fs::metadata(model()).unwrap().len());
    assert!(smol["file_type"] == "Q4_1" && smol["architecture"] == "llama" && smol["trained_context_length"] == 8192);
    assert!(gem["file_type"] == "Q4_K_M" && gem["architecture"] == "gemma3" && gem["trained_context_length"] == 32768);
    let p = gem["parameters"].as_u64().unwrap();
    assert!((260_000_000..280_000_000).contains(&p), "{p}");
    let tags: Value = serde_json::from_str(&d.http("GET", "/api/tags", "").1).unwrap();
    assert_eq!(tags["models"][1]["name"], "gemma-3-270m-Q4_K_M:latest");
    assert_eq!(tags["models"][1]["details"]["quantization_level"], "Q4_K_M");
    assert_eq!(tags["models"][1]["details"]["family"], "gemma3");

    // A streaming request without a model loads the configured default one, its progress as SSE comments
    // before the tokens.
    let (st, body) = d.http(
        "POST",
        "/v1/completions",
        r#"{"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0, "stream": true}"#,
    );
    assert_eq!(st, 200, "{body}");
    let first_data = body.find("data: ").unwrap();
    assert!(body[..first_data].contains(": loading SmolLM2-135M-Instruct.Q4_1 100%"), "{body}");
    assert_eq!(sse_text(&body), " Paris.\n[DONE]");
    assert!(loaded(&d, "SmolLM2-135M-Instruct.Q4_1"));
    let rss_loaded = rss_mib(d.child.id());
    eprintln!("RSS: {rss_idle} MiB with nothing loaded, {rss_loaded} MiB with SmolLM2 (94 MiB of weights)");
    assert!(rss_loaded > rss_idle + 60, "{rss_idle} -> {rss_loaded}");

    // Gemma does not fit beside it: SmolLM2, idle, is unloaded first. Ollama's stream carries
    // the load as status lines.
    let (st, body) = d.http(
        "POST",
        "/api/generate",
        r#"{"model": "gemma-3-270m-Q4_K_M", "prompt": "Hi", "options": {"num_predict": 3, "temperature": 0}}"#,
    );
    assert_eq!(st, 200, "{body}");
    let lines: Vec<Value> =
        body.lines().filter_map(|l| serde_json::from_str::<Value>(l).ok()).filter(Value::is_object).collect();
    let status: Vec<&Value> = lines.iter().filter(|l| l.get("status").is_some()).collect();
    assert!(status.len() >= 2, "{body}");
    assert_eq!(status[0]["status"], "loading gemma-3-270m-Q4_K_M");
    let last = status.last().unwrap();
    assert!(last["completed"] == last["total"] && last["total"] == gem["size"], "{body}");
    assert!(lines.last().unwrap()["done"] == true && lines.last().unwrap()["eval_count"] == 3, "{body}");
    assert!(loaded(&d, "gemma-3-270m-Q4_K_M"));
    assert!(!loaded(&d, "SmolLM2-135M-Instruct.Q4_1"), "the least recently used model made room");

    // A file put in the store is listed at the next look; a removed one goes.
    std::os::unix::fs::symlink(model(), store.join("copy.gguf")).unwrap();
    assert!(ids(&d).contains(&"copy".to_string()), "{:?}", ids(&d));
    let (st, b) = d.http(
        "POST",
        "/v1/completions",
        r#"{"model": "copy", "prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}"#,
    );
    assert!(st == 200 && b.contains(" Paris."), "{st} {b}");
    let (st, b) = d.http("DELETE", "/v1/models/copy", "");
    assert!(st == 200 && b.contains(r#""deleted":true"#), "{st} {b}");
    assert!(!store.join("copy.gguf").exists() && !ids(&d).contains(&"copy".to_string()));
    let (st, b) = d.http("DELETE", "/api/delete", r#"{"model": "copy:latest"}"#);
    assert!(st == 404 && b.contains("unknown model"), "{st} {b}");
    let (st, b) = d.http("POST", "/v1/completions", r#"{"model": "nope", "prompt": "x"}"#);
    assert!(st == 404 && b.contains("gemma-3-270m-Q4_K_M"), "{st} {b}");
    drop(d);

    // A model larger than the whole budget: refused with the sizes, the daemon unharmed.
    let small = format!(
        "[server]\nmodel_store = \"{}\"\nmemory_budget_mib = 300\ndefault_model = \"SmolLM2-135M-Instruct.Q4_1\"\n",
        store.display()
    );
    let d = Daemon::start(&dir, &small, &[]);
    let (st, b) = d.http("POST", "/v1/completions", r#"{"prompt": "x", "max_tokens": 1}"#);
    assert_eq!(st, 507, "{b}");
    assert!(
        b.contains("needs 606 MiB (94 MiB of weights, 512 MiB of KV cache), more than memory_budget_mib = 300"),
        "{b}"
    );
    assert_eq!(d.http("GET", "/health", "").0, 200);
    drop(d);
    let _ = std::fs::remove_dir_all(dir);
}

/// A request to model "a" for `tokens` tokens (no end of text), running when this returns.
fn run_long(d: &Daemon, tokens: u32) -> std::thread::JoinHandle<(u16, String)> {
    let socket = d.socket.clone();
    let body = format!(
        r#"{{"model": "a", "prompt": "Once upon a time", "max_tokens": {tokens}, "temperature": 0, "logit_bias": {{"0": -100, "1": -100, "2": -100}}}}"#
    );
    let long = std::thread::spawn(move || http(&socket, "POST", "/v1/completions", &body));
    wait_for("the request to run", Duration::from_secs(10), || d.status()["models"][0]["requests"]["running"] == 1);
    long
}

#[test]
fn sighup_adds_removes_and_replaces_configured_models_without_dropping_requests() {
    let dir = scratch("reload-models");
    let m = model();
    let entry =
        |name: &str, extra: &str| format!("[[model]]\npath = \"{m}\"\nname = \"{name}\"\nkv_cache_mib = 64\n{extra}\n");
    let d = Daemon::start(&dir, &(entry("a", "") + &entry("b", "")), &[]);
    assert_eq!(ids(&d), ["a", "b"]);
    // A long request to "a" runs across the reload.
    let long = run_long(&d, 300);
    std::fs::write(dir.join("inferd.toml"), entry("a", "") + &entry("c", "context_len = 512")).unwrap();
    d.signal("HUP");
    wait_for("c to load", Duration::from_secs(20), || loaded(&d, "c"));
    assert_eq!(ids(&d), ["a", "c"]);
    let (st, b) = d.http("POST", "/v1/completions", r#"{"model": "b", "prompt": "x"}"#);
    assert_eq!(st, 404, "{b}");
    let (st, b) = long.join().unwrap();
    assert_eq!(st, 200, "{b}");
    let v: Value = serde_json::from_str(&b).unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 300, "the request to the model that stayed ran to the end: {b}");
    let loads = |name: &str| {
        d.status()["models"].as_array().unwrap().iter().find(|m| m["name"] == name).unwrap()["loads"].as_u64().unwrap()
    };
    assert_eq!(loads("a"), 1, "an unchanged model is not reloaded");
    // A changed entry replaces its model; its request in flight finishes on the old one.
    let long = run_long(&d, 200);
    std::fs::write(dir.join("inferd.toml"), entry("a", "context_len = 256") + &entry("c", "context_len = 512"))
        .unwrap();
    d.signal("HUP");
    let context = |d: &Daemon| {
        models(d)["data"].as_array().unwrap().iter().find(|m| m["id"] == "a").map(|a| a["context_length"].clone())
    };
    wait_for("the new a to load", Duration::from_secs(20), || context(&d) == Some(serde_json::json!(256)));
    assert_eq!(loads("a"), 1, "the new a's first load");
    let (st, b) = long.join().unwrap();
    assert_eq!(st, 200, "{b}");
    assert_eq!(serde_json::from_str::<Value>(&b).unwrap()["usage"]["completion_tokens"], 200, "{b}");
    let (st, b) = d.http(
        "POST",
        "/v1/completions",
        &format!(r#"{{"model": "a", "prompt": "{}", "max_tokens": 4}}"#, "hello ".repeat(300)),
    );
    assert_eq!(st, 413, "the new entry's context serves: {b}");
    let _ = std::fs::remove_dir_all(dir);
}

/// The hub server, killed when dropped (a failed test leaves nothing running that holds the
/// test's output open).
pub(super) struct Hub(Child);

impl Drop for Hub {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts tests/python/hf_server.py on `root`; returns it and its base URL.
pub(super) fn hub(root: &Path, cut: Option<u64>) -> (Hub, String) {
    let port_file = root.join("port");
    let mut cmd = Command::new("python3");
    cmd.arg(concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/python/hf_server.py")).arg(root).arg(&port_file);
    if let Some(n) = cut {
        cmd.args(["--cut", &n.to_string()]);
    }
    let child = Hub(cmd.spawn().unwrap());
    wait_for("the hub server", Duration::from_secs(10), || port_file.exists());
    let port = std::fs::read_to_string(&port_file).unwrap();
    (child, format!("http://127.0.0.1:{port}"))
}

pub(super) fn pull(args: &[&str], endpoint: &str, socket: &Path) -> (bool, String, String) {
    let out = Command::new(Path::new(env!("CARGO_BIN_EXE_inferd")).with_file_name("inferctl"))
        .arg("--socket")
        .arg(socket)
        .args(args)
        .env("HF_ENDPOINT", endpoint)
        .env_remove("HF_TOKEN")
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn pull_installs_from_a_hub_resuming_an_interrupted_transfer_and_rm_removes() {
    let dir = scratch("pull");
    let root = dir.join("hub");
    std::fs::create_dir_all(root.join("org/smol-GGUF")).unwrap();
    std::fs::create_dir_all(root.join("org/bad-GGUF")).unwrap();
    std::fs::copy(model(), root.join("org/smol-GGUF/smol-Q4_1.gguf")).unwrap();
    std::fs::write(root.join("org/smol-GGUF/README.md"), "# smol\n").unwrap();
    std::fs::write(root.join("org/bad-GGUF/bad-Q4_1.gguf"), vec![7u8; 3 << 20]).unwrap();
    std::fs::write(root.join("org/bad-GGUF/bad-Q4_1.gguf.sha256"), "ab".repeat(32)).unwrap();
    let cut = 20_000_000u64;
    let (server, endpoint) = hub(&root, Some(cut));
    let store = dir.join("store");
    let cfg = format!("[server]\nmodel_store = \"{}\"\n", store.display());
    let d = Daemon::start(&dir, &cfg, &[]);
    assert!(ids(&d).is_empty());

    // The first transfer is cut: the partial file stays, nothing is installed.
    let (ok, out, err) = pull(&["pull", "hf:org/smol-GGUF:Q4_1"], &endpoint, &d.socket);
    assert!(!ok && err.contains("run the same pull again to resume"), "{out}{err}");
    let partial = store.join(".smol-Q4_1.gguf.partial");
    let got = std::fs::metadata(&partial).unwrap().len();
    assert!(got > 0 && got <= cut, "{got}");
    assert!(ids(&d).is_empty(), "a partial file is no model");
    // The second resumes from there, checks size and SHA-256, and installs it.
    let (ok, out, err) = pull(&["pull", "hf:org/smol-GGUF:Q4_1"], &endpoint, &d.socket);
    assert!(ok && out.starts_with("smol-Q4_1: installed at "), "{out}{err}");
    assert!(err.contains("[##############################] 100%"), "a progress bar: {err}");
    let log = std::fs::read_to_string(root.join("requests.log")).unwrap();
    assert!(log.contains(&format!("GET /org/smol-GGUF/resolve/main/smol-Q4_1.gguf range=bytes={got}-")), "{log}");
    assert!(std::fs::read(store.join("smol-Q4_1.gguf")).unwrap() == std::fs::read(model()).unwrap());
    assert!(!partial.exists());
    assert_eq!(ids(&d), ["smol-Q4_1"]);
    let (st, b) = d.http(
        "POST",
        "/v1/completions",
        r#"{"model": "smol-Q4_1", "prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}"#,
    );
    assert!(st == 200 && b.contains(" Paris."), "{st} {b}");
    let (ok, out, _) = pull(&["pull", "hf:org/smol-GGUF"], &endpoint, &d.socket);
    assert!(ok && out.starts_with("smol-Q4_1: already installed"), "the only GGUF file, already there: {out}");

    // A file whose hash is not the published one is refused and removed; a missing quant names
    // what there is.
    let (ok, _, err) = pull(&["pull", "hf:org/bad-GGUF"], &endpoint, &d.socket);
    assert!(
        !ok && err.contains("bad-Q4_1.gguf was not installed: its SHA-256 is") && err.contains("not abab"),
        "{err}"
    );
    assert!(!store.join(".bad-Q4_1.gguf.partial").exists() && !store.join("bad-Q4_1.gguf").exists());
    let (ok, _, err) = pull(&["pull", "hf:org/smol-GGUF:Q8_0"], &endpoint, &d.socket);
    assert!(!ok && err.contains("has no Q8_0 file; it has: smol-Q4_1.gguf"), "{err}");
    let (ok, _, err) = pull(&["pull", "hf:org/none"], &endpoint, &d.socket);
    assert!(!ok && err.contains("answered 404"), "{err}");

    // `inferd pull` without a daemon, into a store of its own.
    let other = dir.join("other-store");
    let out = Command::new(env!("CARGO_BIN_EXE_inferd"))
        .args([
            "pull",
            "--store",
            other.to_str().unwrap(),
            &format!("{endpoint}/org/smol-GGUF/resolve/main/smol-Q4_1.gguf"),
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        std::fs::metadata(other.join("smol-Q4_1.gguf")).unwrap().len() == std::fs::metadata(model()).unwrap().len()
    );

    // rm: unloaded and deleted; a second rm is an error.
    let (ok, out, err) = pull(&["rm", "smol-Q4_1"], &endpoint, &d.socket);
    assert!(ok && out == "smol-Q4_1: removed\n", "{out}{err}");
    assert!(!store.join("smol-Q4_1.gguf").exists() && ids(&d).is_empty());
    let (ok, _, err) = pull(&["rm", "smol-Q4_1"], &endpoint, &d.socket);
    assert!(!ok && err.contains("404"), "{err}");
    drop(server);
    drop(d);
    let _ = std::fs::remove_dir_all(dir);
}

/// Ollama's `/api/pull`, through the official client: the daemon fetches from the hub itself,
/// streams progress as Ollama does, resumes a cut transfer, checks the hash and installs the
/// model under its file's name; what it cannot pull is refused by name, and with no way to
/// the hub the error names `inferctl pull`.
#[test]
fn the_ollama_client_pulls_through_the_daemon() {
    let dir = scratch("api-pull");
    let root = dir.join("hub");
    std::fs::create_dir_all(root.join("org/smol-GGUF")).unwrap();
    std::fs::create_dir_all(root.join("org/bad-GGUF")).unwrap();
    std::fs::copy(model(), root.join("org/smol-GGUF/smol-Q4_1.gguf")).unwrap();
    std::fs::write(root.join("org/bad-GGUF/bad-Q4_1.gguf"), vec![7u8; 3 << 20]).unwrap();
    std::fs::write(root.join("org/bad-GGUF/bad-Q4_1.gguf.sha256"), "ab".repeat(32)).unwrap();
    let (server, endpoint) = hub(&root, Some(20_000_000));
    let store = dir.join("store");
    let cfg = format!("[server]\nmodel_store = \"{}\"\n", store.display());
    let d = Daemon::start(&dir, &cfg, &[("HF_ENDPOINT", &endpoint)]);
    let v = super::clients::python_client(&d, "ollama_pull.py");
    let size = std::fs::metadata(model()).unwrap().len();
    let sha: String = {
        use sha2::Digest;
        sha2::Sha256::digest(std::fs::read(model()).unwrap()).iter().map(|b| format!("{b:02x}")).collect()
    };

    // The cut transfer: progress, then the error as the stream's last line.
    let cut = &v["cut"];
    let parts = cut["parts"].as_array().unwrap();
    assert_eq!(parts[0]["status"], "pulling manifest", "{cut}");
    assert!(parts[1..].iter().all(|p| p["status"] == "pulling smol-Q4_1.gguf" && p["total"] == size), "{cut}");
    assert!(cut["error"]["error"].as_str().unwrap().contains("run the same pull again to resume"), "{cut}");
    let got = parts.last().unwrap()["completed"].as_u64().unwrap();
    assert!(got > 0 && got <= 20_000_000, "{cut}");

    // The resumed one starts where the cut one stopped and ends in success.
    let r = &v["resumed"];
    assert!(r["error"].is_null(), "{r}");
    let parts = r["parts"].as_array().unwrap();
    let statuses: Vec<&str> = parts.iter().map(|p| p["status"].as_str().unwrap()).collect();
    assert_eq!(statuses.first(), Some(&"pulling manifest"));
    assert_eq!(&statuses[statuses.len() - 2..], ["verifying sha256 digest", "success"], "{r}");
    let bytes: Vec<&Value> = parts.iter().filter(|p| p["status"] == "pulling smol-Q4_1.gguf").collect();
    assert!(bytes.len() > 2 && bytes.iter().all(|p| p["digest"] == format!("sha256:{sha}")), "{r}");
    let done: Vec<u64> = bytes.iter().map(|p| p["completed"].as_u64().unwrap()).collect();
    assert!(done[0] >= got && done.windows(2).all(|w| w[0] <= w[1]) && *done.last().unwrap() == size, "{done:?}");
    let log = std::fs::read_to_string(root.join("requests.log")).unwrap();
    assert!(log.contains("GET /org/smol-GGUF/resolve/main/smol-Q4_1.gguf range=bytes="), "a resume: {log}");
    assert!(std::fs::read(store.join("smol-Q4_1.gguf")).unwrap() == std::fs::read(model()).unwrap());
    assert!(!store.join(".smol-Q4_1.gguf.partial").exists());
    assert!(v["tags"].as_array().unwrap().iter().any(|t| t == "smol-Q4_1:latest"), "{v}");
    assert_eq!(v["generate"], " Paris.\n", "the pulled model serves: {v}");
    assert_eq!(v["again"], "success");

    let refused = &v["refused"];
    let says = |name: &str, status: u16, text: &str| {
        let e = &refused[name];
        assert!(e["status"] == status && e["error"].as_str().unwrap().contains(text), "{name}: {e}");
    };
    says("llama3.2", 400, "not from Ollama's registry");
    says("hf.co/org/none", 404, "answered 404");
    says("hf.co/org/smol-GGUF:Q8_0", 400, "has no Q8_0 file; it has: smol-Q4_1.gguf");
    says("hf.co/org/bad-GGUF", 422, "where the source lists abab");
    assert!(!store.join("bad-Q4_1.gguf").exists() && !store.join(".bad-Q4_1.gguf.partial").exists());
    drop(server);
    drop(d);

    // A daemon that cannot reach the hub (as the system service, which has no network) says
    // what to run instead.
    let port = super::remote::free_port();
    let d = Daemon::start(&dir, &cfg, &[("HF_ENDPOINT", &format!("http://127.0.0.1:{port}"))]);
    let (st, b) = d.http("POST", "/api/pull", r#"{"model": "hf.co/org/other-GGUF", "stream": false}"#);
    assert!(st == 502 && b.contains("inferctl pull hf.co/org/other-GGUF"), "{st} {b}");
    let (st, b) = d.http("POST", "/api/pull", r#"{"model": "hf.co/org/other-GGUF", "insecure": true, "bogus": 1}"#);
    assert!(st == 400 && b.contains("bogus is not a field of a pull"), "{st} {b}");
    drop(d);
    let _ = std::fs::remove_dir_all(dir);
}

/// A reload is checked as start checks it and applied whole: a `[[model]]` path that does not
/// load once replaced the working model (503s) while the log said "reloaded"; a `keep_alive`
/// start refuses was taken; an empty file (an editor mid-write) dropped every model. Now each
/// is refused with the reason in the status, and the running model serves throughout.
#[test]
fn a_reload_start_would_refuse_changes_nothing() {
    let dir = scratch("reload-refused");
    let m = model();
    let good = format!("[[model]]\npath = \"{m}\"\nname = \"a\"\nkv_cache_mib = 64\n");
    let d = Daemon::start(&dir, &good, &[]);
    let complete = |d: &Daemon| {
        d.http(
            "POST",
            "/v1/completions",
            r#"{"model": "a", "prompt": "The capital of France is", "max_tokens": 2, "temperature": 0}"#,
        )
    };
    let reload = |d: &Daemon, text: &str| {
        let before = d.status()["reloads"]["count"].as_u64().unwrap();
        std::fs::write(dir.join("inferd.toml"), text).unwrap();
        d.signal("HUP");
        wait_for("the reload", Duration::from_secs(30), || d.status()["reloads"]["count"].as_u64() > Some(before));
        d.status()["reloads"]["last_refused"].as_str().map(str::to_string)
    };
    let missing = dir.join("missing.gguf");
    for (text, why) in [
        (format!("[[model]]\npath = \"{}\"\nname = \"a\"\n", missing.display()), "missing.gguf"),
        (good.clone() + "[[model]]\npath = \"/nonexistent/b.gguf\"\nname = \"b\"\n", "b.gguf"),
        (format!("[server]\nkeep_alive = \"soon\"\n{good}"), "server.keep_alive"),
        (good.replace("kv_cache_mib = 64", "kv_cache_mib = 64\nkeep_alive = \"soon\""), "keep_alive"),
        (String::new(), "is empty"),
        ("[[model]\n".into(), "inferd.toml"),
    ] {
        let refused = reload(&d, &text);
        assert!(refused.as_deref().is_some_and(|r| r.contains(why)), "{text:?}: {refused:?}");
        assert_eq!(ids(&d), ["a"]);
        let (st, out) = complete(&d);
        assert!(st == 200 && out.contains(" Paris."), "after {text:?}: {st} {out}");
    }
    // A good file applies, and the status says so.
    let refused = reload(&d, &(good.clone() + &good.replace("\"a\"", "\"b\"")));
    assert_eq!(refused, None);
    assert_eq!(ids(&d), ["a", "b"]);
    drop(d);
    let _ = std::fs::remove_dir_all(dir);
}

/// `inferctl` run as user `uid` (the test runs as root), with the hub as its endpoint.
fn ctl_as(uid: u32, args: &[&str], endpoint: &str, socket: &Path) -> (bool, String) {
    use std::os::unix::process::CommandExt;
    let out = Command::new(Path::new(env!("CARGO_BIN_EXE_inferd")).with_file_name("inferctl"))
        .arg("--socket")
        .arg(socket)
        .args(args)
        .env("HF_ENDPOINT", endpoint)
        .env("HOME", "/nonexistent")
        .uid(uid)
        .gid(uid)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

/// Model management is a right of its own and the store is the daemon's alone. Once any socket
/// user could delete or replace a model others used, unload it, and (the store being
/// group-writable) plant `NAME.partial -> ~victim/file` for the victim's next pull to write
/// through; a resume took whatever range the server sent (a spliced file was installed); any
/// `http://` source was fetched; a request without `model` got whichever name sorted first.
#[test]
fn model_management_is_a_right_and_the_store_the_daemons_alone() {
    if !root_or_skip() {
        return;
    }
    let nobody = 65534;
    let dir = scratch("manage");
    let root = dir.join("hub");
    std::fs::create_dir_all(root.join("org/smol-GGUF")).unwrap();
    std::fs::create_dir_all(root.join("org/spliced-GGUF")).unwrap();
    std::fs::copy(model(), root.join("org/smol-GGUF/smol-Q4_1.gguf")).unwrap();
    std::fs::copy(model(), root.join("org/spliced-GGUF/spliced-Q4_1.gguf")).unwrap();
    std::fs::write(root.join("org/spliced-GGUF/spliced-Q4_1.gguf.shift"), "4096").unwrap();
    let (server, endpoint) = hub(&root, Some(20_000_000));
    // A store once made group-writable and setgid for pulls by its users.
    let store = dir.join("store");
    std::fs::create_dir_all(&store).unwrap();
    std::fs::set_permissions(&store, std::os::unix::fs::PermissionsExt::from_mode(0o2777)).unwrap();
    std::os::unix::fs::symlink(model(), store.join("a.gguf")).unwrap();
    std::os::unix::fs::symlink(model(), store.join("b.gguf")).unwrap();
    let victim = dir.join("victim");
    std::fs::write(&victim, "precious").unwrap();
    std::os::unix::fs::symlink(&victim, store.join(".smol-Q4_1.gguf.partial")).unwrap();
    let cfg = format!("[server]\nmodel_store = \"{}\"\nsocket_mode = \"0666\"\nmanage = []\n", store.display());
    let d = Daemon::start(&dir, &cfg, &[]);
    use std::os::unix::fs::MetadataExt;
    assert_eq!(std::fs::metadata(&store).unwrap().mode() & 0o7777, 0o755, "the store is the daemon's alone");
    assert!(std::fs::symlink_metadata(store.join(".smol-Q4_1.gguf.partial")).is_err(), "left transfers go at start");

    // Without `model`, with two store models and no default: refused, naming them.
    let (st, out) = d.http("POST", "/v1/completions", r#"{"prompt": "x", "max_tokens": 1}"#);
    assert!(st == 400 && out.contains("name a model: the store holds 2 (a, b)"), "{st} {out}");

    // Another user may use the models, not manage them.
    let (ok, out) = ctl_as(
        nobody,
        &["generate", "--model", "a", "--max-tokens", "2", "The capital of France is"],
        &endpoint,
        &d.socket,
    );
    assert!(ok && out.contains("Paris"), "{out}");
    for args in [&["rm", "a"][..], &["unload", "a"], &["pull", "hf:org/smol-GGUF"]] {
        let (ok, out) = ctl_as(nobody, args, &endpoint, &d.socket);
        assert!(!ok && out.contains("403") && out.contains("server.manage"), "{args:?}: {out}");
    }
    // Ollama's /api/pull too.
    let pull_as_nobody = {
        use std::os::unix::process::CommandExt;
        let script = "import socket, sys\n\
            s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])\n\
            b = b'{\"model\": \"hf.co/org/smol-GGUF\", \"stream\": false}'\n\
            s.sendall(b'POST /api/pull HTTP/1.1\\r\\nHost: x\\r\\nConnection: close\\r\\nContent-Length: %d\\r\\n\\r\\n' % len(b) + b)\n\
            print(s.recv(65536).decode())\n";
        let out =
            Command::new("python3").arg("-c").arg(script).arg(&d.socket).uid(nobody).gid(nobody).output().unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)
    };
    assert!(pull_as_nobody.starts_with("HTTP/1.1 403") && pull_as_nobody.contains("server.manage"), "{pull_as_nobody}");
    assert_eq!(ids(&d), ["a", "b"]);
    assert!(!store.join("smol-Q4_1.gguf").exists());
    // A request's keep_alive is management too: 0 (unload) refused, others ignored.
    let generate = |uid: u32, keep: &str| {
        let body = format!(r#"{{"model": "a", "prompt": "", "keep_alive": {keep}}}"#);
        let (ok, out) = {
            use std::os::unix::process::CommandExt;
            let o = Command::new("python3")
                .args(["-c", "import socket,sys; s=socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); b=sys.argv[2].encode(); s.sendall(b'POST /api/generate HTTP/1.1\\r\\nHost: x\\r\\nContent-Type: application/json\\r\\nConnection: close\\r\\nContent-Length: %d\\r\\n\\r\\n' % len(b) + b); print(s.makefile('rb').read().decode())"])
                .arg(&d.socket)
                .arg(&body)
                .uid(uid)
                .gid(uid)
                .output()
                .unwrap();
            (o.status.success(), String::from_utf8_lossy(&o.stdout).into_owned())
        };
        assert!(ok, "{out}");
        out
    };
    let out = generate(nobody, "0");
    assert!(out.starts_with("HTTP/1.1 403") && out.contains("unloading a model"), "{out}");
    generate(nobody, "\"1s\"");
    let keep = |d: &Daemon| {
        d.status()["models"].as_array().unwrap().iter().find(|m| m["name"] == "a").unwrap()["keep_alive_seconds"]
            .clone()
    };
    assert_eq!(keep(&d), 300.0, "nobody's keep_alive is ignored");
    generate(0, "\"1h\"");
    assert_eq!(keep(&d), 3600.0, "root's applies");

    // Root pulls through the daemon: the planted link went at start; one planted now is not
    // followed (the store is the daemon's, so only root could plant it).
    std::os::unix::fs::symlink(&victim, store.join(".smol-Q4_1.gguf.partial")).unwrap();
    let (ok, out) = ctl_as(0, &["pull", "hf:org/smol-GGUF"], &endpoint, &d.socket);
    assert!(!ok && out.contains("Too many levels of symbolic links"), "{out}");
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
    std::fs::remove_file(store.join(".smol-Q4_1.gguf.partial")).unwrap();
    // Cut, then resumed, through the daemon.
    let (ok, out) = ctl_as(0, &["pull", "hf:org/smol-GGUF"], &endpoint, &d.socket);
    assert!(!ok && out.contains("run the same pull again to resume"), "{out}");
    let (ok, out) = ctl_as(0, &["pull", "hf:org/smol-GGUF"], &endpoint, &d.socket);
    assert!(ok && out.contains("smol-Q4_1: installed at"), "{out}");
    assert!(std::fs::read(store.join("smol-Q4_1.gguf")).unwrap() == std::fs::read(model()).unwrap());
    // A resume the source answers from elsewhere is refused, not spliced on.
    let (ok, out) = ctl_as(0, &["pull", "hf:org/spliced-GGUF"], &endpoint, &d.socket);
    assert!(!ok && out.contains("resume"), "{out}");
    let (ok, out) = ctl_as(0, &["pull", "hf:org/spliced-GGUF"], &endpoint, &d.socket);
    assert!(!ok && out.contains("it sent \"bytes "), "{out}");
    assert!(!store.join("spliced-Q4_1.gguf").exists());
    // http:// only to this machine; names that would hide a model; the size bound.
    let (ok, out) = ctl_as(0, &["pull", "http://example.com/m.gguf"], &endpoint, &d.socket);
    assert!(!ok && out.contains("https:// only"), "{out}");
    let (ok, out) = ctl_as(0, &["pull", &format!("{endpoint}/org/smol-GGUF/resolve/main/.gguf")], &endpoint, &d.socket);
    assert!(!ok && out.contains("does not name a .gguf file"), "{out}");
    let put = |file: &str, range: &str| {
        let mut s = UnixStream::connect(&d.socket).unwrap();
        write!(s, "PUT /v1/store/{file} HTTP/1.1\r\nHost: x\r\nContent-Range: {range}\r\nContent-Length: 10\r\nConnection: close\r\n\r\n0123456789").unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    };
    let out = put("huge.gguf", "bytes 0-9/300000000000");
    assert!(out.starts_with("HTTP/1.1 413") && out.contains("max_model_gib"), "{out}");
    let out = put(".hidden.gguf", "bytes 0-9/10");
    assert!(out.starts_with("HTTP/1.1 400") && out.contains("not a model file name"), "{out}");
    let out = put("junk.gguf", "bytes 0-9/10");
    assert!(out.starts_with("HTTP/1.1 422") && out.contains("not a model inferd reads"), "{out}");
    assert!(!store.join("junk.gguf").exists() && !store.join(".junk.gguf.partial").exists());
    // Root may remove.
    let (ok, out) = ctl_as(0, &["rm", "smol-Q4_1"], &endpoint, &d.socket);
    assert!(ok, "{out}");
    drop(server);
    drop(d);
    let _ = std::fs::remove_dir_all(dir);
}

/// Loads are per model: two cold models asked for at once load at the same time (once one
/// global lock made every cold model wait for the load in progress, however long it took).
/// Seen in `/v1/status`, polled while both load: at some moment both report `loading`.
#[test]
fn two_cold_models_load_at_once() {
    let dir = scratch("concurrent-loads");
    let store = two_model_store(&dir);
    let cfg = format!("[server]\nmodel_store = \"{}\"\ndefault_model = \"gemma-3-270m-Q4_K_M\"\n", store.display());
    let d = Daemon::start(&dir, &cfg, &[]);
    let loading = |d: &Daemon| -> Vec<String> {
        let s = d.status();
        let models = s["models"].as_array().unwrap().clone();
        models.iter().filter(|m| m["loading"].is_object()).map(|m| m["name"].as_str().unwrap().to_string()).collect()
    };
    let asks: Vec<_> = ["gemma-3-270m-Q4_K_M", "SmolLM2-135M-Instruct.Q4_1"]
        .into_iter()
        .map(|name| {
            let socket = d.socket.clone();
            let body = format!(r#"{{"model": "{name}", "prompt": "Hi", "max_tokens": 1}}"#);
            std::thread::spawn(move || http(&socket, "POST", "/v1/completions", &body))
        })
        .collect();
    let (mut most, t0) = (0, Instant::now());
    while asks.iter().any(|a| !a.is_finished()) && t0.elapsed() < Duration::from_secs(60) {
        most = most.max(loading(&d).len());
        std::thread::sleep(Duration::from_millis(5));
    }
    for a in asks {
        let (st, out) = a.join().unwrap();
        assert_eq!(st, 200, "{out}");
    }
    assert_eq!(most, 2, "the two loads never ran at the same time");
    drop(d);
    let _ = std::fs::remove_dir_all(dir);
}
