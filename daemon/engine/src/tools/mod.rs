//! Tool calling as each model family writes it: the tools rendered into the prompt, the grammar
//! that makes the model call one when the client requires it, and the calls parsed back out of
//! the text (`parse.rs`, whole and streamed); gpt-oss's harmony format, whose channels say
//! what is reasoning, answer or call (`harmony.rs`).
//!
//! Three syntaxes cover the families inferd loads, each detected from the chat template:
//! - Hermes (Qwen 2.5 / 3, Hermes, and the fallback): `<tool_call>\n{"name": .., "arguments":
//!   {..}}\n</tool_call>`, one block per call;
//! - Llama 3.1 / 3.2 / 3.3: one JSON object `{"name": .., "parameters": {..}}` as the whole
//!   answer, optionally after `<|python_tag|>`;
//! - Mistral: `[TOOL_CALLS]` then a JSON array of `{"name": .., "arguments": {..}}`.
//!
//! A template that renders `tools` itself gets them as OpenAI's list; one that does not (ChatML,
//! Gemma's) gets a system message describing them in the Hermes syntax, which the output is
//! then parsed in. Nothing here knows HTTP: the edges turn their JSON into [`Tool`]s and
//! [`ToolCall`]s.

pub mod harmony;
pub mod parse;

use crate::constraint::{ResponseFormat, Vocabulary};
use serde_json::{json, Value};

/// A function the model may call: OpenAI's `{"type": "function", "function": {...}}`.
#[derive(Clone, Debug, PartialEq)]
pub struct Tool {
    pub name: String,
    pub description: Option<String>,
    /// The arguments' JSON schema (`{"type": "object"}` when the client gave none).
    pub parameters: Value,
}

impl Tool {
    /// OpenAI's shape, which tool-aware chat templates iterate over, its keys in OpenAI's
    /// order (name, description, parameters: templates that write a tool as JSON keep it).
    pub fn to_openai(&self) -> Value {
        let mut f = serde_json::Map::new();
        f.insert("name".into(), json!(self.name));
        if let Some(d) = &self.description {
            f.insert("description".into(), json!(d));
        }
        f.insert("parameters".into(), self.parameters.clone());
        json!({ "type": "function", "function": f })
    }
}

/// Whether and how the model must call a tool (OpenAI's `tool_choice`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum ToolChoice {
    /// The model decides (the default with tools).
    #[default]
    Auto,
    /// No call: the tools are not shown to the model.
    None,
    /// At least one call, of any tool.
    Required,
    /// A call of this tool.
    Function(String),
}

/// One call the model made (or made earlier in the conversation).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    /// The arguments as JSON text (OpenAI's `arguments` string).
    pub arguments: String,
}

impl ToolCall {
    /// The shape chat templates read (`tool_call.function.name`, `.arguments` as an object, as
    /// transformers passes it).
    pub fn to_template(&self) -> Value {
        let args: Value = serde_json::from_str(&self.arguments).unwrap_or_else(|_| json!(self.arguments));
        json!({ "id": self.id, "type": "function", "function": { "name": self.name, "arguments": args } })
    }
}

/// How a model family writes tool calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Syntax {
    Hermes,
    Llama3,
    Mistral,
}

/// A model's tool-call format: its syntax, and whether its template renders tools itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ToolFormat {
    pub syntax: Syntax,
    /// The template reads `tools` (otherwise a system message describes them).
    pub native: bool,
}

/// `text` as a Lark terminal: a special token of the vocabulary by id (a grammar cannot spell
/// a special token as text), else a quoted string.
fn terminal(vocab: &Vocabulary, text: &str) -> String {
    vocab.special_token(text).map(|t| format!("<[{t}]>")).unwrap_or_else(|| Value::String(text.to_owned()).to_string())
}

impl ToolFormat {
    /// The format of a model whose chat template is `template` (ChatML when none).
    pub fn detect(template: Option<&str>) -> ToolFormat {
        let t = template.unwrap_or_default();
        let native = t.contains("tools");
        let syntax = if !native || t.contains("<tool_call>") {
            Syntax::Hermes
        } else if t.contains("[TOOL_CALLS]") {
            Syntax::Mistral
        } else if t.contains("<|python_tag|>") || t.contains("\"parameters\": ") || t.contains("ipython") {
            Syntax::Llama3
        } else {
            Syntax::Hermes
        };
        ToolFormat { syntax, native }
    }

    /// The system message that describes `tools` to a template that does not render them.
    pub fn system_prompt(&self, tools: &[Tool]) -> Option<String> {
        if self.native {
            return None;
        }
        let list: Vec<String> = tools.iter().map(|t| t.to_openai()["function"].to_string()).collect();
        Some(format!(
            "You can call functions. Their JSON schemas:\n{}\nTo call a function, answer with \
             <tool_call>\n{{\"name\": \"function name\", \"arguments\": {{...}}}}\n</tool_call> \
             (one block per call) and nothing else; otherwise answer normally.",
            list.join("\n")
        ))
    }

    /// The grammar a `choice` of `Required` or `Function` puts on the answer (`None` for the
    /// others); `parallel`: more than one call allowed.
    pub fn grammar(
        &self,
        vocab: &Vocabulary,
        tools: &[Tool],
        choice: &ToolChoice,
        parallel: bool,
    ) -> Option<ResponseFormat> {
        let chosen: Vec<&Tool> = match choice {
            ToolChoice::Auto | ToolChoice::None => return None,
            ToolChoice::Required => tools.iter().collect(),
            ToolChoice::Function(name) => tools.iter().filter(|t| &t.name == name).collect(),
        };
        let args = if self.syntax == Syntax::Llama3 { "parameters" } else { "arguments" };
        let calls: Vec<Value> = chosen
            .iter()
            .map(|t| {
                json!({
                    "type": "object",
                    "properties": { "name": { "const": t.name }, args: t.parameters },
                    "required": ["name", args],
                    "additionalProperties": false
                })
            })
            .collect();
        let layout = json!({ "whitespace_flexible": false, "key_separator": ": ", "item_separator": ", " });
        let call = json!({ "anyOf": calls, "x-guidance": layout });
        let lark = match self.syntax {
            Syntax::Hermes => {
                let open = terminal(vocab, "<tool_call>");
                let close = terminal(vocab, "</tool_call>");
                let more = if parallel { " (\"\\n\" call)*" } else { "" };
                format!("start: call{more}\ncall: {open} \"\\n\" %json {call} \"\\n\" {close}\n")
            }
            Syntax::Llama3 => format!("start: %json {call}\n"),
            Syntax::Mistral => {
                let mut list =
                    json!({ "type": "array", "items": { "anyOf": calls }, "minItems": 1, "x-guidance": layout });
                if !parallel {
                    list["maxItems"] = json!(1);
                }
                format!("start: {} %json {list}\n", terminal(vocab, "[TOOL_CALLS]"))
            }
        };
        Some(ResponseFormat::Lark(lark))
    }

    /// The text a template without tool support shows for an earlier call of the model.
    pub fn written(&self, calls: &[ToolCall]) -> String {
        calls
            .iter()
            .map(|c| {
                let args: Value = serde_json::from_str(&c.arguments).unwrap_or_else(|_| json!(c.arguments));
                format!("<tool_call>\n{}\n</tool_call>", json!({ "name": c.name, "arguments": args }))
            })
            .collect::<Vec<_>>()
            .join("\n")
    }
}

#[cfg(test)]
mod tests;
