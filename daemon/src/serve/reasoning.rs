//! A thinking model's reasoning, apart from its answer: the template's thinking switch as
//! each API asks for it ([`switch`]: OpenAI's `reasoning_effort` and `chat_template_kwargs`,
//! Ollama's `think`, Anthropic's `thinking`, the Responses API's `reasoning.effort`), and the
//! answer's `<think>…</think>` block (Gemma 4's `<|channel>thought…<channel|>`) split off as
//! reasoning ([`Split`]), as llama-server's default reasoning format and vLLM's reasoning
//! parsers do. A template that opens the block itself (its generation prompt ends in
//! `<think>`) starts the answer inside it.

use super::api::ApiError;
use inferd_engine::chat::Extra;
use inferd_engine::model::Model;
use serde_json::{json, Value};

/// A piece of an answer's text: reasoning, the answer proper, or (harmony's) a tool call.
pub use inferd_engine::tools::harmony::Part;

/// The tags around a block of reasoning.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tags {
    pub open: &'static str,
    pub close: &'static str,
}

/// Qwen3 / 3.5's, DeepSeek-R1's and most thinking models' block.
pub const THINK: Tags = Tags { open: "<think>", close: "</think>" };

/// Gemma 4's thought channel.
pub const THOUGHT_CHANNEL: Tags = Tags { open: "<|channel>thought", close: "<channel|>" };

/// Whether a chat template speaks of thinking: a block of it, or a switch for it.
pub fn capable(template: Option<&str>) -> bool {
    let t = template.unwrap_or_default();
    [THINK.open, THOUGHT_CHANNEL.open, "enable_thinking", "reasoning_content", "reasoning_effort"]
        .iter()
        .any(|k| t.contains(k))
}

/// How a thinking model's chat answer is read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reading {
    /// A block of reasoning between `tags`, which the prompt opened already (`open`) or the
    /// answer may open.
    Think { open: bool, tags: Tags },
    /// gpt-oss's harmony channels ([`inferd_engine::tools::harmony`]).
    Harmony,
}

/// How a chat answer of `model` to `prompt` is read: harmony where its template writes it;
/// `None` when its template has no block of reasoning; else its tags, and whether the prompt
/// ends inside one it opened (its last tokens spell it).
pub fn start(model: &Model, prompt: &[u32]) -> Option<Reading> {
    let template = model.chat_template.as_deref();
    if inferd_engine::tools::harmony::is_harmony(template) {
        return Some(Reading::Harmony);
    }
    let tags = [THOUGHT_CHANNEL, THINK].into_iter().find(|t| template.is_some_and(|s| s.contains(t.open)))?;
    let tail = &prompt[prompt.len().saturating_sub(8)..];
    let open = model.tokenizer.decode(tail, false).is_ok_and(|t| t.trim_end().ends_with(tags.open));
    Some(Reading::Think { open, tags })
}

/// The template variables for a request's thinking: `enable` (on or off) and `effort`
/// (`low`, `medium`, `high`...), each set only when the request said.
pub fn switch(enable: Option<bool>, effort: Option<&str>) -> Extra {
    let mut extra = Extra::new();
    if let Some(e) = enable {
        extra.insert("enable_thinking".into(), json!(e));
    }
    if let Some(e) = effort {
        extra.insert("reasoning_effort".into(), json!(e));
    }
    extra
}

/// OpenAI's `reasoning_effort` (`none` and `minimal` turn thinking off; vLLM's and
/// llama-server's reading) and a client's `chat_template_kwargs`, which win where both set a
/// variable.
pub fn openai(reasoning_effort: Option<&Value>, kwargs: Option<&Value>) -> Result<Extra, ApiError> {
    let mut extra = match reasoning_effort.filter(|v| !v.is_null()) {
        None => Extra::new(),
        Some(Value::String(e)) => match e.as_str() {
            "none" | "minimal" => switch(Some(false), Some(e)),
            "low" | "medium" | "high" | "xhigh" => switch(Some(true), Some(e)),
            _ => {
                return Err(ApiError::bad(
                    format!("reasoning_effort must be none, minimal, low, medium or high, not {e:?}"),
                    "reasoning_effort",
                ))
            }
        },
        Some(_) => return Err(ApiError::bad("reasoning_effort must be a string", "reasoning_effort")),
    };
    match kwargs.filter(|v| !v.is_null()) {
        None => {}
        Some(Value::Object(o)) => extra.extend(o.iter().map(|(k, v)| (k.clone(), v.clone()))),
        Some(_) => return Err(ApiError::bad("chat_template_kwargs must be an object", "chat_template_kwargs")),
    }
    Ok(extra)
}

/// Ollama's `think`: `true`/`false`, or a level (`low`, `medium`, `high`) for the models that
/// take one. Asking a model without a thinking switch to think is refused, as Ollama does.
pub fn ollama(think: Option<&Value>, model: &str, template: Option<&str>) -> Result<Extra, ApiError> {
    let (enable, effort) = match think.filter(|v| !v.is_null()) {
        None => return Ok(Extra::new()),
        Some(Value::Bool(b)) => (*b, None),
        Some(Value::String(l)) if ["low", "medium", "high"].contains(&l.as_str()) => (true, Some(l.as_str())),
        Some(_) => return Err(ApiError::bad("think must be true, false, \"low\", \"medium\" or \"high\"", "think")),
    };
    if enable && !capable(template) {
        return Err(ApiError::bad(format!("\"{model}\" does not support thinking"), "think"));
    }
    Ok(switch(Some(enable), effort))
}

/// One choice's reader: a reasoning block's splitter or harmony's channels.
#[derive(Debug)]
pub enum Reader {
    Think(Split),
    Harmony(Box<inferd_engine::tools::harmony::Harmony>),
}

impl Reader {
    pub fn new(reading: Reading) -> Reader {
        match reading {
            Reading::Think { open, tags } => Reader::Think(Split::new(open, tags)),
            Reading::Harmony => Reader::Harmony(Box::default()),
        }
    }

    /// The parts `text` completes.
    pub fn push(&mut self, text: &str) -> Vec<Part> {
        match self {
            Reader::Think(s) => s.push(text),
            Reader::Harmony(h) => h.push(text),
        }
    }

    /// The parts held at the end of the answer.
    pub fn finish(&mut self) -> Vec<Part> {
        match self {
            Reader::Think(s) => s.finish(),
            Reader::Harmony(h) => h.finish(),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Nothing but whitespace yet: a block may still open.
    Start,
    Thinking,
    Answer,
}

/// Splits one choice's text, as it streams, into its reasoning and its answer. Text that may
/// be the start of a tag is held until the next piece settles it; the whitespace between the
/// block and the answer (and at the block's start) belongs to neither.
#[derive(Clone, Debug)]
pub struct Split {
    tags: Tags,
    state: State,
    held: String,
    /// Nothing of the current part was given out yet (its leading whitespace is dropped).
    fresh: bool,
}

impl Split {
    /// A splitter for an answer that starts inside the block (`open`) or before it.
    pub fn new(open: bool, tags: Tags) -> Split {
        Split { tags, state: if open { State::Thinking } else { State::Start }, held: String::new(), fresh: true }
    }

    /// The parts `text` completes.
    pub fn push(&mut self, text: &str) -> Vec<Part> {
        self.held.push_str(text);
        let Tags { open, close } = self.tags;
        let mut out = Vec::new();
        loop {
            match self.state {
                State::Start => {
                    let t = self.held.trim_start();
                    if let Some(rest) = t.strip_prefix(open) {
                        self.held = rest.to_owned();
                        self.state = State::Thinking;
                        self.fresh = true;
                        continue;
                    }
                    if t.is_empty() || open.starts_with(t) {
                        return out;
                    }
                    self.state = State::Answer;
                    self.fresh = false;
                    out.push(Part::Content(std::mem::take(&mut self.held)));
                    return out;
                }
                State::Thinking => {
                    if let Some(i) = self.held.find(close) {
                        let rest = self.held.split_off(i);
                        self.emit(&mut out, Part::Reasoning);
                        self.held = rest[close.len()..].to_owned();
                        self.state = State::Answer;
                        self.fresh = true;
                        continue;
                    }
                    // Keep what may be the start of the closing tag.
                    let keep = (1..close.len().min(self.held.len() + 1))
                        .rev()
                        .find(|&n| {
                            self.held.is_char_boundary(self.held.len() - n)
                                && close.starts_with(&self.held[self.held.len() - n..])
                        })
                        .unwrap_or(0);
                    let rest = self.held.split_off(self.held.len() - keep);
                    self.emit(&mut out, Part::Reasoning);
                    self.held = rest;
                    return out;
                }
                State::Answer => {
                    self.emit(&mut out, Part::Content);
                    return out;
                }
            }
        }
    }

    /// The parts held at the end of the answer.
    pub fn finish(&mut self) -> Vec<Part> {
        let mut out = Vec::new();
        match self.state {
            State::Thinking => self.emit(&mut out, Part::Reasoning),
            State::Start | State::Answer => self.emit(&mut out, Part::Content),
        }
        out
    }

    /// Gives out the held text as a part of kind `part`, less the part's leading whitespace.
    fn emit(&mut self, out: &mut Vec<Part>, part: fn(String) -> Part) {
        let mut text = std::mem::take(&mut self.held);
        if self.fresh {
            text = text.trim_start().to_owned();
        }
        if !text.is_empty() {
            self.fresh = false;
            out.push(part(text));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(open: bool, pieces: &[&str]) -> (String, String) {
        split_with(THINK, open, pieces)
    }

    fn split_with(tags: Tags, open: bool, pieces: &[&str]) -> (String, String) {
        let mut s = Split::new(open, tags);
        let (mut r, mut c) = (String::new(), String::new());
        let mut parts: Vec<Part> = pieces.iter().flat_map(|p| s.push(p)).collect();
        parts.extend(s.finish());
        for p in parts {
            match p {
                Part::Reasoning(t) => r.push_str(&t),
                Part::Content(t) => c.push_str(&t),
                Part::Call(_) => unreachable!("a <think> block has no calls"),
            }
        }
        (r, c)
    }

    #[test]
    fn a_think_block_is_reasoning_however_the_pieces_cut_its_tags() {
        let whole = "<think>\nThe user greets.\n</think>\n\nHello!";
        let want = ("The user greets.\n".to_owned(), "Hello!".to_owned());
        assert_eq!(split(false, &[whole]), want);
        // Every cut into two pieces, and one character at a time.
        for i in 1..whole.len() {
            assert_eq!(split(false, &[&whole[..i], &whole[i..]]), want, "cut at {i}");
        }
        let chars: Vec<String> = whole.chars().map(String::from).collect();
        assert_eq!(split(false, &chars.iter().map(String::as_str).collect::<Vec<_>>()), want);
    }

    #[test]
    fn gemma_4s_thought_channel_is_reasoning_too() {
        let whole = "<|channel>thought\nThe user greets.<channel|>Hello!";
        let want = ("The user greets.".to_owned(), "Hello!".to_owned());
        for i in 1..whole.len() {
            assert_eq!(split_with(THOUGHT_CHANNEL, false, &[&whole[..i], &whole[i..]]), want, "cut at {i}");
        }
        // Thinking off: the template writes the channel closed and empty, the answer is content.
        assert_eq!(split_with(THOUGHT_CHANNEL, false, &["Hello!"]), (String::new(), "Hello!".into()));
    }

    #[test]
    fn an_opened_block_an_unclosed_one_and_none() {
        assert_eq!(split(true, &["Hmm, 2+2", " is 4.</th", "ink>4"]), ("Hmm, 2+2 is 4.".into(), "4".into()));
        assert_eq!(split(true, &["still thinking <", "/thi"]), ("still thinking </thi".into(), String::new()));
        assert_eq!(
            split(false, &["  ", "Plain answer with <think> inside"]),
            (String::new(), "  Plain answer with <think> inside".into())
        );
        assert_eq!(split(false, &["<thi", "s is no tag"]), (String::new(), "<this is no tag".into()));
        assert_eq!(split(false, &["<think></think>", "Only this"]), (String::new(), "Only this".into()));
    }

    #[test]
    fn each_api_sets_the_switch_its_way() {
        let e = openai(Some(&json!("low")), Some(&json!({ "enable_thinking": false, "x": 1 }))).unwrap();
        assert_eq!(e["enable_thinking"], false, "chat_template_kwargs win");
        assert_eq!((e["reasoning_effort"].clone(), e["x"].clone()), (json!("low"), json!(1)));
        assert_eq!(openai(Some(&json!("none")), None).unwrap()["enable_thinking"], false);
        assert!(openai(Some(&json!("lots")), None).is_err());
        let thinker = Some("{% if enable_thinking %}<think>{% endif %}");
        assert_eq!(ollama(Some(&json!("high")), "m", thinker).unwrap(), switch(Some(true), Some("high")));
        assert!(ollama(Some(&json!(false)), "m", None).unwrap()["enable_thinking"] == false);
        let e = ollama(Some(&json!(true)), "smol", Some("{{ messages }}")).unwrap_err();
        assert_eq!(e.message, "\"smol\" does not support thinking");
        assert!(ollama(None, "m", None).unwrap().is_empty());
    }
}
