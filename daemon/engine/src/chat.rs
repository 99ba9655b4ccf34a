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

#[derive(Debug, thiserror::Error)]
#[error("chat template: {0}")]
pub struct TemplateError(String);

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

impl ChatTemplate {
    /// Compiles `source` (or ChatML when `None`).
    pub fn new(source: Option<&str>, bos: String, eos: String) -> Result<Self, TemplateError> {
        let mut env = minijinja::Environment::new();
        env.add_function("raise_exception", raise_exception);
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
        let tmpl = self.env.get_template("chat").map_err(|e| TemplateError(e.to_string()))?;
        let tools: Option<Vec<serde_json::Value>> =
            (!tools.is_empty()).then(|| tools.iter().map(Tool::to_openai).collect());
        tmpl.render(minijinja::context! {
            messages => messages,
            tools => tools,
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos,
            eos_token => &self.eos,
        })
        .map_err(|e| TemplateError(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn template_errors_are_values() {
        let t =
            ChatTemplate::new(Some("{{ raise_exception('no system role') }}"), String::new(), String::new()).unwrap();
        let e = t.render(&[], false).unwrap_err();
        assert!(e.to_string().contains("no system role"), "{e}");
        assert!(ChatTemplate::new(Some("{% for %}"), String::new(), String::new()).is_err());
    }
}
