//! Tool calls read back out of a model's text: whole ([`ToolFormat::parse`]) or as it streams
//! ([`ToolStream`]: text that cannot be part of a call goes out at once, a call when it is
//! complete). What does not parse as a call stays text: nothing the model wrote is lost.

use super::{Syntax, ToolCall, ToolFormat};
use serde_json::Value;
use std::hash::{BuildHasher, Hasher};

/// Ids for the calls of one answer: `call_` and 16 letters or digits, or the 9 that Mistral's
/// templates insist on when the conversation comes back.
#[derive(Debug)]
struct CallIds {
    state: std::collections::hash_map::RandomState,
    n: u64,
    mistral: bool,
}

impl CallIds {
    fn new(format: ToolFormat) -> CallIds {
        CallIds { state: Default::default(), n: 0, mistral: format.syntax == Syntax::Mistral }
    }

    fn next(&mut self) -> String {
        const ALNUM: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
        self.n += 1;
        let mut h = self.state.build_hasher();
        h.write_u64(self.n);
        let mut x = h.finish();
        let len = if self.mistral { 9 } else { 16 };
        let mut s = String::with_capacity(len + 5);
        if !self.mistral {
            s.push_str("call_");
        }
        for i in 0..len {
            if i == 10 {
                let mut h = self.state.build_hasher();
                h.write_u64(x);
                x = h.finish();
            }
            s.push(ALNUM[(x % 62) as usize] as char);
            x /= 62;
        }
        s
    }
}

/// A call from a JSON object with a name and its arguments (an object, or a string of one).
fn call_of(v: &Value, ids: &mut CallIds) -> Option<ToolCall> {
    let o = v.as_object()?;
    let name = o.get("name")?.as_str()?;
    let args = o.get("arguments").or_else(|| o.get("parameters")).cloned().unwrap_or(Value::Object(Default::default()));
    let arguments = match args {
        Value::String(s) if serde_json::from_str::<Value>(&s).is_ok_and(|v| v.is_object()) => s,
        Value::Object(_) => args.to_string(),
        _ => return None,
    };
    Some(ToolCall { id: ids.next(), name: name.to_owned(), arguments })
}

/// Consecutive JSON objects separated by whitespace or `;` (Llama 3.2's parallel calls), each a
/// call, or `None`.
fn calls_of_objects(text: &str, ids: &mut CallIds) -> Option<Vec<ToolCall>> {
    let mut calls = Vec::new();
    let mut rest = text;
    loop {
        rest = rest.trim_start_matches(|c: char| c.is_whitespace() || c == ';');
        if rest.is_empty() {
            return (!calls.is_empty()).then_some(calls);
        }
        let mut it = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
        let v = it.next()?.ok()?;
        calls.push(call_of(&v, ids)?);
        rest = &rest[it.byte_offset()..];
    }
}

/// The calls of a JSON array of call objects, or `None`.
fn calls_of_array(text: &str, ids: &mut CallIds) -> Option<Vec<ToolCall>> {
    let v: Value = serde_json::from_str(text.trim()).ok()?;
    let calls: Option<Vec<ToolCall>> = v.as_array()?.iter().map(|c| call_of(c, ids)).collect();
    calls.filter(|c| !c.is_empty())
}

const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";
const LLAMA_TAG: &str = "<|python_tag|>";
const MISTRAL_TAG: &str = "[TOOL_CALLS]";

impl ToolFormat {
    /// A whole answer as its text (trimmed) and its calls.
    pub fn parse(&self, text: &str) -> (String, Vec<ToolCall>) {
        let mut s = ToolStream::new(*self);
        let mut deltas = s.push(text);
        deltas.extend(s.finish());
        let (mut content, mut calls) = (String::new(), Vec::new());
        for d in deltas {
            match d {
                Delta::Content(t) => content.push_str(&t),
                Delta::Call(c) => calls.push(c),
            }
        }
        (content.trim().to_owned(), calls)
    }
}

/// A piece of a streamed answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Delta {
    Content(String),
    Call(ToolCall),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Nothing but whitespace yet (Llama 3: a call is the whole answer, so it shows at once).
    Start,
    Text,
    /// Inside a call (Hermes: until its closing tag; the others: until the end).
    Call,
}

/// Splits a streamed answer into text and calls.
#[derive(Debug)]
pub struct ToolStream {
    format: ToolFormat,
    state: State,
    buf: String,
    ids: CallIds,
    calls: usize,
}

/// The length of the longest proper prefix of `tag` that `text` ends with.
fn partial(text: &str, tag: &str) -> usize {
    (1..tag.len()).rev().find(|&k| text.ends_with(&tag[..k])).unwrap_or(0)
}

impl ToolStream {
    pub fn new(format: ToolFormat) -> ToolStream {
        ToolStream { format, state: State::Start, buf: String::new(), ids: CallIds::new(format), calls: 0 }
    }

    /// Calls found so far.
    pub fn calls(&self) -> usize {
        self.calls
    }

    fn text(&self, out: &mut Vec<Delta>, t: String) {
        // Whitespace between calls is the syntax's, not an answer.
        let between_calls = self.calls > 0 && t.trim().is_empty();
        if !t.is_empty() && !between_calls {
            out.push(Delta::Content(t));
        }
    }

    fn call(&mut self, out: &mut Vec<Delta>, calls: Option<Vec<ToolCall>>, raw: String) {
        match calls {
            Some(c) => {
                self.calls += c.len();
                out.extend(c.into_iter().map(Delta::Call));
            }
            None => self.text(out, raw),
        }
    }

    /// The next piece of text: what can be sent now.
    pub fn push(&mut self, text: &str) -> Vec<Delta> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        loop {
            match (self.state, self.format.syntax) {
                (State::Start, Syntax::Llama3) => {
                    let t = self.buf.trim_start();
                    if t.is_empty() || (LLAMA_TAG.starts_with(t) && t.len() < LLAMA_TAG.len()) {
                        return out;
                    }
                    self.state = if t.starts_with('{') || t.starts_with(LLAMA_TAG) { State::Call } else { State::Text };
                }
                (State::Start, _) => self.state = State::Text,
                (State::Text, Syntax::Llama3) => {
                    let t = std::mem::take(&mut self.buf);
                    self.text(&mut out, t);
                    return out;
                }
                (State::Text, syntax) => {
                    let tag = if syntax == Syntax::Mistral { MISTRAL_TAG } else { HERMES_OPEN };
                    if let Some(at) = self.buf.find(tag) {
                        let before = self.buf[..at].to_owned();
                        self.text(&mut out, before);
                        self.buf.drain(..at + tag.len());
                        self.state = State::Call;
                        continue;
                    }
                    let keep = partial(&self.buf, tag);
                    let send: String = self.buf.drain(..self.buf.len() - keep).collect();
                    self.text(&mut out, send);
                    return out;
                }
                (State::Call, Syntax::Hermes) => {
                    let Some(at) = self.buf.find(HERMES_CLOSE) else { return out };
                    let inner = self.buf[..at].to_owned();
                    self.buf.drain(..at + HERMES_CLOSE.len());
                    self.state = State::Text;
                    let calls = calls_of_objects(&inner, &mut self.ids);
                    self.call(&mut out, calls, format!("{HERMES_OPEN}{inner}{HERMES_CLOSE}"));
                }
                (State::Call, _) => return out,
            }
        }
    }

    /// The end of the answer: what was held back.
    pub fn finish(&mut self) -> Vec<Delta> {
        let mut out = Vec::new();
        let rest = std::mem::take(&mut self.buf);
        match (self.state, self.format.syntax) {
            (State::Call, Syntax::Hermes) => {
                // Cut before its closing tag (max_tokens): a call if what came is one.
                let calls = calls_of_objects(&rest, &mut self.ids);
                self.call(&mut out, calls, format!("{HERMES_OPEN}{rest}"));
            }
            (State::Call, Syntax::Llama3) => {
                let body = rest.trim_start().strip_prefix(LLAMA_TAG).unwrap_or(&rest).to_owned();
                let calls = calls_of_objects(&body, &mut self.ids);
                self.call(&mut out, calls, rest);
            }
            (State::Call, Syntax::Mistral) => {
                let calls = calls_of_array(&rest, &mut self.ids).or_else(|| calls_of_objects(&rest, &mut self.ids));
                self.call(&mut out, calls, format!("{MISTRAL_TAG}{rest}"));
            }
            _ => self.text(&mut out, rest),
        }
        self.state = State::Text;
        out
    }
}
