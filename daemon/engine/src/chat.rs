//! Chat templates: the model's own Jinja template rendered with `minijinja`.
//!
//! Templates get what Hugging Face's `apply_chat_template` passes: `messages` (with their tool
//! calls and tool results), `tools` when the request has them, `add_generation_prompt`,
//! `bos_token`, `eos_token`, and a `raise_exception` function. A model without a template gets
//! ChatML, the format of the default model.

use crate::tools::{Tool, ToolCall};
use serde::ser::SerializeMap;
use serde::Serialize;

/// ChatML, used when a model ships no template.
pub const CHATML: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// Template instructions one rendering may run: a template's loops are bounded by its input
/// in practice (a few hundred instructions per message), and a file whose template loops
/// without end (two nested `range(100000)`) is stopped after a third of a second's work.
pub const FUEL: u64 = 20_000_000;

/// The longest text a template may render (a generous bound on any prompt: a million-token
/// context is a few MiB of text).
pub const MAX_RENDERED: usize = 64 << 20;

#[derive(Debug, thiserror::Error)]
#[error("chat template: {0}")]
pub struct TemplateError(String);

impl TemplateError {
    pub fn new(why: impl Into<String>) -> TemplateError {
        TemplateError(why.into())
    }
}

/// The rendering's output, failing past [`MAX_RENDERED`] bytes.
struct Capped(Vec<u8>);

impl std::io::Write for Capped {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.0.len() + buf.len() > MAX_RENDERED {
            return Err(std::io::Error::other(format!("the rendered prompt passes {MAX_RENDERED} bytes")));
        }
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// One message of a conversation.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// The calls an assistant message made.
    pub tool_calls: Vec<ToolCall>,
    /// Which call a `tool` message answers.
    pub tool_call_id: Option<String>,
    /// The tool's name, on a `tool` message.
    pub name: Option<String>,
    /// An assistant message's reasoning (OpenAI-compatible servers' `reasoning_content`), which
    /// thinking models' templates write back where it belongs (Qwen3.5 and Gemma 4: in a tool
    /// call's turn after the last question).
    pub reasoning: Option<String>,
    /// The images of a message, in the order their markers stand in its content (the
    /// daemon's private marker text; see the daemon's chat edge).
    pub images: Vec<std::sync::Arc<crate::vision::RgbImage>>,
}

impl ChatMessage {
    pub fn new(role: &str, content: &str) -> Self {
        ChatMessage { role: role.into(), content: content.into(), ..ChatMessage::default() }
    }
}

/// As transformers hands messages to templates: `role` and `content`, and `tool_calls`,
/// `tool_call_id`, `name` only where present (templates test `message.tool_calls is defined`).
impl Serialize for ChatMessage {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(None)?;
        m.serialize_entry("role", &self.role)?;
        m.serialize_entry("content", &self.content)?;
        if !self.tool_calls.is_empty() {
            let calls: Vec<serde_json::Value> = self.tool_calls.iter().map(ToolCall::to_template).collect();
            m.serialize_entry("tool_calls", &calls)?;
        }
        if let Some(id) = &self.tool_call_id {
            m.serialize_entry("tool_call_id", id)?;
        }
        if let Some(n) = &self.name {
            m.serialize_entry("name", n)?;
        }
        if let Some(r) = &self.reasoning {
            m.serialize_entry("reasoning_content", r)?;
        }
        m.end()
    }
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
    bos: String,
    eos: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ChatTemplate")
    }
}

fn raise_exception(msg: String) -> Result<String, minijinja::Error> {
    Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
}

/// Jinja's `tojson` as transformers defines it for chat templates (Llama 3.1's and Mistral's
/// render tools and call arguments with it): Python's `json.dumps`, not HTML-escaped, with
/// `indent`, `ensure_ascii` (default false) and `sort_keys`; items separated by ", " on one
/// line, by "," and a newline when indented.
fn tojson(value: minijinja::Value, kwargs: minijinja::value::Kwargs) -> Result<minijinja::Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let ensure_ascii = kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false);
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    kwargs.assert_all_used()?;
    let v = serde_json::to_value(&value)
        .map_err(|e| minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, e.to_string()))?;
    let mut out = String::new();
    python_json(&v, &Layout { indent, ensure_ascii, sort_keys }, 0, &mut out);
    Ok(minijinja::Value::from_safe_string(out))
}

struct Layout {
    indent: Option<usize>,
    ensure_ascii: bool,
    sort_keys: bool,
}

fn python_json(v: &serde_json::Value, l: &Layout, depth: usize, out: &mut String) {
    use serde_json::Value as J;
    let (open, close, items): (char, char, Vec<(Option<&String>, &J)>) = match v {
        J::Array(a) => ('[', ']', a.iter().map(|x| (None, x)).collect()),
        J::Object(o) => {
            let mut items: Vec<(Option<&String>, &J)> = o.iter().map(|(k, x)| (Some(k), x)).collect();
            if l.sort_keys {
                items.sort_by(|a, b| a.0.cmp(&b.0));
            }
            ('{', '}', items)
        }
        J::String(s) => return python_string(s, l.ensure_ascii, out),
        other => return out.push_str(&other.to_string()),
    };
    out.push(open);
    if items.is_empty() {
        out.push(close);
        return;
    }
    let newline = |out: &mut String, d: usize| {
        if let Some(n) = l.indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * d));
        }
    };
    for (i, (k, x)) in items.into_iter().enumerate() {
        if i > 0 {
            out.push_str(if l.indent.is_some() { "," } else { ", " });
        }
        newline(out, depth + 1);
        if let Some(k) = k {
            python_string(k, l.ensure_ascii, out);
            out.push_str(": ");
        }
        python_json(x, l, depth + 1, out);
    }
    newline(out, depth);
    out.push(close);
}

/// A JSON string as Python writes it: escapes as serde_json's (which are Python's), and with
/// `ensure_ascii` every other character as `\uXXXX` (UTF-16 surrogate pairs above U+FFFF).
fn python_string(s: &str, ensure_ascii: bool, out: &mut String) {
    let quoted = serde_json::Value::String(s.to_owned()).to_string();
    if !ensure_ascii {
        return out.push_str(&quoted);
    }
    for c in quoted.chars() {
        if c.is_ascii() {
            out.push(c);
        } else {
            let mut units = [0u16; 2];
            for u in c.encode_utf16(&mut units) {
                out.push_str(&format!("\\u{u:04x}"));
            }
        }
    }
}

impl ChatTemplate {
    /// Compiles `source` (or ChatML when `None`).
    pub fn new(source: Option<&str>, bos: String, eos: String) -> Result<Self, TemplateError> {
        let mut env = minijinja::Environment::new();
        env.set_fuel(Some(FUEL));
        env.add_function("raise_exception", raise_exception);
        env.add_filter("tojson", tojson);
        // Python's str and dict methods (`startswith`, `split`, `strip`, `items`, ...), which
        // templates written for transformers' Jinja call (Qwen 3's and Llama 3.1's among them).
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_template_owned("chat", source.unwrap_or(CHATML).to_string())
            .map_err(|e| TemplateError(e.to_string()))?;
        Ok(ChatTemplate { env, bos, eos })
    }

    /// The prompt text for `messages`, ending with the assistant's turn opener when
    /// `add_generation_prompt`.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String, TemplateError> {
        self.render_with_tools(messages, &[], add_generation_prompt)
    }

    /// [`ChatTemplate::render`] with `tools` offered to the model (OpenAI's list, as
    /// transformers passes it; left undefined when empty).
    pub fn render_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: &[Tool],
        add_generation_prompt: bool,
    ) -> Result<String, TemplateError> {
        self.render_with(messages, tools, &Extra::new(), add_generation_prompt)
    }

    /// [`ChatTemplate::render_with_tools`] with `extra` variables in the context (a thinking
    /// switch, a client's `chat_template_kwargs`); the standard names keep their values.
    pub fn render_with(
        &self,
        messages: &[ChatMessage],
        tools: &[Tool],
        extra: &Extra,
        add_generation_prompt: bool,
    ) -> Result<String, TemplateError> {
        let tmpl = self.env.get_template("chat").map_err(|e| TemplateError(e.to_string()))?;
        let tools: Option<Vec<serde_json::Value>> =
            (!tools.is_empty()).then(|| tools.iter().map(Tool::to_openai).collect());
        let extra: Extra = extra
            .iter()
            .filter(|(k, _)| !RESERVED.contains(&k.as_str()))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let ctx = minijinja::context! {
            messages => messages,
            tools => tools,
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos,
            eos_token => &self.eos,
            ..minijinja::Value::from_serialize(&extra)
        };
        let mut out = Capped(Vec::new());
        tmpl.render_captured_to(ctx, &mut out).map_err(|e| TemplateError(e.to_string()))?;
        String::from_utf8(out.0).map_err(|e| TemplateError(e.to_string()))
    }
}

/// Variables a request adds to a template's context beside the standard ones: a thinking
/// switch (`enable_thinking`, `reasoning_effort`), a client's `chat_template_kwargs`.
pub type Extra = std::collections::BTreeMap<String, serde_json::Value>;

/// The context's standard names, which [`Extra`] cannot change.
const RESERVED: [&str; 5] = ["messages", "tools", "add_generation_prompt", "bos_token", "eos_token"];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extra_variables_reach_the_template_but_cannot_replace_its_own() {
        let src = "{% if enable_thinking is defined and not enable_thinking %}no-think {% endif %}{{ messages | length }}{{ add_generation_prompt }}";
        let t = ChatTemplate::new(Some(src), String::new(), String::new()).unwrap();
        let msgs = [ChatMessage::new("user", "Hi")];
        assert_eq!(t.render(&msgs, true).unwrap(), "1True");
        let mut extra = Extra::new();
        extra.insert("enable_thinking".into(), serde_json::json!(false));
        extra.insert("messages".into(), serde_json::json!([1, 2, 3]));
        extra.insert("add_generation_prompt".into(), serde_json::json!(false));
        assert_eq!(t.render_with(&msgs, &[], &extra, true).unwrap(), "no-think 1True");
    }

    #[test]
    fn chatml_renders_with_generation_prompt() {
        let t = ChatTemplate::new(None, String::new(), String::new()).unwrap();
        let s = t.render(&[ChatMessage::new("user", "Hi")], true).unwrap();
        assert_eq!(s, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
    }

    #[test]
    fn python_string_methods_render() {
        // The methods stock templates call on message contents, as transformers renders them.
        let src = "{% for m in messages %}{% if m.content.startswith('<think>') %}{{ \
                   m.content.split('</think>')[-1].lstrip('\\n') }}{% else %}{{ m.content.strip() | upper }}{% endif %}\
                   |{{ m.role.endswith('er') }}|{{ m.content.rstrip('!').replace('a', 'A') }};{% endfor %}";
        let t = ChatTemplate::new(Some(src), String::new(), String::new()).unwrap();
        let s = t
            .render(
                &[ChatMessage::new("user", "  hi there! "), ChatMessage::new("assistant", "<think>x</think>\nanswer!")],
                false,
            )
            .unwrap();
        assert_eq!(s, "HI THERE!|True|  hi there! ;answer!|False|<think>x</think>\nAnswer;");
    }

    #[test]
    fn tojson_writes_what_pythons_json_dumps_writes() {
        // Expected strings from Python 3: json.dumps(v, ensure_ascii=..., indent=...).
        let src = "{{ v | tojson }}|{{ v | tojson(indent=2) }}|{{ v | tojson(ensure_ascii=true) }}|{{ [] | tojson }}";
        let t = ChatTemplate::new(Some(src), String::new(), String::new()).unwrap();
        let v = serde_json::json!({"name": "f", "args": [1, 2.5, true, null], "e": {}, "s": "<é \"😀\">"});
        let s = t.env.get_template("chat").unwrap().render(minijinja::context! { v => v }).unwrap();
        let want = [
            r#"{"name": "f", "args": [1, 2.5, true, null], "e": {}, "s": "<é \"😀\">"}"#,
            "{\n  \"name\": \"f\",\n  \"args\": [\n    1,\n    2.5,\n    true,\n    null\n  ],\n  \"e\": {},\n  \"s\": \"<é \\\"😀\\\">\"\n}",
            r#"{"name": "f", "args": [1, 2.5, true, null], "e": {}, "s": "<\u00e9 \"\ud83d\ude00\">"}"#,
            "[]",
        ]
        .join("|");
        assert_eq!(s, want);
        let bad = ChatTemplate::new(Some("{{ 1 | tojson(colour=1) }}"), String::new(), String::new()).unwrap();
        assert!(bad.env.get_template("chat").unwrap().render(minijinja::context! {}).is_err());
    }

    /// A template that would loop for hours runs out of fuel; one that would render gigabytes
    /// stops at the cap; both are errors, and the stock templates' work fits many times over.
    #[test]
    fn runaway_templates_stop_with_an_error() {
        let spin = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}";
        let t = ChatTemplate::new(Some(spin), String::new(), String::new()).unwrap();
        let t0 = std::time::Instant::now();
        let e = t.render(&[], false).unwrap_err();
        assert!(e.to_string().contains("fuel"), "{e}");
        eprintln!("out of fuel after {:.2} s", t0.elapsed().as_secs_f64());
        let big = "{% for i in range(100) %}{{ 'x' * 10000000 }}{% endfor %}";
        let t = ChatTemplate::new(Some(big), String::new(), String::new()).unwrap();
        let e = t.render(&[], false).unwrap_err();
        assert!(e.to_string().contains("failed to write output"), "{e}");
        // A thousand-turn conversation through ChatML renders.
        let msgs: Vec<ChatMessage> = (0..1000).map(|i| ChatMessage::new("user", &format!("turn {i}"))).collect();
        let t = ChatTemplate::new(None, String::new(), String::new()).unwrap();
        assert!(t.render(&msgs, true).unwrap().ends_with("<|im_start|>assistant\n"));
    }

    #[test]
    fn template_errors_are_values() {
        let t =
            ChatTemplate::new(Some("{{ raise_exception('no system role') }}"), String::new(), String::new()).unwrap();
        let e = t.render(&[], false).unwrap_err();
        assert!(e.to_string().contains("no system role"), "{e}");
        assert!(ChatTemplate::new(Some("{% for %}"), String::new(), String::new()).is_err());
    }
}
