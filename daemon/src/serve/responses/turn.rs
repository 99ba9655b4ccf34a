//! The answer of a Responses request as output items ([`Turn`]): `reasoning`, `message` with
//! its `output_text`, `function_call`, formed from the [`Answers`](crate::serve::answer::Answers)
//! events, and the typed events that tell a stream of them (`response.output_item.added`,
//! `.content_part.added`, `.output_text.delta`, `.function_call_arguments.delta`, the `.done`
//! of each). One state machine for whole and streamed answers: a whole answer ignores the events.

use crate::serve::answer::{Answer, Finish, Usage};
use crate::serve::openai::logprobs_json;
use crate::serve::request::Scored;
use crate::serve::ModelHandle;
use inferd_engine::tools::ToolCall;
use serde_json::{json, Value};

/// The kind of output item being written.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Kind {
    Reasoning,
    Message,
}

/// The output item being written.
#[derive(Debug)]
struct Open {
    kind: Kind,
    index: usize,
    id: String,
    text: String,
    logprobs: Vec<Value>,
}

/// The answer's output items as they form, and the events that tell a stream of them. Text of
/// whitespace alone waits for more text, so a call's surrounding whitespace opens no message.
#[derive(Debug)]
pub(super) struct Turn {
    /// The ids' common part (the response id's digits).
    tag: String,
    pub(super) items: Vec<Value>,
    open: Option<Open>,
    held: String,
    pub(super) finish: Finish,
    pub(super) usage: Option<Usage>,
}

impl Turn {
    pub(super) fn new(tag: &str) -> Turn {
        Turn {
            tag: tag.to_owned(),
            items: Vec::new(),
            open: None,
            held: String::new(),
            finish: Finish::Stop,
            usage: None,
        }
    }

    /// Reads one answer event, writing the stream's events for it into `out`.
    pub(super) fn on(&mut self, a: Answer, logprobs: Option<&ModelHandle>, out: &mut Vec<Value>) {
        match a {
            Answer::Reasoning { choice: 0, text } => self.write(Kind::Reasoning, text, Vec::new(), out),
            Answer::Text { choice: 0, text, logprobs: lps, .. } => {
                let lps = match logprobs {
                    Some(m) if !lps.is_empty() => entries(m, &lps),
                    _ => Vec::new(),
                };
                self.held.push_str(&text);
                if self.held.trim().is_empty() {
                    if let Some(o) = self.open.as_mut().filter(|o| o.kind == Kind::Message) {
                        o.logprobs.extend(lps);
                    }
                    return;
                }
                let text = std::mem::take(&mut self.held);
                self.write(Kind::Message, text, lps, out);
            }
            Answer::Call { choice: 0, call, .. } => {
                self.held.clear();
                self.close(out);
                self.call(&call, out);
            }
            Answer::Finish { choice: 0, reason } => self.finish = reason,
            Answer::Done(u) => {
                self.close(out);
                self.usage = Some(u);
            }
            _ => {}
        }
    }

    /// Adds text to an item of `kind`, opening one (and closing another) as needed.
    fn write(&mut self, kind: Kind, text: String, lps: Vec<Value>, out: &mut Vec<Value>) {
        if self.open.as_ref().is_none_or(|o| o.kind != kind) {
            self.close(out);
            let index = self.items.len();
            let id = match kind {
                Kind::Reasoning => format!("rs_{}_{index}", self.tag),
                Kind::Message => format!("msg_{}_{index}", self.tag),
            };
            let open = Open { kind, index, id, text: String::new(), logprobs: Vec::new() };
            out.push(json!({ "type": "response.output_item.added", "output_index": index, "item": open.item("in_progress") }));
            out.push(json!({ "type": "response.content_part.added", "item_id": open.id, "output_index": index,
                "content_index": 0, "part": open.part() }));
            self.open = Some(open);
        }
        let Some(o) = self.open.as_mut() else { return };
        let delta = match kind {
            Kind::Reasoning => json!({ "type": "response.reasoning_text.delta", "delta": text }),
            Kind::Message => json!({ "type": "response.output_text.delta", "delta": text, "logprobs": lps }),
        };
        o.text.push_str(&text);
        o.logprobs.extend(lps);
        let mut delta = delta;
        delta["item_id"] = json!(o.id);
        delta["output_index"] = json!(o.index);
        delta["content_index"] = json!(0);
        out.push(delta);
    }

    /// Closes the open item: its `done` events, and the item among the output.
    pub(super) fn close(&mut self, out: &mut Vec<Value>) {
        let Some(o) = self.open.take() else { return };
        let (kind, key) = match o.kind {
            Kind::Reasoning => ("response.reasoning_text.done", "text"),
            Kind::Message => ("response.output_text.done", "text"),
        };
        let mut done = json!({ "type": kind, "item_id": o.id, "output_index": o.index, "content_index": 0 });
        done[key] = json!(o.text);
        if o.kind == Kind::Message {
            done["logprobs"] = json!(o.logprobs);
        }
        out.push(done);
        out.push(json!({ "type": "response.content_part.done", "item_id": o.id, "output_index": o.index,
            "content_index": 0, "part": o.part() }));
        let item = o.item("completed");
        out.push(json!({ "type": "response.output_item.done", "output_index": o.index, "item": item }));
        self.items.push(item);
    }

    /// A function call: its item added, its arguments in one delta, done.
    fn call(&mut self, call: &ToolCall, out: &mut Vec<Value>) {
        let index = self.items.len();
        let id = format!("fc_{}_{index}", self.tag);
        let item = |status: &str, args: &str| {
            json!({ "type": "function_call", "id": id, "call_id": call.id, "name": call.name,
                "arguments": args, "status": status })
        };
        out.push(
            json!({ "type": "response.output_item.added", "output_index": index, "item": item("in_progress", "") }),
        );
        out.push(json!({ "type": "response.function_call_arguments.delta", "item_id": id, "output_index": index,
            "delta": call.arguments }));
        out.push(json!({ "type": "response.function_call_arguments.done", "item_id": id, "output_index": index,
            "name": call.name, "arguments": call.arguments }));
        let done = item("completed", &call.arguments);
        out.push(json!({ "type": "response.output_item.done", "output_index": index, "item": done }));
        self.items.push(done);
    }
}

impl Open {
    /// The item's content part.
    fn part(&self) -> Value {
        match self.kind {
            Kind::Reasoning => json!({ "type": "reasoning_text", "text": self.text }),
            Kind::Message => {
                json!({ "type": "output_text", "text": self.text, "annotations": [], "logprobs": self.logprobs })
            }
        }
    }

    /// The item, with its content so far.
    fn item(&self, status: &str) -> Value {
        let content = if self.text.is_empty() && status == "in_progress" { json!([]) } else { json!([self.part()]) };
        match self.kind {
            Kind::Reasoning => {
                json!({ "type": "reasoning", "id": self.id, "summary": [], "content": content, "status": status })
            }
            Kind::Message => {
                json!({ "type": "message", "id": self.id, "role": "assistant", "status": status, "content": content })
            }
        }
    }
}

/// Log-probabilities in the Responses shape (chat's entries, with their alternatives).
fn entries(model: &ModelHandle, lps: &[Scored]) -> Vec<Value> {
    logprobs_json(&model.model, true, lps, 0)["content"].as_array().cloned().unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_tells_each_item_and_ends_with_the_whole_output() {
        let mut t = Turn::new("ab");
        let mut ev = Vec::new();
        let text = |s: &str| Answer::Text { choice: 0, text: s.into(), token: None, logprobs: Vec::new() };
        t.on(Answer::Reasoning { choice: 0, text: "hmm".into() }, None, &mut ev);
        t.on(text("Hi"), None, &mut ev);
        t.on(text(" there"), None, &mut ev);
        t.on(text("\n"), None, &mut ev);
        let call = ToolCall { id: "call_x".into(), name: "f".into(), arguments: "{}".into() };
        t.on(Answer::Call { choice: 0, index: 0, call }, None, &mut ev);
        t.on(Answer::Finish { choice: 0, reason: Finish::ToolCalls }, None, &mut ev);
        t.on(Answer::Done(Usage::default()), None, &mut ev);
        let kinds: Vec<&str> = ev.iter().map(|e| e["type"].as_str().unwrap()).collect();
        assert_eq!(
            kinds,
            [
                "response.output_item.added",
                "response.content_part.added",
                "response.reasoning_text.delta",
                "response.reasoning_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
            ]
        );
        let types: Vec<&str> = t.items.iter().map(|i| i["type"].as_str().unwrap()).collect();
        assert_eq!(types, ["reasoning", "message", "function_call"]);
        assert_eq!(t.items[1]["content"][0]["text"], "Hi there", "the whitespace before a call is no text");
        assert_eq!(t.items[2]["call_id"], "call_x");
        let indexes: Vec<u64> = ev.iter().map(|e| e["output_index"].as_u64().unwrap()).collect();
        assert!(indexes.windows(2).all(|w| w[0] <= w[1]) && indexes.last() == Some(&2), "{indexes:?}");
    }
}
