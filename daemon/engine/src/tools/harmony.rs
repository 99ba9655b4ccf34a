//! gpt-oss's chat format, "harmony": an answer is a run of messages, each a header and a body,
//! `<|channel|>analysis<|message|>…<|end|><|start|>assistant<|channel|>final<|message|>…`, the
//! last one ended by `<|return|>` (or `<|call|>` after a tool call, both ending generation).
//! The `analysis` channel is reasoning; `final` is the answer; a `commentary` message whose
//! header names a recipient (`to=functions.NAME`, before or after the channel) is a call of
//! that tool with the body as its JSON arguments (`<|constrain|>json` says so), and one
//! without a recipient is a preamble the user sees, so answer text.
//!
//! [`Harmony`] reads one choice's text as it streams (its special tokens kept in the text:
//! [`MARKERS`]), holding what may be the start of a marker until the next piece settles it.
//! Text that is not in the format at all (no header where one should start) is answer text.

use super::parse::CallIds;
use super::ToolCall;

const START: &str = "<|start|>";
const CHANNEL: &str = "<|channel|>";
const MESSAGE: &str = "<|message|>";
const END: &str = "<|end|>";
const CONSTRAIN: &str = "<|constrain|>";
const RETURN: &str = "<|return|>";
const CALL: &str = "<|call|>";

/// The format's markers that an answer's text must keep (special tokens in its vocabulary).
pub const MARKERS: [&str; 7] = [START, CHANNEL, MESSAGE, END, CONSTRAIN, RETURN, CALL];

/// Whether a chat template writes harmony.
pub fn is_harmony(template: Option<&str>) -> bool {
    template.is_some_and(|t| t.contains(CHANNEL) && t.contains(MESSAGE))
}

/// A piece of an answer: reasoning, the answer proper, or a tool call (the daemon's `<think>`
/// splitter gives the first two).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Part {
    Reasoning(String),
    Content(String),
    Call(ToolCall),
}

/// What the current message's body is.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Body {
    Reasoning,
    Content,
    /// A call of this tool: the body is held whole, its arguments.
    Call(String),
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum State {
    /// Reading a message's header, up to `<|message|>`.
    Header,
    Body(Body),
}

/// Reads one choice's harmony text as it streams ([module docs](self)).
#[derive(Debug)]
pub struct Harmony {
    state: State,
    held: String,
    /// Nothing of the current body was given out yet (its leading whitespace is dropped).
    fresh: bool,
    ids: CallIds,
}

impl Default for Harmony {
    fn default() -> Self {
        Harmony::new()
    }
}

impl Harmony {
    /// A reader of an answer whose prompt ended with `<|start|>assistant`: the answer starts
    /// with a header.
    pub fn new() -> Harmony {
        Harmony { state: State::Header, held: String::new(), fresh: true, ids: CallIds::plain() }
    }

    /// The parts `text` completes.
    pub fn push(&mut self, text: &str) -> Vec<Part> {
        self.held.push_str(text);
        let mut out = Vec::new();
        loop {
            match &self.state {
                State::Header => {
                    if let Some(i) = self.held.find(MESSAGE) {
                        let body = header_body(&self.held[..i]);
                        self.held.drain(..i + MESSAGE.len());
                        self.state = State::Body(body);
                        self.fresh = true;
                        continue;
                    }
                    let t = self.held.trim_start();
                    // A header starts with a marker, or with the role or channel the prompt's
                    // `<|start|>` left to write; anything else is not harmony: answer text.
                    let plausible = t.is_empty()
                        || t.starts_with("<|")
                        || "<|".starts_with(t)
                        || t.starts_with("assistant")
                        || "assistant".starts_with(t);
                    if !plausible {
                        self.state = State::Body(Body::Content);
                        self.fresh = false;
                        continue;
                    }
                    return out;
                }
                State::Body(body) => {
                    let body = body.clone();
                    let ends = [END, RETURN, CALL, START, CHANNEL];
                    let found = ends.iter().filter_map(|m| self.held.find(m).map(|i| (i, *m))).min();
                    if let Some((i, marker)) = found {
                        let rest = self.held.split_off(i);
                        self.emit(&body, &mut out, true);
                        // `<|start|>` and `<|channel|>` begin the next header themselves (a
                        // model may leave out the `<|end|>` before them).
                        let skip = if marker == START || marker == CHANNEL { 0 } else { marker.len() };
                        self.held = rest[skip..].to_owned();
                        self.state = State::Header;
                        continue;
                    }
                    if !matches!(body, Body::Call(_)) {
                        // Give out all but what may be the start of a marker.
                        let held = &self.held;
                        let keep = held.rfind('<').filter(|&i| MARKERS.iter().any(|m| m.starts_with(&held[i..])));
                        let rest = keep.map(|i| self.held.split_off(i)).unwrap_or_default();
                        self.emit(&body, &mut out, false);
                        self.held = rest;
                    }
                    return out;
                }
            }
        }
    }

    /// The parts held at the end of the answer (generation stopped at `<|return|>` or
    /// `<|call|>`, which the text does not show, or ran out of tokens).
    pub fn finish(&mut self) -> Vec<Part> {
        let mut out = Vec::new();
        match self.state.clone() {
            State::Body(body) => self.emit(&body, &mut out, true),
            // A header cut short says nothing.
            State::Header => self.held.clear(),
        }
        self.state = State::Header;
        out
    }

    /// Gives out the held text as the body's (a call's whole, when `whole`).
    fn emit(&mut self, body: &Body, out: &mut Vec<Part>, whole: bool) {
        match body {
            Body::Call(name) => {
                if whole {
                    let args = std::mem::take(&mut self.held);
                    let args = args.trim();
                    // Arguments that are not JSON are passed on as a string.
                    let arguments = match serde_json::from_str::<serde_json::Value>(args) {
                        Ok(v) => v.to_string(),
                        Err(_) => serde_json::Value::from(args).to_string(),
                    };
                    out.push(Part::Call(ToolCall { id: self.ids.next(), name: name.clone(), arguments }));
                }
            }
            Body::Reasoning | Body::Content => {
                let mut text = std::mem::take(&mut self.held);
                if self.fresh {
                    text = text.trim_start().to_owned();
                }
                if !text.is_empty() {
                    self.fresh = false;
                    out.push(if *body == Body::Reasoning { Part::Reasoning(text) } else { Part::Content(text) });
                }
            }
        }
    }
}

/// What a message's header (the text before `<|message|>`) says its body is.
fn header_body(header: &str) -> Body {
    let header = header.replace(START, " ").replace(CONSTRAIN, " ");
    let channel = header.split(CHANNEL).nth(1).and_then(|c| c.split_whitespace().next()).unwrap_or("final");
    let recipient = header
        .split_whitespace()
        .find_map(|w| w.strip_prefix("to="))
        .map(|r| r.split(CHANNEL).next().unwrap_or(r))
        .map(|r| r.strip_prefix("functions.").unwrap_or(r).to_owned());
    match (channel, recipient) {
        (_, Some(name)) if !name.is_empty() && name != "user" && name != "all" => Body::Call(name),
        ("analysis", _) => Body::Reasoning,
        _ => Body::Content,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test
mod tests {
    use super::*;

    /// The reasoning, the content and the calls (name, arguments) of `pieces`.
    fn read(pieces: &[&str]) -> (String, String, Vec<(String, String)>) {
        let mut h = Harmony::new();
        let mut parts: Vec<Part> = pieces.iter().flat_map(|p| h.push(p)).collect();
        parts.extend(h.finish());
        let (mut r, mut c, mut calls) = (String::new(), String::new(), Vec::new());
        for p in parts {
            match p {
                Part::Reasoning(t) => r.push_str(&t),
                Part::Content(t) => c.push_str(&t),
                Part::Call(call) => calls.push((call.name, call.arguments)),
            }
        }
        (r, c, calls)
    }

    /// Every cut of `whole` into two pieces, and one character at a time, reads as `whole`.
    fn any_cut(whole: &str) -> (String, String, Vec<(String, String)>) {
        let want = read(&[whole]);
        for i in (1..whole.len()).filter(|&i| whole.is_char_boundary(i)) {
            assert_eq!(read(&[&whole[..i], &whole[i..]]), want, "cut at {i} of {whole:?}");
        }
        let chars: Vec<String> = whole.chars().map(String::from).collect();
        assert_eq!(read(&chars.iter().map(String::as_str).collect::<Vec<_>>()), want, "{whole:?} a char at a time");
        want
    }

    #[test]
    fn analysis_is_reasoning_and_final_is_the_answer() {
        let whole = "<|channel|>analysis<|message|>The user greets. Reply.<|end|>\
                     <|start|>assistant<|channel|>final<|message|>Hello! How can I help?";
        let (r, c, calls) = any_cut(whole);
        assert_eq!((r.as_str(), c.as_str()), ("The user greets. Reply.", "Hello! How can I help?"));
        assert!(calls.is_empty());
    }

    #[test]
    fn a_commentary_message_to_a_function_is_a_call() {
        // The recipient after the channel, and before it (both are written).
        for whole in [
            "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary \
             to=functions.get_weather <|constrain|>json<|message|>{\"location\": \"Paris\"}",
            "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant to=functions.get_weather\
             <|channel|>commentary json<|message|>{\"location\":\"Paris\"}",
        ] {
            let (r, c, calls) = any_cut(whole);
            assert_eq!((r.as_str(), c.as_str()), ("Need weather.", ""));
            assert_eq!(calls, [("get_weather".to_owned(), r#"{"location":"Paris"}"#.to_owned())]);
        }
        // A preamble (commentary to no one) is text the user sees; arguments that are not
        // JSON are kept as a string.
        let (_, c, calls) = any_cut(
            "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>commentary \
             to=functions.echo<|message|>plain words",
        );
        assert_eq!(c, "Checking.");
        assert_eq!(calls, [("echo".to_owned(), r#""plain words""#.to_owned())]);
    }

    #[test]
    fn text_outside_the_format_and_cut_answers() {
        // A model that answers plainly: all of it is the answer.
        assert_eq!(any_cut("Just text, <|no marker"), (String::new(), "Just text, <|no marker".into(), vec![]));
        // Cut off inside the reasoning: what came is reasoning; inside a header: nothing.
        assert_eq!(read(&["<|channel|>analysis<|message|>Thinking about"]).0, "Thinking about");
        assert_eq!(read(&["<|channel|>analysis<|message|>x<|end|><|start|>assist"]), ("x".into(), "".into(), vec![]));
        // A final message without the <|end|> before the next header still ends there.
        let (r, c, _) = any_cut("<|channel|>analysis<|message|>a<|channel|>final<|message|>b");
        assert_eq!((r.as_str(), c.as_str()), ("a", "b"));
    }

    #[test]
    fn a_template_is_harmony_by_its_markers() {
        assert!(is_harmony(Some("{{ '<|start|>assistant<|channel|>final<|message|>' }}")));
        assert!(!is_harmony(Some("<|im_start|>assistant")));
        assert!(!is_harmony(None));
    }
}
