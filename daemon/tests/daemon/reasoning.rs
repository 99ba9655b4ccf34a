//! A thinking model's reasoning through every API: the default model with a template that
//! has a thinking switch (tests/templates/think.jinja: the block opened in the generation
//! prompt, or written closed and empty with `enable_thinking` false). What the model writes
//! inside the open block is reasoning: OpenAI's `reasoning_content`, Ollama's `thinking`,
//! Anthropic's thinking block, a Responses reasoning item; each API's switch (`reasoning_effort`,
//! `chat_template_kwargs`, `think`, `thinking`, `reasoning.effort`) reaches the template.
//! (This small model never closes the block, so every answer here is reasoning or, with the
//! switch off, content; the splitter's transitions are unit-tested in serve/reasoning.rs.)

use super::*;

#[test]
fn reasoning_is_split_off_and_each_api_switches_it() {
    let dir = scratch("reasoning");
    let template = format!("{}/../tests/templates/think.jinja", env!("CARGO_MANIFEST_DIR"));
    let m = model();
    let cfg = format!(
        "[[model]]\npath = \"{m}\"\nname = \"thinker\"\nchat_template = \"{template}\"\n\n[[model]]\npath = \"{m}\"\nname = \"plain\"\n"
    );
    let d = Daemon::start(&dir, &cfg, &[]);
    let (_, show) = d.http("POST", "/api/show", r#"{"model": "thinker"}"#);
    assert!(json(&show)["capabilities"].as_array().unwrap().contains(&Value::from("thinking")), "{show}");
    let ask = r#""model": "thinker", "messages": [{"role": "user", "content": "What is 2 + 2?"}], "max_tokens": 12, "temperature": 0"#;

    // OpenAI's chat: thinking by default; off with reasoning_effort none or the template's kwarg.
    let (st, on) = d.http("POST", "/v1/chat/completions", &format!("{{{ask}}}"));
    assert_eq!(st, 200, "{on}");
    let on = json(&on);
    let reasoning = on["choices"][0]["message"]["reasoning_content"].as_str().unwrap().to_owned();
    assert!(!reasoning.is_empty() && on["choices"][0]["message"]["content"] == "", "{on}");
    let mut off_prompt = 0;
    for switch in [r#""reasoning_effort": "none""#, r#""chat_template_kwargs": {"enable_thinking": false}"#] {
        let (st, off) = d.http("POST", "/v1/chat/completions", &format!("{{{ask}, {switch}}}"));
        assert_eq!(st, 200, "{off}");
        let off = json(&off);
        let m = &off["choices"][0]["message"];
        assert!(m["reasoning_content"].is_null() && !m["content"].as_str().unwrap().is_empty(), "{switch}: {off}");
        off_prompt = off["usage"]["prompt_tokens"].as_u64().unwrap();
        assert!(
            off_prompt > on["usage"]["prompt_tokens"].as_u64().unwrap(),
            "the closed block is in the prompt: {off}"
        );
    }
    // Streamed: the deltas' reasoning_content is the whole answer's.
    let (_, stream) = d.http("POST", "/v1/chat/completions", &format!("{{{ask}, \"stream\": true}}"));
    let streamed: String = stream
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter_map(|c| c["choices"][0]["delta"]["reasoning_content"].as_str().map(str::to_owned))
        .collect();
    assert_eq!(streamed, reasoning);

    // Ollama's `think`.
    let ollama = |think: &str| {
        let body = format!(
            r#"{{"model": "thinker", "messages": [{{"role": "user", "content": "What is 2 + 2?"}}], "stream": false, {think}"options": {{"temperature": 0, "num_predict": 12}}}}"#
        );
        let (st, out) = d.http("POST", "/api/chat", &body);
        assert_eq!(st, 200, "{out}");
        json(&out)
    };
    let v = ollama(r#""think": true, "#);
    assert_eq!(v["message"]["thinking"], reasoning.as_str(), "{v}");
    let v = ollama(r#""think": false, "#);
    assert!(v["message"]["thinking"].is_null() && !v["message"]["content"].as_str().unwrap().is_empty(), "{v}");
    assert_eq!(v["prompt_eval_count"], off_prompt);
    let (st, out) = d.http(
        "POST",
        "/api/chat",
        r#"{"model": "plain", "messages": [{"role": "user", "content": "Hi"}], "think": true}"#,
    );
    assert!(st == 400 && out.contains("does not support thinking"), "a model without the switch: {st} {out}");

    // Anthropic's thinking blocks, and a Responses reasoning item.
    let (st, out) = d.http(
        "POST",
        "/v1/messages",
        r#"{"model": "thinker", "max_tokens": 12, "temperature": 0, "thinking": {"type": "enabled", "budget_tokens": 1024},
            "messages": [{"role": "user", "content": "What is 2 + 2?"}]}"#,
    );
    assert_eq!(st, 200, "{out}");
    let v = json(&out);
    assert_eq!(
        (&v["content"][0]["type"], &v["content"][0]["thinking"]),
        (&Value::from("thinking"), &Value::from(reasoning.as_str())),
        "{v}"
    );
    let (st, out) = d.http(
        "POST",
        "/v1/messages",
        r#"{"model": "thinker", "max_tokens": 12, "temperature": 0, "thinking": {"type": "disabled"},
            "messages": [{"role": "user", "content": "What is 2 + 2?"}]}"#,
    );
    assert_eq!(st, 200, "{out}");
    assert_eq!(json(&out)["content"][0]["type"], "text", "{out}");
    let (st, out) = d.http(
        "POST",
        "/v1/responses",
        r#"{"model": "thinker", "max_output_tokens": 12, "temperature": 0, "input": "What is 2 + 2?", "store": false}"#,
    );
    assert_eq!(st, 200, "{out}");
    let v = json(&out);
    assert_eq!(
        (&v["output"][0]["type"], &v["output"][0]["content"][0]["text"]),
        (&Value::from("reasoning"), &Value::from(reasoning.as_str())),
        "{v}"
    );
    let (st, out) = d.http(
        "POST",
        "/v1/responses",
        r#"{"model": "thinker", "max_output_tokens": 12, "temperature": 0, "input": "What is 2 + 2?", "store": false, "reasoning": {"effort": "none"}}"#,
    );
    assert_eq!(st, 200, "{out}");
    assert_eq!(json(&out)["output"][0]["type"], "message", "{out}");
    drop(d);
    let _ = std::fs::remove_dir_all(dir);
}

/// Qwen3.5's and Gemma 4's own chat templates (from the llama.cpp source tests/build-llama-server
/// fetches) on the default model's vocabulary, rendered by inferd's `/apply-template` and by
/// llama-server's from the same file: the same prompt, byte for byte, thinking on and off, over
/// a system prompt, a multi-turn chat whose earlier answer carries its reasoning, and a tool
/// call with its result.
#[test]
fn qwen35_and_gemma4_templates_render_as_llama_server() {
    let Some(bin) = super::remote::llama_server() else {
        eprintln!("skipped: no llama-server (tests/build-llama-server builds one)");
        return;
    };
    let templates = bin
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("llama.cpp-src/llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates");
    let dir = scratch("templates-vs-llama");
    let tools = r#""tools": [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]"#;
    let chats = [
        r#""messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2 + 2?"}]"#.to_owned(),
        r#""messages": [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4", "reasoning_content": "Two and two."}, {"role": "user", "content": "And 3 + 3?"}]"#.to_owned(),
        format!(r#""messages": [{{"role": "user", "content": "Weather in Paris?"}}, {{"role": "assistant", "content": "", "reasoning_content": "A tool knows.", "tool_calls": [{{"id": "call_1", "type": "function", "function": {{"name": "get_weather", "arguments": "{{\"city\": \"Paris\"}}"}}}}]}}, {{"role": "tool", "tool_call_id": "call_1", "content": "sunny"}}], {tools}"#),
    ];
    for file in ["Qwen3.5-4B.jinja", "google-gemma-4-31B-it.jinja"] {
        let template = templates.join(file);
        assert!(template.exists(), "{} (tests/build-llama-server fetches it)", template.display());
        let port = super::remote::free_port();
        let _server = super::remote::spawn_llama_server(
            &bin,
            &model(),
            port,
            &dir,
            &["--jinja", "--chat-template-file", template.to_str().unwrap()],
        );
        let cfg =
            format!("[[model]]\npath = \"{}\"\nname = \"m\"\nchat_template = \"{}\"\n", model(), template.display());
        let d = Daemon::start(&dir, &cfg, &[]);
        // The switch said each time: llama-server turns thinking on where a request does not
        // say, inferd leaves the template's default (Gemma 4's is off, Qwen3.5's on).
        for (chat, think) in chats.iter().flat_map(|c| [(c, true), (c, false)]) {
            let body = format!(r#"{{"model": "m", {chat}, "chat_template_kwargs": {{"enable_thinking": {think}}}}}"#);
            let (st, ours) = d.http("POST", "/apply-template", &body);
            assert_eq!(st, 200, "{file}: {ours}");
            let (st, theirs) = super::remote::tcp_http(port, "POST", "/apply-template", &body);
            assert_eq!(st, 200, "{file}: llama-server {theirs}");
            let (ours, theirs) = (json(&ours)["prompt"].clone(), json(&theirs)["prompt"].clone());
            assert!(ours.is_string(), "{ours}");
            assert_eq!(ours, theirs, "{file}, thinking {think}: {chat}");
        }
        // A key no chat request has is refused, as on /v1/chat/completions.
        let (st, b) = d.http("POST", "/apply-template", &format!(r#"{{"model": "m", {}, "bogus": 1}}"#, chats[0]));
        assert!(st == 400 && b.contains("bogus"), "{st} {b}");
        drop(d);
    }
    let _ = std::fs::remove_dir_all(dir);
}
