//! An agent's loop on a real model: Qwen2.5-Coder 1.5B Instruct (fetched by tests/run), which
//! writes its calls as fenced or bare JSON rather than in its template's `<tool_call>` tags.
//! In `auto` mode, through the official OpenAI client, each of three user turns gets its call
//! parsed (the right tool, arguments that validate against its schema, nothing left in the
//! content), the results go back, and the conversation goes on; the ollama and Anthropic
//! clients and LangChain's `bind_tools` get the same calls parsed (tests/python/agent.py).

use super::*;

#[test]
fn an_agent_loop_in_auto_mode_gets_parsed_calls_from_qwen_coder_1_5b() {
    let path = Path::new(&model()).with_file_name("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf");
    assert!(path.exists(), "{} is installed (packaging/fetch-model --model qwen-coder-1.5b)", path.display());
    let dir = scratch("agent");
    let d = Daemon::start(&dir, &format!("[[model]]\npath = \"{}\"\n", path.display()), &[]);
    let v = super::clients::python_client(&d, "agent.py");
    let turns = v["turns"].as_array().unwrap();
    assert_eq!(turns.len(), 3);
    for (t, city) in turns.iter().zip(["Paris", "Tokyo", "Rome"]) {
        assert_eq!(t["finish"], "tool_calls", "{t}");
        assert!(t["content"].is_null(), "the call is no content: {t}");
        let calls = t["calls"].as_array().unwrap();
        assert!(!calls.is_empty(), "{t}");
        for c in calls {
            assert!(c["name"] == t["tool"] && c["error"].is_null() && c["arguments"]["city"] == city, "{t}");
        }
        // What it says after the result is its own affair, but never a call left as text.
        let then = &t["then"]["content"];
        assert!(then.is_null() || !then.as_str().unwrap().contains("\"arguments\""), "{t}");
        assert!(!then.as_str().unwrap_or_default().contains("<|im_"), "no turn markers in the answer: {t}");
    }
    let o = &v["ollama"];
    assert_eq!(o["calls"], serde_json::json!([{ "name": "get_weather", "arguments": { "city": "Paris" } }]), "{o}");
    let a = &v["anthropic"];
    assert_eq!(a["stop_reason"], "tool_use", "{a}");
    assert_eq!(a["uses"], serde_json::json!([{ "name": "get_weather", "input": { "city": "Paris" } }]), "{a}");
    let lc = &v["langchain"];
    assert_eq!(
        lc["calls"],
        serde_json::json!([{ "name": "get_time", "args": { "city": "Tokyo" } }]),
        "bind_tools: {lc}"
    );
    assert_eq!(lc["content"], "", "{lc}");
    assert!(lc["after"].is_object(), "the ToolMessage went back: {lc}");
    drop(d);
    let _ = std::fs::remove_dir_all(dir);
}
