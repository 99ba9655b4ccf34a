//! Several models in one daemon, each with its engine, and a bound draft model; a backend that
//! cannot run a model stops the start with the reason.

use super::*;

#[test]
fn several_models_each_with_its_engine_and_a_bound_draft_model() {
    let dir = scratch("models");
    let m = model();
    let cfg = format!("[[model]]\npath = \"{m}\"\nname = \"a\"\nkv_cache_mib = 64\ndraft = \"{m}\"\n\n[[model]]\npath = \"{m}\"\nname = \"b\"\nkv_cache_mib = 32\ncontext_len = 512\nbackend = \"cpu\"\n");
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
        .env("XDG_DATA_HOME", &dir)
        .env("XDG_STATE_HOME", &dir)
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
    // Where each runs and why: "a" left the choice to auto, "b" asked for the CPU.
    let backend = |i: usize| s["models"][i]["backend"].as_str().unwrap().to_string();
    assert!(backend(0).starts_with("cpu (") && backend(0).contains("auto: "), "{s}");
    assert!(backend(1).starts_with("cpu (") && backend(1).contains("configured"), "{s}");
    assert!(s["models"][0].as_object().unwrap().contains_key("device_memory"), "{s}");
    assert!(s["models"][0]["device_memory"].is_null(), "the CPU backend holds no GPU memory: {s}");
    drop(d);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_model_on_the_cuda_backend_does_not_start_where_it_cannot_run_and_says_why() {
    let dir = scratch("cuda-refused");
    let serve = |keys: &str| {
        let cfg = dir.join("inferd.toml");
        std::fs::write(&cfg, format!("[[model]]\npath = \"{}\"\n{keys}", model())).unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_inferd"))
            .args(["serve", "--user", "--config", cfg.to_str().unwrap()])
            .args(["--socket", dir.join("inferd.sock").to_str().unwrap()])
            .env("DBUS_SESSION_BUS_ADDRESS", "unix:path=/nonexistent")
            .env_remove("NOTIFY_SOCKET")
            .env_remove("LISTEN_FDS")
            .output()
            .unwrap();
        (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    // Without NVIDIA's driver (this test's machines) `cuda` is refused with a message that names
    // it, for a model and for a draft model; with one the daemon would start on the GPU.
    let driver = std::path::Path::new("/proc/driver/nvidia").exists();
    if !driver {
        let (ok, err) = serve("backend = \"cuda\"\n");
        assert!(!ok && err.contains("backend \"cuda\"") && err.contains("libcuda.so.1"), "{err}");
        let draft = format!("draft = \"{}\"\nbackend = \"cpu\"\ndraft_backend = \"cuda\"\n", model());
        let (ok, err) = serve(&draft);
        assert!(!ok && err.contains("backend \"cuda\""), "{err}");
        // `inferd bench --backend cuda` the same.
        let bench = |backend: &str| {
            let out = Command::new(env!("CARGO_BIN_EXE_inferd"))
                .args(["bench", "--model", &model(), "--backend", backend, "--repeat", "1", "--batches", "1"])
                .output()
                .unwrap();
            (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
        };
        let (ok, err) = bench("cuda");
        assert!(!ok && err.contains("libcuda.so.1"), "{err}");
        let (ok, err) = bench("tpu");
        assert!(!ok && err.contains("--backend must be"), "{err}");
    }
    let (ok, err) = serve("backend = \"gpu\"\n");
    assert!(!ok && err.contains("backend must be \"auto\", \"cpu\" or \"cuda\""), "{err}");
    let (ok, err) = serve("draft_backend = \"tpu\"\n");
    assert!(!ok && err.contains("draft_backend must be"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A model idle for its `keep_alive` leaves memory; the next request loads it again and answers
/// as before; requests that arrive while it is unloaded share one load; Ollama's `keep_alive`
/// (-1 keeps it, 0 unloads it) and `/api/ps` follow.
#[test]
fn idle_models_unload_and_load_again_on_use() {
    let dir = scratch("keep-alive");
    let cfg = format!("[server]\nkeep_alive = \"0\"\n\n[[model]]\npath = \"{}\"\nname = \"m\"\n", model());
    let d = Daemon::start(&dir, &cfg, &[]);
    let slot = |d: &Daemon| d.status()["models"][0].clone();
    let loads = |d: &Daemon| slot(d)["loads"].as_u64().unwrap();
    let body = r#"{"model": "m", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}"#;
    let text = |b: &str| serde_json::from_str::<Value>(b).unwrap()["choices"][0]["text"].as_str().unwrap().to_owned();
    let (st, first) = d.http("POST", "/v1/completions", body);
    assert_eq!(st, 200, "{first}");
    let loaded_rss = rss_mib(d.child.id());
    wait_for("the idle model to unload", Duration::from_secs(10), || slot(&d)["loaded"] == false);
    // Its engine thread ends and the memory goes back just after it leaves the listing.
    wait_for("the weights to leave memory", Duration::from_secs(10), || rss_mib(d.child.id()) + 60 <= loaded_rss);
    eprintln!("RSS: {loaded_rss} MiB loaded after a request, {} MiB unloaded", rss_mib(d.child.id()));
    let (_, listed) = d.http("GET", "/v1/models", "");
    assert!(listed.contains(r#""loaded":false"#), "{listed}");

    // The next request loads it again and answers as before.
    let before = loads(&d);
    let (st, again) = d.http("POST", "/v1/completions", body);
    assert_eq!(st, 200, "{again}");
    assert_eq!(text(&again), text(&first));
    assert_eq!(loads(&d), before + 1);

    // Requests arriving while it is unloaded wait for one load.
    wait_for("the idle model to unload", Duration::from_secs(10), || slot(&d)["loaded"] == false);
    let before = loads(&d);
    let socket = d.socket.clone();
    let answers: Vec<(u16, String)> = (0..3)
        .map(|_| {
            let s = socket.clone();
            std::thread::spawn(move || http(&s, "POST", "/v1/completions", body))
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|t| t.join().unwrap())
        .collect();
    for (st, b) in &answers {
        assert_eq!(*st, 200, "{b}");
        assert_eq!(text(b), text(&first));
    }
    assert_eq!(loads(&d), before + 1, "one load for the three requests");

    // Ollama's keep_alive: -1 keeps the model loaded, 0 unloads it; /api/ps lists it meanwhile.
    let (_, r) = d.http("POST", "/api/generate", r#"{"model": "m", "keep_alive": -1}"#);
    assert!(r.contains(r#""done_reason":"load""#), "{r}");
    std::thread::sleep(Duration::from_millis(2500));
    assert_eq!(slot(&d)["loaded"], true, "keep_alive -1 keeps it");
    let (_, ps) = d.http("GET", "/api/ps", "");
    assert!(ps.contains(r#""name":"m:latest""#) && ps.contains("9999-12-31"), "{ps}");
    let (_, r) = d.http("POST", "/api/generate", r#"{"model": "m", "keep_alive": 0}"#);
    assert!(r.contains(r#""done_reason":"unload""#), "{r}");
    wait_for("the unload", Duration::from_secs(10), || slot(&d)["loaded"] == false);
    let (_, ps) = d.http("GET", "/api/ps", "");
    assert_eq!(serde_json::from_str::<Value>(&ps).unwrap()["models"], serde_json::json!([]));
    let (st, r) = d.http("POST", "/api/generate", r#"{"model": "m", "keep_alive": "soon"}"#);
    assert!(st == 400 && r.contains("keep_alive"), "{st} {r}");
    drop(d);
    let _ = std::fs::remove_dir_all(dir);
}

/// An idle model's free KV blocks go back to the system after `kv_release_secs` (resident
/// memory falls by what the request wrote), and the next request computes the same text.
#[test]
fn idle_kv_blocks_go_back_to_the_system() {
    let dir = scratch("kv-release");
    let d = Daemon::start(&dir, "[scheduler]\nkv_release_secs = 3\n", &[]);
    // About 1000 positions of KV cache: 30 layers x 2 x 192 halves = 23 KiB each.
    let body = format!(
        r#"{{"prompt": "{}", "max_tokens": 400, "temperature": 0, "logit_bias": {{"0": -100, "1": -100, "2": -100}}}}"#,
        "The quick brown fox jumps over the lazy dog. ".repeat(60)
    );
    let (st, first) = d.http("POST", "/v1/completions", &body);
    assert_eq!(st, 200, "{first}");
    let written = rss_mib(d.child.id());
    assert!(d.status()["models"][0]["kv_blocks"]["cached"].as_u64().unwrap() > 0);
    wait_for("the release", Duration::from_secs(20), || d.status()["models"][0]["kv_blocks"]["cached"] == 0);
    let released = rss_mib(d.child.id());
    eprintln!("RSS: {written} MiB after a 1000-position request, {released} MiB once its blocks went back");
    assert!(written >= released + 15, "{written} -> {released} MiB");
    let (st, again) = d.http("POST", "/v1/completions", &body);
    assert_eq!(st, 200, "{again}");
    let text = |b: &str| serde_json::from_str::<Value>(b).unwrap()["choices"][0]["text"].as_str().unwrap().to_owned();
    assert_eq!(text(&again), text(&first), "blocks whose pages went back are written afresh");
    drop(d);
    let _ = std::fs::remove_dir_all(dir);
}
