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
