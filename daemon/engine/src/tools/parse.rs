//! Tool calls read back out of a model's text: whole ([`ToolFormat::parse`]) or as it streams
//! ([`ToolStream`]: text that cannot be part of a call goes out at once, a call when it is
//! complete). What does not parse as a call stays text: nothing the model wrote is lost.
//!
//! Besides each syntax's own marker (`<tool_call>`, `<|python_tag|>`, `[TOOL_CALLS]`), a call is
//! read where models write one without it, as llama.cpp's parsers accept: a JSON object whose
//! first key is `name` (with `arguments` or `parameters`), or an array of them, bare or in a
//! fenced block (```` ```json ````); such a call must name one of the offered tools. Text before
//! a call stays text.

use super::{Syntax, ToolCall, ToolFormat};
use serde_json::Value;
use std::hash::{BuildHasher, Hasher};

/// Ids for the calls of one answer: `call_` and 16 letters or digits, or the 9 that Mistral's
/// templates insist on when the conversation comes back.
#[derive(Debug)]
pub(crate) struct CallIds {
    state: std::collections::hash_map::RandomState,
    n: u64,
    mistral: bool,
}

impl CallIds {
    fn new(format: ToolFormat) -> CallIds {
        CallIds { state: Default::default(), n: 0, mistral: format.syntax == Syntax::Mistral }
    }

    /// OpenAI's form of ids (`call_` and 16 letters and digits).
    pub(crate) fn plain() -> CallIds {
        CallIds { state: Default::default(), n: 0, mistral: false }
    }

    pub(crate) fn next(&mut self) -> String {
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

/// Every syntax's markers: the special tokens among them stay in the text the parser reads.
pub const MARKERS: [&str; 4] = [HERMES_OPEN, HERMES_CLOSE, LLAMA_TAG, MISTRAL_TAG];

const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";
const LLAMA_TAG: &str = "<|python_tag|>";
const MISTRAL_TAG: &str = "[TOOL_CALLS]";
const MISTRAL_ARGS: &str = "[ARGS]";
const FENCE: &str = "```";
/// The info strings of a fenced block that may hold a call.
const FENCE_LANGS: [&str; 5] = ["", "json", "JSON", "tool_call", "tool_code"];

impl ToolFormat {
    /// A whole answer as its text (trimmed) and its calls.
    pub fn parse(&self, text: &str) -> (String, Vec<ToolCall>) {
        split_whole(ToolStream::new(*self), text)
    }
}

/// A whole answer through `s`: its text (trimmed) and its calls.
pub fn split_whole(mut s: ToolStream, text: &str) -> (String, Vec<ToolCall>) {
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

/// A piece of a streamed answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Delta {
    Content(String),
    Call(ToolCall),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Text,
    /// After the syntax's own marker: Hermes until its closing tag; Llama 3's `<|python_tag|>`
    /// and Mistral's `[TOOL_CALLS]` until the end.
    Tagged,
    /// A call object (or an array of them) written without the marker, as models often do:
    /// bare, or in a fenced block whose opening line is the first `header` bytes.
    Json {
        fenced: bool,
        header: usize,
    },
}

/// Whether the text at some position begins a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Start {
    /// It does: the marker, or the opening of a JSON call whose first `header` bytes are not JSON.
    Yes(State, usize),
    /// It may: the text ends before that is known.
    Maybe,
    No,
}

/// `s` begins (after whitespace) a JSON object whose first key is `name`, or an array of such.
fn json_head(s: &str) -> Start {
    let mut t = s;
    if let Some(r) = t.strip_prefix('[') {
        t = r.trim_start();
        if t.is_empty() {
            return Start::Maybe;
        }
    }
    let Some(r) = t.strip_prefix('{') else { return Start::No };
    let r = r.trim_start();
    const KEY: &str = "\"name\"";
    if r.starts_with(KEY) {
        Start::Yes(State::Json { fenced: false, header: 0 }, 0)
    } else if KEY.starts_with(r) {
        Start::Maybe
    } else {
        Start::No
    }
}

/// Splits a streamed answer into text and calls.
#[derive(Debug)]
pub struct ToolStream {
    format: ToolFormat,
    /// The tools offered: a call written without the syntax's marker must name one of them
    /// (a JSON answer that merely has a `name` key stays text). `None`: any name.
    names: Option<Vec<String>>,
    state: State,
    buf: String,
    ids: CallIds,
    calls: usize,
}

impl ToolStream {
    pub fn new(format: ToolFormat) -> ToolStream {
        ToolStream { format, names: None, state: State::Text, buf: String::new(), ids: CallIds::new(format), calls: 0 }
    }

    /// Calls written without the syntax's marker count only when they name one of `names`.
    pub fn offering(mut self, names: Vec<String>) -> ToolStream {
        self.names = Some(names);
        self
    }

    /// Calls found so far.
    pub fn calls(&self) -> usize {
        self.calls
    }

    /// The syntax's own marker of a call.
    fn tag(&self) -> &'static str {
        match self.format.syntax {
            Syntax::Hermes => HERMES_OPEN,
            Syntax::Llama3 => LLAMA_TAG,
            Syntax::Mistral => MISTRAL_TAG,
        }
    }

    fn text(&self, out: &mut Vec<Delta>, t: String) {
        // Whitespace and separators between calls are the syntax's, not an answer.
        let between_calls =
            self.calls > 0 && t.trim_matches(|c: char| c.is_whitespace() || c == ';' || c == ',').is_empty();
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

    /// A call of an offered tool from a JSON object (any name when the tools are not known).
    fn offered(&mut self, v: &Value) -> Option<ToolCall> {
        let c = call_of(v, &mut self.ids)?;
        match &self.names {
            Some(names) if !names.contains(&c.name) => None,
            _ => Some(c),
        }
    }

    /// The calls of a JSON object or array written without the marker.
    fn calls_of_json(&mut self, v: &Value) -> Option<Vec<ToolCall>> {
        match v {
            Value::Array(a) if !a.is_empty() => a.iter().map(|c| self.offered(c)).collect(),
            Value::Object(_) => self.offered(v).map(|c| vec![c]),
            _ => None,
        }
    }

    /// Whether the text `s` (a suffix of what is held) begins a call.
    fn start(&self, s: &str) -> Start {
        let tag = self.tag();
        if s.starts_with(tag) {
            return Start::Yes(State::Tagged, tag.len());
        }
        if tag.starts_with(s) {
            return Start::Maybe;
        }
        if let Some(rest) = s.strip_prefix(FENCE) {
            let lang_len = rest.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(rest.len());
            let (lang, after) = rest.split_at(lang_len);
            if after.is_empty() {
                return if FENCE_LANGS.iter().any(|l| l.starts_with(lang)) { Start::Maybe } else { Start::No };
            }
            if !FENCE_LANGS.contains(&lang) || !after.starts_with(char::is_whitespace) {
                return Start::No;
            }
            let body = after.trim_start();
            if body.is_empty() {
                return Start::Maybe;
            }
            let header = s.len() - body.len();
            return match json_head(body) {
                Start::Yes(..) => Start::Yes(State::Json { fenced: true, header }, header),
                other => other,
            };
        }
        if FENCE.starts_with(s) {
            return Start::Maybe;
        }
        json_head(s)
    }

    /// The next piece of text: what can be sent now.
    pub fn push(&mut self, text: &str) -> Vec<Delta> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        loop {
            match self.state {
                State::Text => {
                    let mut found = None;
                    for (at, c) in self.buf.char_indices() {
                        if !matches!(c, '<' | '[' | '`' | '{') {
                            continue;
                        }
                        match self.start(&self.buf[at..]) {
                            Start::No => {}
                            s => {
                                found = Some((at, s));
                                break;
                            }
                        }
                    }
                    match found {
                        None => {
                            let t = std::mem::take(&mut self.buf);
                            self.text(&mut out, t);
                            return out;
                        }
                        Some((at, s)) => {
                            let before: String = self.buf.drain(..at).collect();
                            self.text(&mut out, before);
                            match s {
                                Start::Yes(State::Tagged, len) => {
                                    self.buf.drain(..len);
                                    self.state = State::Tagged;
                                }
                                Start::Yes(state, _) => self.state = state,
                                _ => return out,
                            }
                        }
                    }
                }
                State::Tagged if self.format.syntax == Syntax::Hermes => {
                    let Some(at) = self.buf.find(HERMES_CLOSE) else { return out };
                    let inner = self.buf[..at].to_owned();
                    self.buf.drain(..at + HERMES_CLOSE.len());
                    self.state = State::Text;
                    let calls = calls_of_objects(&inner, &mut self.ids);
                    self.call(&mut out, calls, format!("{HERMES_OPEN}{inner}{HERMES_CLOSE}"));
                }
                State::Tagged => return out,
                State::Json { fenced, header } => {
                    let mut it = serde_json::Deserializer::from_str(&self.buf[header..]).into_iter::<Value>();
                    let v = match it.next() {
                        None => return out,
                        Some(Err(e)) if e.is_eof() => return out,
                        Some(Err(_)) => {
                            // Not JSON after all: its opening is text, and the scan goes on after it.
                            let first = self.buf[header..].chars().next().map_or(0, char::len_utf8);
                            let t: String = self.buf.drain(..header + first).collect();
                            self.text(&mut out, t);
                            self.state = State::Text;
                            continue;
                        }
                        Some(Ok(v)) => v,
                    };
                    let mut end = header + it.byte_offset();
                    if fenced {
                        let after = &self.buf[end..];
                        let t = after.trim_start();
                        if t.len() < FENCE.len() && FENCE.starts_with(t) {
                            return out; // the closing fence may be coming
                        }
                        if t.starts_with(FENCE) {
                            end += after.len() - t.len() + FENCE.len();
                        }
                    }
                    let raw: String = self.buf.drain(..end).collect();
                    self.state = State::Text;
                    let calls = self.calls_of_json(&v);
                    self.call(&mut out, calls, raw);
                }
            }
        }
    }

    /// The end of the answer: what was held back.
    pub fn finish(&mut self) -> Vec<Delta> {
        let mut out = Vec::new();
        if let State::Json { header, .. } = self.state {
            // A fenced call whose block never closed is still a call.
            let v = serde_json::from_str::<Value>(self.buf[header..].trim()).ok();
            let calls = v.and_then(|v| self.calls_of_json(&v));
            let rest = std::mem::take(&mut self.buf);
            self.call(&mut out, calls, rest);
            self.state = State::Text;
            return out;
        }
        let rest = std::mem::take(&mut self.buf);
        match (self.state, self.format.syntax) {
            (State::Tagged, Syntax::Hermes) => {
                // Cut before its closing tag (max_tokens): a call if what came is one.
                let calls = calls_of_objects(&rest, &mut self.ids);
                self.call(&mut out, calls, format!("{HERMES_OPEN}{rest}"));
            }
            (State::Tagged, Syntax::Llama3) => {
                let calls = calls_of_objects(&rest, &mut self.ids);
                self.call(&mut out, calls, format!("{LLAMA_TAG}{rest}"));
            }
            (State::Tagged, Syntax::Mistral) => {
                let calls = calls_of_array(&rest, &mut self.ids)
                    .or_else(|| calls_of_objects(&rest, &mut self.ids))
                    .or_else(|| calls_of_args(&rest, &mut self.ids));
                self.call(&mut out, calls, format!("{MISTRAL_TAG}{rest}"));
            }
            _ => self.text(&mut out, rest),
        }
        self.state = State::Text;
        out
    }
}

/// Mistral's newer calls (Mistral Small 3.2, Devstral): `name[ARGS]{...}`, one after another,
/// each after its own `[TOOL_CALLS]`.
fn calls_of_args(text: &str, ids: &mut CallIds) -> Option<Vec<ToolCall>> {
    let mut calls = Vec::new();
    for part in text.split(MISTRAL_TAG) {
        let (name, args) = part.split_once(MISTRAL_ARGS)?;
        let name = name.trim();
        let ok = !name.is_empty() && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        let args: Value = serde_json::from_str(args.trim()).ok()?;
        if !ok || !args.is_object() {
            return None;
        }
        calls.push(ToolCall { id: ids.next(), name: name.to_owned(), arguments: args.to_string() });
    }
    (!calls.is_empty()).then_some(calls)
}
