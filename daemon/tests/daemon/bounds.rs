//! What one request, one model file or one local user could do to take the daemon down or reach
//! another user's models, each tried as a hostile user would: the daemon answers with an error
//! naming the bound and goes on serving everyone else.

use super::*;

/// A schema of `n` required string properties.
fn wide_schema(n: usize) -> Value {
    let names: Vec<String> = (0..n).map(|i| format!("p{i}")).collect();
    let props: serde_json::Map<String, Value> =
        names.iter().map(|k| (k.clone(), serde_json::json!({ "type": "string" }))).collect();
    serde_json::json!({ "type": "object", "properties": props, "required": names })
}

/// A response format of 4,300 properties once overflowed a runtime thread's stack and aborted
/// the daemon; now it compiles on a thread of its own, and one past the bound is a 400.
#[test]
fn huge_schemas_are_compiled_safely_or_refused() {
    let dir = scratch("huge-schemas");
    let d = Daemon::start(&dir, "", &[]);
    let openai = |schema: &Value| {
        let body = serde_json::json!({
            "messages": [{ "role": "user", "content": "Fill the form." }],
            "max_tokens": 2,
            "response_format": { "type": "json_schema", "json_schema": { "name": "f", "schema": schema } },
        });
        d.http("POST", "/v1/chat/completions", &body.to_string())
    };
    let (st, out) = openai(&wide_schema(4_300));
    assert_eq!(st, 200, "{out}");
    let (st, out) = openai(&wide_schema(5_001));
    assert!(st == 400 && out.contains("5000 properties"), "{st} {out}");
    // Ollama's `format` and a tool's parameters go through the same bounds.
    let body = serde_json::json!({ "prompt": "Fill the form.", "stream": false,
        "format": wide_schema(5_001), "options": { "num_predict": 2 } });
    let (st, out) = d.http("POST", "/api/generate", &body.to_string());
    assert!(st == 400 && out.contains("5000 properties"), "{st} {out}");
    let tool = |name: &str, n: usize| serde_json::json!({ "type": "function", "function": { "name": name, "parameters": wide_schema(n) } });
    let body = serde_json::json!({ "messages": [{ "role": "user", "content": "Call f." }], "max_tokens": 2,
        "tools": [tool("f", 3_000), tool("g", 2_001)] });
    let (st, out) = d.http("POST", "/v1/chat/completions", &body.to_string());
    assert!(st == 400 && out.contains("properties in all"), "{st} {out}");
    let mut deep = serde_json::json!({ "type": "string" });
    for _ in 0..100 {
        deep = serde_json::json!({ "type": "array", "items": deep });
    }
    let (st, out) = openai(&deep);
    assert!(st == 400 && out.contains("nests deeper"), "{st} {out}");
    let (st, out) = d.http(
        "POST",
        "/v1/completions",
        r#"{"prompt": "The capital of France is", "max_tokens": 2, "temperature": 0}"#,
    );
    assert!(st == 200 && out.contains(" Paris."), "{out}");
    drop(d);
    let _ = std::fs::remove_dir_all(dir);
}

/// A tiny model whose chat template is `template`.
fn model_with_template(dir: &Path, name: &str, template: &str) -> PathBuf {
    use inferd_engine::model::gguf_writer::MetaValue;
    use inferd_kernels::DType;
    let spec = inferd_e2e::TinySpec::default();
    inferd_e2e::write_tiny_gguf_with(&dir.join(name), &spec, DType::Q8_0, DType::Q8_0, |w| {
        w.meta("tokenizer.chat_template", MetaValue::Str(template.into()));
    })
}

/// Templates from a model file once grew to gigabytes within their step budget (a string
/// doubled forty times) and the kernel killed the daemon; now each renders in a helper bounded
/// in memory, the request gets an error naming the budget, and the daemon stays small.
#[test]
fn templates_that_grow_without_bound_fail_alone() {
    let dir = scratch("template-bombs");
    let doubling = "{% set ns = namespace(s='abcdefgh') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}";
    let repeated = "{% set ns = namespace(l=['x' * 1000000]) %}{% for i in range(30) %}{% set ns.l = ns.l + ns.l %}{% endfor %}{{ ns.l | join('') | length }}";
    let fine = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n";
    let mut cfg = String::new();
    for (name, t) in [("doubling", doubling), ("repeated", repeated), ("fine", fine)] {
        let p = model_with_template(&dir, &format!("{name}.gguf"), t);
        cfg += &format!("[[model]]\npath = \"{}\"\nname = \"{name}\"\n\n", p.display());
    }
    let d = Daemon::start(&dir, &cfg, &[]);
    let chat = |model: &str| {
        let body =
            serde_json::json!({ "model": model, "messages": [{ "role": "user", "content": "hi" }], "max_tokens": 1 });
        d.http("POST", "/v1/chat/completions", &body.to_string())
    };
    let pid = d.child.id();
    for model in ["doubling", "repeated"] {
        let t0 = Instant::now();
        let (st, out) = chat(model);
        eprintln!("{model}: {st} in {:.2} s: {out}", t0.elapsed().as_secs_f64());
        assert!(st == 400 && out.contains("memory budget"), "{model}: {st} {out}");
        assert!(rss_mib(pid) < 400, "the daemon grew to {} MiB", rss_mib(pid));
    }
    // The same helpers go on rendering good templates, concurrently.
    let answers: Vec<(u16, String)> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..4).map(|_| s.spawn(|| chat("fine"))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (st, out) in answers {
        assert_eq!(st, 200, "{out}");
    }
    drop(d);
    let _ = std::fs::remove_dir_all(dir);
}

/// A helper renders exactly what the template renders in process (messages, calls, tools, key
/// order), and what that costs per rendering once a helper is warm.
#[test]
fn a_helper_renders_what_the_template_renders_in_process() {
    use inferd_engine::chat::{ChatMessage, ChatTemplate};
    use inferd_engine::template_host::{Template, TemplateHost};
    use inferd_engine::tools::{Tool, ToolCall};
    let src = "{% for m in messages %}[{{ m.role }}|{{ m.content }}{% if m.tool_calls is defined %}{{ m.tool_calls | tojson }}{% endif %}{% if m.name is defined %}|{{ m.name }}{% endif %}]{% endfor %}{% if tools %}{{ tools | tojson }}{% endif %}{% if add_generation_prompt %}{{ bos_token }}>{% endif %}{{ eos_token }}";
    let tools = vec![Tool {
        name: "get_weather".into(),
        description: Some("Weather é 😀".into()),
        parameters: serde_json::from_str(
            r#"{"type": "object", "properties": {"z": {"type": "string"}, "a": {"enum": [1, 2]}}}"#,
        )
        .unwrap(),
    }];
    let mut call = ChatMessage::new("assistant", "");
    call.tool_calls =
        vec![ToolCall { id: "c1".into(), name: "get_weather".into(), arguments: r#"{"z": "Paris"}"#.into() }];
    let mut answer = ChatMessage::new("tool", "18 C");
    answer.tool_call_id = Some("c1".into());
    answer.name = Some("get_weather".into());
    let msgs = vec![ChatMessage::new("system", "Be brief."), ChatMessage::new("user", "Weather?"), call, answer];
    let here = ChatTemplate::new(Some(src), "<s>".into(), "</s>".into())
        .unwrap()
        .render_with_tools(&msgs, &tools, true)
        .unwrap();
    let host = TemplateHost::new(env!("CARGO_BIN_EXE_inferd").into());
    let there = host
        .render(Template { source: Some(src), bos: "<s>", eos: "</s>" }, &msgs, &tools, &Default::default(), true)
        .unwrap();
    assert_eq!(here, there);
    let chatml =
        host.render(Template { source: None, bos: "", eos: "" }, &msgs[..2], &[], &Default::default(), false).unwrap();
    assert_eq!(
        chatml,
        ChatTemplate::new(None, String::new(), String::new()).unwrap().render(&msgs[..2], false).unwrap()
    );
    let e = host
        .render(
            Template { source: Some("{{ raise_exception('no tools here') }}"), bos: "", eos: "" },
            &msgs,
            &[],
            &Default::default(),
            true,
        )
        .unwrap_err();
    assert!(e.to_string().contains("no tools here"), "{e}");
    // A helper started from a thread that then ends (as the runtime's blocking threads do
    // when idle) serves the next rendering: it once died with that thread (the kernel's parent
    // death signal follows the forking thread), and the next request got "signal 9".
    let host = std::sync::Arc::new(TemplateHost::new(env!("CARGO_BIN_EXE_inferd").into()));
    let h = std::sync::Arc::clone(&host);
    let first = std::thread::spawn(move || {
        h.render(
            Template { source: None, bos: "", eos: "" },
            &[ChatMessage::new("user", "Hi")],
            &[],
            &Default::default(),
            true,
        )
    })
    .join()
    .unwrap();
    assert!(first.is_ok(), "{first:?}");
    std::thread::sleep(std::time::Duration::from_millis(200));
    let again = host.render(Template { source: None, bos: "", eos: "" }, &msgs[..2], &[], &Default::default(), false);
    assert_eq!(again.unwrap(), chatml, "the idle helper outlived the thread that started it");
    let t0 = Instant::now();
    for _ in 0..200 {
        host.render(Template { source: Some(src), bos: "<s>", eos: "</s>" }, &msgs, &tools, &Default::default(), true)
            .unwrap();
    }
    eprintln!("one rendering through a warm helper: {:.0} us", t0.elapsed().as_secs_f64() * 1e6 / 200.0);
}

/// The store listing once parsed a 128 MB metadata array (4.2 GB) under the model list's lock,
/// and kept what it first read of a file replaced under the same name. Now headers are read
/// within budgets, off the async workers, once per (path, size, mtime): the bomb is listed at
/// once and refused by name on use, a replaced file is read again, and the loaded model serves
/// throughout.
#[test]
fn the_store_listing_reads_headers_within_budgets_and_again_when_a_file_changes() {
    use inferd_engine::model::gguf_writer::MetaValue;
    use inferd_kernels::DType;
    let dir = scratch("store-headers");
    let store = dir.join("store");
    std::fs::create_dir_all(&store).unwrap();
    std::os::unix::fs::symlink(model(), store.join("SmolLM2-135M-Instruct.Q4_1.gguf")).unwrap();
    let tiny = |path: &Path, layers: usize| {
        let spec = inferd_e2e::TinySpec { layers, ..Default::default() };
        inferd_e2e::write_tiny_gguf_with(path, &spec, DType::Q8_0, DType::Q8_0, |_| {})
    };
    tiny(&store.join("swap.gguf"), 2);
    inferd_e2e::write_tiny_gguf_with(
        &store.join("bomb.gguf"),
        &inferd_e2e::TinySpec::default(),
        DType::Q8_0,
        DType::Q8_0,
        |w| {
            w.meta("general.junk", MetaValue::I32Array(vec![7; 33 << 20]));
        },
    );
    let d = Daemon::start(&dir, &format!("[server]\nmodel_store = \"{}\"\n", store.display()), &[]);
    let params = |d: &Daemon, name: &str| {
        let t0 = Instant::now();
        let v: Value = serde_json::from_str(&d.http("GET", "/v1/models", "").1).unwrap();
        assert!(t0.elapsed() < Duration::from_secs(2), "the listing took {:?}", t0.elapsed());
        let m = v["data"].as_array().unwrap().iter().find(|m| m["id"] == name).cloned();
        m.map(|m| m["inferd"]["parameters"].clone())
    };
    let two = params(&d, "swap").unwrap();
    assert!(two.as_u64().is_some(), "{two}");
    assert_eq!(params(&d, "bomb"), Some(Value::Null), "listed, its header unread");
    let (st, out) = d.http("POST", "/v1/completions", r#"{"model": "bomb", "prompt": "a", "max_tokens": 1}"#);
    assert!(st >= 400 && out.contains("at most 4194304"), "{st} {out}");
    let (st, out) = d.http(
        "POST",
        "/v1/completions",
        r#"{"model": "SmolLM2-135M-Instruct.Q4_1", "prompt": "The capital of France is", "max_tokens": 2, "temperature": 0}"#,
    );
    assert!(st == 200 && out.contains(" Paris."), "{out}");
    // Replaced under the same name (a pull over it): its header is read again.
    tiny(&dir.join("swap.gguf"), 4);
    std::fs::rename(dir.join("swap.gguf"), store.join("swap.gguf")).unwrap();
    let four = params(&d, "swap").unwrap();
    assert!(four.as_u64() > two.as_u64(), "{two} then {four}");
    drop(d);
    let _ = std::fs::remove_dir_all(dir);
}

/// Bodies up to the daemon's limit (16 MiB) are read and answered; one past it gets a JSON 413
/// naming the limit (once an extractor's 2 MiB default answered in plain text).
#[test]
fn bodies_past_the_limit_get_a_json_error_naming_it() {
    let dir = scratch("body-limit");
    let d = Daemon::start(&dir, "", &[]);
    let body = |mib: usize| format!(r#"{{"prompt": "{}", "max_tokens": 1}}"#, "hello world, ".repeat((mib << 20) / 13));
    let (st, out) = d.http("POST", "/v1/completions", &body(3));
    let e: Value = serde_json::from_str(&out).unwrap();
    assert!(st == 413 && e["error"]["message"].as_str().unwrap().contains("context length"), "{st} {out}");
    let (st, out) = d.http("POST", "/v1/completions", &body(17));
    let e: Value = serde_json::from_str(&out).unwrap_or_else(|_| panic!("not JSON: {out}"));
    assert_eq!(st, 413, "{out}");
    assert_eq!(e["error"]["message"], "the request body is larger than 16 MiB");
    let (st, _) = d.http("POST", "/api/generate", &body(17));
    assert_eq!(st, 413);
    assert_eq!(d.http("GET", "/health", "").0, 200);
    drop(d);
    let _ = std::fs::remove_dir_all(dir);
}
