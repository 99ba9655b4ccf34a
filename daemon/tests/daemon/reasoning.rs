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
