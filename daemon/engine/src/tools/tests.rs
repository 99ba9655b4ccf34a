//! Formats detected from templates; calls parsed whole and streamed alike; and for every
//! syntax, what its grammar lets a model write parses back into a call of the chosen tool with
//! arguments its schema accepts (random logits under the mask, on the default model's
//! vocabulary).

use super::parse::{Delta, ToolStream};
use super::*;
use crate::constraint::mask::Masker;
use crate::tokenizer::Tokenizer;

const QWEN: &str = "{%- if tools %}{{- '<tools>' }}{%- for tool in tools %}{{ tool | tojson }}{%- endfor %}{{- '<tool_call>' }}{%- endif %}";
const LLAMA: &str = "{%- if tools is not none %}Respond in the format {\"name\": function name, \"parameters\": dictionary}{%- endif %}{{- '<|python_tag|>' }}";
const MISTRAL: &str =
    "{%- if tools is not none %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif %}[TOOL_CALLS]";

fn fmt(syntax: Syntax) -> ToolFormat {
    ToolFormat { syntax, native: true }
}

#[test]
fn formats_are_detected_from_the_chat_template() {
    assert_eq!(ToolFormat::detect(Some(QWEN)), fmt(Syntax::Hermes));
    assert_eq!(ToolFormat::detect(Some(LLAMA)), fmt(Syntax::Llama3));
    assert_eq!(ToolFormat::detect(Some(MISTRAL)), fmt(Syntax::Mistral));
    let chatml = ToolFormat::detect(None);
    assert_eq!(chatml, ToolFormat { syntax: Syntax::Hermes, native: false });
    let weather =
        Tool { name: "get_weather".into(), description: Some("Weather".into()), parameters: json!({"type": "object"}) };
    let p = chatml.system_prompt(std::slice::from_ref(&weather)).unwrap();
    assert!(p.contains("\"name\":\"get_weather\"") && p.contains("<tool_call>"), "{p}");
    assert_eq!(fmt(Syntax::Hermes).system_prompt(&[weather]), None);
}

/// The answer split as a client streaming it one character at a time would see it.
fn streamed(format: ToolFormat, text: &str) -> (String, Vec<(String, String)>) {
    streamed_by(ToolStream::new(format), text)
}

fn streamed_by(mut s: ToolStream, text: &str) -> (String, Vec<(String, String)>) {
    let mut deltas = Vec::new();
    let mut buf = [0u8; 4];
    for c in text.chars() {
        deltas.extend(s.push(c.encode_utf8(&mut buf)));
    }
    deltas.extend(s.finish());
    let mut content = String::new();
    let mut calls = Vec::new();
    for d in deltas {
        match d {
            Delta::Content(t) => content.push_str(&t),
            Delta::Call(c) => calls.push((c.name, c.arguments)),
        }
    }
    (content.trim().to_owned(), calls)
}

fn whole(format: ToolFormat, text: &str) -> (String, Vec<(String, String)>) {
    let (content, calls) = format.parse(text);
    (content, calls.into_iter().map(|c| (c.name, c.arguments)).collect())
}

#[test]
fn calls_parse_the_same_whole_and_streamed() {
    let paris = || ("get_weather".to_string(), r#"{"city":"Paris"}"#.to_string());
    let rome = || ("get_time".to_string(), r#"{"city":"Rome"}"#.to_string());
    type Case = (Syntax, &'static str, &'static str, Vec<(String, String)>);
    let cases: Vec<Case> = vec![
        (
            Syntax::Hermes,
            "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call>",
            "Let me check.",
            vec![paris(), rome()],
        ),
        (Syntax::Hermes, "No tools needed: 2 < 3.", "No tools needed: 2 < 3.", vec![]),
        // Not JSON inside the tags: it stays text.
        (Syntax::Hermes, "<tool_call>oops</tool_call>", "<tool_call>oops</tool_call>", vec![]),
        // Cut by max_tokens before the closing tag, the call is still whole.
        (Syntax::Hermes, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}", "", vec![paris()]),
        (Syntax::Llama3, "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}", "", vec![paris()]),
        (
            Syntax::Llama3,
            " {\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}; {\"name\": \"get_time\", \"parameters\": {\"city\": \"Rome\"}}",
            "",
            vec![paris(), rome()],
        ),
        (Syntax::Llama3, "{not a call}", "{not a call}", vec![]),
        (Syntax::Llama3, "Paris is sunny.", "Paris is sunny.", vec![]),
        (
            Syntax::Mistral,
            "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}, {\"name\": \"get_time\", \"arguments\": \"{\\\"city\\\":\\\"Rome\\\"}\"}]",
            "",
            vec![paris(), rome()],
        ),
        (Syntax::Mistral, "Sunny [TOOL_CALLS] maybe", "Sunny [TOOL_CALLS] maybe", vec![]),
    ];
    for (syntax, text, content, calls) in cases {
        let want = (content.to_string(), calls);
        assert_eq!(whole(fmt(syntax), text), want, "{syntax:?} whole: {text}");
        assert_eq!(streamed(fmt(syntax), text), want, "{syntax:?} streamed: {text}");
    }
    // Text before a call goes out before the call is complete.
    let mut s = ToolStream::new(fmt(Syntax::Hermes));
    assert_eq!(s.push("Checking <tool"), vec![Delta::Content("Checking ".into())]);
    assert_eq!(s.push("_call>\n{\"name\": \"f\", "), vec![]);
    let d = s.push("\"arguments\": {}}\n</tool_call>");
    assert!(matches!(&d[..], [Delta::Call(c)] if c.name == "f" && c.arguments == "{}" && c.id.starts_with("call_")));
    // Ids are distinct; Mistral's are the 9 characters its templates check.
    let (_, calls) = fmt(Syntax::Mistral)
        .parse("[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {}}, {\"name\": \"f\", \"arguments\": {}}]");
    assert!(calls.iter().all(|c| c.id.len() == 9 && c.id.chars().all(|x| x.is_ascii_alphanumeric())));
    assert_ne!(calls[0].id, calls[1].id);
}

#[test]
fn calls_written_without_the_marker_parse_when_they_name_an_offered_tool() {
    let paris = || ("get_weather".to_string(), r#"{"city":"Paris"}"#.to_string());
    let rome = || ("get_time".to_string(), r#"{"city":"Rome"}"#.to_string());
    let w = r#"{"name": "get_weather", "arguments": {"city": "Paris"}}"#;
    let t = r#"{"name": "get_time", "parameters": {"city": "Rome"}}"#;
    type Case = (Syntax, String, &'static str, Vec<(String, String)>);
    let cases: Vec<Case> = vec![
        // Qwen2.5-Coder's habits: a fenced block, a bare object, content first.
        (Syntax::Hermes, format!("```json\n{w}\n```"), "", vec![paris()]),
        (Syntax::Hermes, format!("```\n{w}\n```\n```json\n{t}\n```"), "", vec![paris(), rome()]),
        (Syntax::Hermes, format!("I'll check the weather.\n{w}"), "I'll check the weather.", vec![paris()]),
        (Syntax::Hermes, format!("```json\n[{w}, {t}]\n```"), "", vec![paris(), rome()]),
        (Syntax::Hermes, format!("{w}\n{t}"), "", vec![paris(), rome()]),
        // A block whose closing fence never came (max_tokens).
        (Syntax::Hermes, format!("```json\n{w}\n"), "", vec![paris()]),
        (Syntax::Llama3, format!("Sure. {t}"), "Sure.", vec![rome()]),
        (Syntax::Mistral, r#"[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}"#.into(), "", vec![paris()]),
        (Syntax::Mistral, format!("[TOOL_CALLS]{w}"), "", vec![paris()]),
        // JSON and code that are not calls stay as they were written.
        (Syntax::Hermes, r#"{"name": "Bob", "age": 3}"#.into(), r#"{"name": "Bob", "age": 3}"#, vec![]),
        (Syntax::Hermes, "```json\n{\"a\": 1}\n```".into(), "```json\n{\"a\": 1}\n```", vec![]),
        (Syntax::Hermes, "```python\nprint({\"name\": 1})\n```".into(), "```python\nprint({\"name\": 1})\n```", vec![]),
        (Syntax::Hermes, "A dict {'a': 1}, a set {1} and `x`.".into(), "A dict {'a': 1}, a set {1} and `x`.", vec![]),
        (Syntax::Hermes, r#"{"name": "get_weather", oops"#.into(), r#"{"name": "get_weather", oops"#, vec![]),
        (Syntax::Hermes, r#"{"name": "get_weather", "arg"#.into(), r#"{"name": "get_weather", "arg"#, vec![]),
    ];
    let offered = || vec!["get_weather".to_string(), "get_time".to_string()];
    for (syntax, text, content, calls) in cases {
        let want = (content.to_string(), calls);
        let got = parse::split_whole(ToolStream::new(fmt(syntax)).offering(offered()), &text);
        let got = (got.0, got.1.into_iter().map(|c| (c.name, c.arguments)).collect());
        assert_eq!(got, want, "{syntax:?} whole: {text}");
        assert_eq!(
            streamed_by(ToolStream::new(fmt(syntax)).offering(offered()), &text),
            want,
            "{syntax:?} streamed: {text}"
        );
    }
    // Text goes out as soon as it cannot begin a call; a brace is held only while it might.
    let mut s = ToolStream::new(fmt(Syntax::Hermes)).offering(offered());
    assert_eq!(s.push("Here {"), vec![Delta::Content("Here ".into())]);
    assert_eq!(s.push("1} and ``"), vec![Delta::Content("{1} and ".into())]);
    assert_eq!(s.push("`python\n"), vec![Delta::Content("```python\n".into())]);
}

fn tokenizer() -> Tokenizer {
    let path = crate::paths::default_model().expect("the default model (packaging/fetch-model installs it)");
    crate::model::Model::load(&path).unwrap().tokenizer
}

/// Greedy over pseudo-random logits under `format`'s mask until the end: the text.
fn walk(v: &Vocabulary, tok: &Tokenizer, format: &ResponseFormat, seed: u64) -> String {
    let g = v.compile(format).unwrap();
    let mut m = Masker::new(&g, 1, 1, &[], 1).unwrap();
    let mut seq = vec![0];
    let mut x = seed;
    for _ in 0..300 {
        let mut row: Vec<f32> = (0..tok.vocab_size())
            .map(|_| {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                (x >> 40) as f32 / (1u64 << 24) as f32
            })
            .collect();
        m.mask(1, &seq, &mut row, tok.vocab_size()).unwrap();
        // Prefer closing quotes and braces, so free strings end soon.
        for t in tok.encode("\"}", false).unwrap() {
            if row[t as usize].is_finite() {
                row[t as usize] += 2.0;
            }
        }
        let t = (0..row.len()).max_by(|&a, &b| row[a].total_cmp(&row[b])).unwrap() as u32;
        if tok.eos().contains(&t) {
            return tok.decode(&seq[1..], false).unwrap();
        }
        m.emit(0, t).unwrap();
        seq.push(t);
    }
    panic!("no end: {}", tok.decode(&seq, false).unwrap());
}

#[test]
fn what_each_grammar_allows_parses_back_into_a_call_of_the_chosen_tool() {
    let tok = tokenizer();
    let v = Vocabulary::new(&tok).unwrap();
    let tools = vec![
        Tool {
            name: "get_weather".into(),
            description: None,
            parameters: json!({"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"], "additionalProperties": false}),
        },
        Tool {
            name: "get_time".into(),
            description: None,
            parameters: json!({"type": "object", "properties": {}, "additionalProperties": false}),
        },
    ];
    for syntax in [Syntax::Hermes, Syntax::Llama3, Syntax::Mistral] {
        let f = fmt(syntax);
        assert_eq!(f.grammar(&v, &tools, &ToolChoice::Auto, true), None);
        assert_eq!(f.grammar(&v, &tools, &ToolChoice::None, true), None);
        for (seed, choice) in [(1, ToolChoice::Function("get_weather".into())), (2, ToolChoice::Required)] {
            let g = f.grammar(&v, &tools, &choice, false).unwrap();
            let text = walk(&v, &tok, &g, seed);
            let (content, calls) = f.parse(&text);
            assert_eq!((content.as_str(), calls.len()), ("", 1), "{syntax:?}: {text}");
            let args: Value = serde_json::from_str(&calls[0].arguments).unwrap();
            match calls[0].name.as_str() {
                "get_weather" => assert!(args["unit"] == "c" || args["unit"] == "f", "{text}"),
                "get_time" => assert_eq!(args, json!({}), "{text}"),
                other => panic!("{other}: {text}"),
            }
            if let ToolChoice::Function(name) = &choice {
                assert_eq!(&calls[0].name, name, "{syntax:?}: {text}");
            }
        }
    }
}

#[test]
fn templates_see_tools_earlier_calls_and_tool_results() {
    let src = "{% for m in messages %}{{ m.role }}:{{ m.content }}\
               {% if m.tool_calls is defined %}{% for c in m.tool_calls %}[{{ c.id }} {{ c.function.name }} {{ c.function.arguments.city }}]{% endfor %}{% endif %}\
               {% if m.tool_call_id is defined %}({{ m.tool_call_id }}){% endif %};{% endfor %}\
               {% if tools %}{% for t in tools %}<{{ t.function.name }}>{% endfor %}{% endif %}";
    let t = crate::chat::ChatTemplate::new(Some(src), String::new(), String::new()).unwrap();
    let call = ToolCall { id: "call_1".into(), name: "get_weather".into(), arguments: r#"{"city": "Paris"}"#.into() };
    let msgs = vec![
        crate::chat::ChatMessage::new("user", "Weather?"),
        crate::chat::ChatMessage { tool_calls: vec![call], ..crate::chat::ChatMessage::new("assistant", "") },
        crate::chat::ChatMessage {
            tool_call_id: Some("call_1".into()),
            ..crate::chat::ChatMessage::new("tool", "sunny")
        },
    ];
    let tool = Tool { name: "get_weather".into(), description: None, parameters: json!({"type": "object"}) };
    let s = t.render_with_tools(&msgs, &[tool], false).unwrap();
    assert_eq!(s, "user:Weather?;assistant:[call_1 get_weather Paris];tool:sunny(call_1);<get_weather>");
    assert_eq!(t.render(&msgs[..1], false).unwrap(), "user:Weather?;");
}
