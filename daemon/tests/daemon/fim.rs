//! Fill-in-the-middle on a real code model (Qwen2.5-Coder 0.5B Instruct, fetched by tests/run):
//! `/infill` as llama-server answers it, `suffix` through the official clients, raw prompts whose
//! special-token text is parsed, prompts as token ids; a model without FIM tokens refused by name.

use super::remote::{free_port, llama_server, tcp_http};
use super::*;

fn coder() -> PathBuf {
    let p = Path::new(&model()).with_file_name("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
    assert!(p.exists(), "{} is installed (packaging/fetch-model --model qwen-coder-0.5b)", p.display());
    p
}

const NAME: &str = "qwen2.5-coder-0.5b-instruct-q4_k_m";

/// A file with a gap, and another file of the project (`input_extra`).
fn cases() -> Vec<Value> {
    vec![
        serde_json::json!({
            "input_prefix": "import math\n\ndef area(shape, *dims):\n    \"\"\"Area of a circle, square or rectangle.\"\"\"\n    if shape == \"circle\":\n        ",
            "input_suffix": "\n    raise ValueError(f\"unknown shape {shape}\")\n",
            "input_extra": [{"filename": "shapes.py", "text": "SHAPES = [\"circle\", \"square\", \"rectangle\"]\n"}],
            "n_predict": 48, "temperature": 0,
        }),
        // Ends by itself, before n_predict.
        serde_json::json!({
            "input_prefix": "<html>\n<body>\n<h1>", "input_suffix": "</h1>\n</body>\n</html>\n",
            "n_predict": 64, "temperature": 0,
        }),
    ]
}

/// The coder model under llama-server (its port) and under a daemon whose `[server]` table
/// holds `server`; None (the test skips) where no llama-server was built.
fn coder_served_twice(name: &str, server: &str) -> Option<(Daemon, super::remote::LlamaServer, u16)> {
    let Some(bin) = llama_server() else {
        eprintln!("skipped: no llama-server (tests/build-llama-server builds one)");
        return None;
    };
    let dir = scratch(name);
    let port = free_port();
    let coder = coder();
    let theirs = super::remote::spawn_llama_server(&bin, coder.to_str().unwrap(), port, &dir, &[]);
    let config = format!("[server]\n{server}[[model]]\npath = \"{}\"\n", coder.display());
    Some((Daemon::start(&dir, &config, &[]), theirs, port))
}

#[test]
fn fill_in_the_middle_is_llama_servers_and_the_clients_suffix() {
    let Some((d, server, port)) = coder_served_twice("fim", "") else { return };
    let json = |s: &str| -> Value { serde_json::from_str(s).unwrap_or_else(|e| panic!("{e}: {s}")) };

    // `/infill`: llama-server's prompt layout (repository form, extra files) and answer shape.
    for case in cases() {
        let body = case.to_string();
        let (st, theirs) = tcp_http(port, "POST", "/infill", &body);
        assert_eq!(st, 200, "{theirs}");
        let (st, ours) = d.http("POST", "/infill", &body);
        assert_eq!(st, 200, "{ours}");
        let (theirs, ours) = (json(&theirs), json(&ours));
        assert_eq!(ours["content"], theirs["content"], "{case}");
        assert_eq!(ours["tokens_evaluated"], theirs["tokens_evaluated"], "the same prompt: {case}");
        assert_eq!(ours["stop_type"], theirs["stop_type"]);
        assert_eq!(ours["stop"], true);
        // Streamed: the same text in `{content, stop: false}` events, then the last object.
        let mut streamed = case.clone();
        streamed["stream"] = Value::Bool(true);
        let (st, events) = d.http("POST", "/infill", &streamed.to_string());
        assert_eq!(st, 200);
        let events: Vec<Value> = events.lines().filter_map(|l| l.strip_prefix("data: ")).map(json).collect();
        let (last, pieces) = events.split_last().unwrap();
        assert!(pieces.iter().all(|e| e["stop"] == false) && last["stop"] == true, "{events:?}");
        let text: String = pieces.iter().map(|e| e["content"].as_str().unwrap()).collect();
        assert_eq!(text, ours["content"].as_str().unwrap());
    }

    // `suffix` through the clients, the gap as a raw prompt in special-token text (Ollama's
    // `raw`, a completion's prompt), and as token ids: one prompt, llama-server's answer to it.
    let (prefix, suffix) = ("def is_even(n):\n    ", "\n\nprint(is_even(4))\n");
    let pylib = test_pythonpath();
    let script = format!("{}/../tests/python/fim.py", env!("CARGO_MANIFEST_DIR"));
    let out = Command::new("python3")
        .args([&script, d.socket.to_str().unwrap(), NAME, prefix, suffix])
        .env("PYTHONPATH", &pylib)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let special = format!("<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>");
    let body = serde_json::json!({ "prompt": special, "n_predict": 40, "temperature": 0 }).to_string();
    let (st, theirs) = tcp_http(port, "POST", "/completion", &body);
    assert_eq!(st, 200, "{theirs}");
    let theirs = json(&theirs);
    assert!(!theirs["content"].as_str().unwrap().is_empty());
    for k in ["ollama_suffix", "ollama_raw", "openai_suffix", "openai_special", "openai_ids"] {
        assert_eq!(v[k], theirs["content"], "{k}: {v}");
    }
    let (fim_prefix, fim_suffix, fim_middle) = (151659, 151661, 151660);
    let ids: Vec<u64> = v["tokenized"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect();
    assert_eq!(
        (ids[0], ids.iter().filter(|&&t| t == fim_suffix).count(), ids[ids.len() - 1]),
        (fim_prefix, 1, fim_middle)
    );
    assert_eq!(v["ollama_context"], v["tokenized"], "suffix builds the prompt the special text names");
    assert_eq!(v["openai_suffix_prompt_tokens"], ids.len());
    assert_eq!(theirs["tokens_evaluated"], ids.len());
    let caps = v["capabilities"].as_array().unwrap();
    assert!(caps.contains(&Value::from("insert")) && caps.contains(&Value::from("tools")), "{caps:?}");
    drop(server);
}

/// `server.infill_layout = "typed-after-middle"`: the typed text after the middle token (the
/// prompt llama-server's `/completion` answers when sent the same token ids), the suffix cut
/// to the same share whatever was typed, so a request typed further along the line takes all
/// but its newest tokens from the prefix cache, and the answers say how many.
#[test]
fn typed_text_after_the_middle_token_keeps_the_rest_cached() {
    let Some((d, server, port)) = coder_served_twice("fim-typed", "infill_layout = \"typed-after-middle\"\n") else {
        return;
    };
    let json = |s: &str| -> Value { serde_json::from_str(s).unwrap_or_else(|e| panic!("{e}: {s}")) };
    let prefix = "import math\n\n\ndef area(shape, *dims):\n    \"\"\"Area of a circle, square or rectangle.\"\"\"\n";
    // A suffix past its share (510 tokens less the typed text's, in llama-server's layout).
    let suffix: String = (0..40).map(|i| format!("\n\ndef f{i}(x):\n    return x * {i} + math.sqrt(x)\n")).collect();
    let extra = serde_json::json!([{"filename": "shapes.py", "text": "SHAPES = [\"circle\", \"square\"]\n"}]);
    let ask = |typed: &str| {
        serde_json::json!({
            "input_prefix": prefix, "input_suffix": suffix, "input_extra": extra, "prompt": typed,
            "n_predict": 16, "temperature": 0,
        })
        .to_string()
    };
    let cached = || {
        let (_, text) = d.http("GET", "/metrics", "");
        let key = format!("inferd_prompt_tokens_cached_total{{model=\"{NAME}\"}}");
        let line = text.lines().find(|l| l.starts_with(&key)).map(str::to_owned);
        line.and_then(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok())).unwrap_or(0.0)
    };
    let mut evaluated = Vec::new();
    for typed in ["    if shape == \"ci", "    if shape == \"circle\":"] {
        let before = cached();
        let (st, ours) = d.http("POST", "/infill", &ask(typed));
        assert_eq!(st, 200, "{ours}");
        let ours = json(&ours);
        let hits = cached() - before;
        // The same prompt as token ids, each part tokenized apart by llama-server.
        let ids = |text: &str| -> Vec<Value> {
            let (st, n) = tcp_http(port, "POST", "/tokenize", &serde_json::json!({ "content": text }).to_string());
            assert_eq!(st, 200, "{n}");
            json(&n)["tokens"].as_array().unwrap().clone()
        };
        let (fim_prefix, fim_middle, fim_suffix, repo, file_sep) = (151659, 151660, 151661, 151663, 151664);
        let mut special = vec![Value::from(repo)];
        special.extend(ids("myproject\n"));
        special.push(Value::from(file_sep));
        special.extend(ids("shapes.py\n"));
        special.extend(ids(extra[0]["text"].as_str().unwrap()));
        special.push(Value::from(file_sep));
        special.extend(ids("filename\n"));
        special.push(Value::from(fim_prefix));
        special.extend(ids(prefix));
        special.push(Value::from(fim_suffix));
        let suffix_ids = ids(&suffix);
        assert!(suffix_ids.len() > 600, "the suffix is longer than its share");
        special.extend_from_slice(&suffix_ids[..510]);
        special.push(Value::from(fim_middle));
        special.extend(ids(typed));
        let body = serde_json::json!({ "prompt": special, "n_predict": 16, "temperature": 0 }).to_string();
        let (st, theirs) = tcp_http(port, "POST", "/completion", &body);
        assert_eq!(st, 200, "{theirs}");
        let theirs = json(&theirs);
        assert_eq!(ours["content"], theirs["content"], "{typed:?}");
        assert_eq!(ours["tokens_evaluated"], theirs["tokens_evaluated"], "the same prompt: {typed:?}");
        assert_eq!(ours["tokens_cached"].as_f64(), Some(hits), "the answer's count is the cache's: {ours}");
        evaluated.push((ours["tokens_evaluated"].as_f64().unwrap(), hits));
    }
    // The second request shares everything before its typed text with the first: all of it
    // but the last, partly filled block comes from the cache.
    let [(first, _), (second, hits)] = evaluated[..] else { unreachable!() };
    assert!(hits >= first - 20.0 - 16.0, "{hits} of {second} prompt tokens from the cache (the first had {first})");
    // The other dialects report the same count: OpenAI's `prompt_tokens_details.cached_tokens`
    // and the Responses API's `input_tokens_details.cached_tokens`, 0 cold and all but the last
    // block of the prompt when it comes again.
    let asks = [
        (
            "/v1/completions",
            r#"{"prompt": "import math\n\n\ndef fib(n):\n    \"\"\"The n-th Fibonacci number, by the closed form of Binet: phi to the n over the square root of five, rounded to the nearest integer.\"\"\"\n", "max_tokens": 4}"#,
        ),
        ("/v1/responses", r#"{"input": "Write a Python function that reverses a string.", "max_output_tokens": 4}"#),
    ];
    for (route, body) in asks {
        let mut seen = Vec::new();
        for _ in 0..2 {
            let (st, v) = d.http("POST", route, body);
            assert_eq!(st, 200, "{v}");
            let u = json(&v)["usage"].clone();
            let (total, cached) = match route {
                "/v1/completions" => (&u["prompt_tokens"], &u["prompt_tokens_details"]["cached_tokens"]),
                _ => (&u["input_tokens"], &u["input_tokens_details"]["cached_tokens"]),
            };
            seen.push((total.as_u64().unwrap(), cached.as_u64().unwrap()));
        }
        let [(n, cold), (again, warm)] = seen[..] else { unreachable!() };
        assert_eq!((n, cold), (again, 0), "{route}: a cold prompt has nothing cached");
        assert!(warm > 0 && warm + 16 >= n, "{route}: {warm} of {n} tokens cached the second time");
    }
    drop(server);
}

#[test]
fn a_model_without_fim_tokens_is_refused_by_name() {
    let dir = scratch("fim-none");
    let d = Daemon::start(&dir, "", &[]);
    let asks = [
        ("/infill", r#"{"input_prefix": "a", "input_suffix": "b"}"#),
        ("/v1/completions", r#"{"prompt": "a", "suffix": "b", "max_tokens": 2}"#),
        ("/api/generate", r#"{"model": "SmolLM2-135M-Instruct.Q4_1", "prompt": "a", "suffix": "b", "stream": false}"#),
    ];
    for (route, body) in asks {
        let (st, b) = d.http("POST", route, body);
        assert_eq!(st, 400, "{route}: {b}");
        assert!(
            b.contains("cannot fill in the middle: the model has no fill-in-the-middle prefix, suffix, middle token"),
            "{route}: {b}"
        );
    }
    // An empty suffix asks for nothing: a plain completion.
    let (st, b) = d.http("POST", "/v1/completions", r#"{"prompt": "Hi", "suffix": "", "max_tokens": 2}"#);
    assert_eq!(st, 200, "{b}");
    let (st, b) = d.http("POST", "/api/show", r#"{"model": "SmolLM2-135M-Instruct.Q4_1"}"#);
    assert!(st == 200 && !b.contains("\"insert\""), "{b}");
}
