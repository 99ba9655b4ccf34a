//! One stream of answer events, whoever answers: a request on a local engine ([`Answers::local`])
//! or an upstream server ([`Answers::remote`]). Every dialect's formatter (OpenAI's chat and
//! completions, Ollama's, D-Bus's signals) reads [`Answer`]s and writes its own shapes; what is
//! the same for all of them is done here, once:
//! - the engine's tokens become text per choice, stop strings applied ([`Output`]), and a request
//!   whose every choice met a stop string is stopped at the engine;
//! - with tools, each choice's text goes through the model's tool-call parser ([`ToolStream`]):
//!   calls leave the text as they complete, and a choice that called a tool and then stopped
//!   finishes with [`Finish::ToolCalls`];
//! - the stream always ends with exactly one [`Answer::Done`] or [`Answer::Failed`]: an engine
//!   that went away without a last word is a failure, never an answer that looks complete.

use super::api::ApiError;
use super::chat::Tools;
use super::conn::Hangup;
use super::reasoning::{Part, Reader, Reading};
use super::remote::events::{Event as Upstream, Events};
use super::remote::{Opened, Remote};
use super::request::{Output, Piece, Scored, Submitted};
use super::ModelHandle;
use inferd_engine::tools::parse::{Delta, ToolStream};
use inferd_engine::tools::ToolCall;
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

/// Why a choice ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Finish {
    /// The end of the turn.
    Stop,
    /// A stop string the request named (the answer ends before it).
    StopSequence(String),
    /// `max_tokens` or the end of the context.
    Length,
    /// It called tools and stopped.
    ToolCalls,
    /// An upstream's own reason (`content_filter`, ...).
    Other(String),
}

impl Finish {
    /// OpenAI's `finish_reason`.
    pub fn openai(&self) -> &str {
        match self {
            Finish::Stop | Finish::StopSequence(_) => "stop",
            Finish::Length => "length",
            Finish::ToolCalls => "tool_calls",
            Finish::Other(r) => r,
        }
    }

    /// Ollama's `done_reason`: a turn that called tools is a `stop` there.
    pub fn ollama(&self) -> &str {
        match self {
            Finish::ToolCalls => "stop",
            other => other.openai(),
        }
    }

    fn of_openai(r: &str) -> Finish {
        match r {
            "stop" => Finish::Stop,
            "length" => Finish::Length,
            "tool_calls" | "function_call" => Finish::ToolCalls,
            r => Finish::Other(r.to_owned()),
        }
    }
}

/// Token counts of a whole answer, and the decoder's statistics (local answers).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Usage {
    pub prompt: usize,
    pub completion: usize,
    /// Of the prompt, the tokens whose K/V came from the prefix cache (local answers; 0
    /// where unknown: an upstream's, an answer cut short by its stop strings).
    pub cached: usize,
    pub stats: BTreeMap<String, f64>,
}

/// One event of an answer.
#[derive(Clone, Debug, PartialEq)]
pub enum Answer {
    /// Answer text of a choice: `token` when it is one generated token's whole text (D-Bus
    /// reports it), `logprobs` for the tokens whose text this piece completes (possibly with no
    /// text of its own, when a tool-call parser holds the text back).
    Text { choice: u32, text: String, token: Option<u32>, logprobs: Vec<Scored> },
    /// Reasoning text of a choice (a thinking model's, or an upstream's `reasoning_content`).
    Reasoning { choice: u32, text: String },
    /// A complete tool call: `index` counts the choice's calls from 0.
    Call { choice: u32, index: usize, call: ToolCall },
    /// A choice ended.
    Finish { choice: u32, reason: Finish },
    /// Every choice ended: the last event.
    Done(Usage),
    /// The answer failed: the last event.
    Failed(ApiError),
}

/// An answer's events, read as they come.
pub struct Answers {
    source: Source,
    queue: VecDeque<Answer>,
    /// The last event was queued.
    over: bool,
    n: u32,
}

enum Source {
    Local(Box<Local>),
    Remote(Box<Relay>),
}

struct Local {
    sub: Submitted,
    out: Output,
    /// Per choice: its reasoning reader (a thinking model's chat answer).
    think: Vec<Option<Reader>>,
    /// Per choice: its tool-call parser (with tools) and the calls it found.
    split: Vec<Option<ToolStream>>,
    calls: Vec<usize>,
}

struct Relay {
    remote: Arc<Remote>,
    events: Events,
    hangup: Arc<Hangup>,
    /// The user's place, held while the answer flows.
    _place: super::request::Slot,
    calls: usize,
    pieces: usize,
    usage: Option<(u64, u64)>,
}

impl Answers {
    /// The answer of submitted request `sub` with `n` choices and `stop` strings; with `tools`
    /// (the request's, when the answer may call them), its text is read for calls in the
    /// model's format.
    pub fn local(sub: Submitted, n: u32, stop: Vec<String>, tools: Option<&Tools>) -> Answers {
        let mut out = Output::new(n, stop);
        if tools.is_some() {
            // Tool-call markers are special tokens in some vocabularies.
            out = out.keeping_special(&sub.model.model.tokenizer);
        }
        let split = (0..n)
            .map(|_| {
                tools.map(|t| ToolStream::new(t.format).offering(t.tools.iter().map(|t| t.name.clone()).collect()))
            })
            .collect();
        let local = Local { sub, out, think: Vec::new(), split, calls: vec![0; n as usize] };
        Answers { source: Source::Local(Box::new(local)), queue: VecDeque::new(), over: false, n }
    }

    /// The answer an upstream is giving (one choice): it ends when the client's `hangup` trips.
    pub fn remote(remote: Arc<Remote>, opened: Opened, hangup: Arc<Hangup>) -> Answers {
        let Opened { resp, place } = opened;
        let relay =
            Relay { remote, events: Events::new(resp), hangup, _place: place, calls: 0, pieces: 0, usage: None };
        Answers { source: Source::Remote(Box::new(relay)), queue: VecDeque::new(), over: false, n: 1 }
    }

    /// Reads each choice's reasoning apart as `reading` says ([`super::reasoning::start`]): a
    /// `<think>` block, or harmony's channels (whose markers the text then keeps, and whose
    /// calls are the answer's). An upstream's reasoning comes apart already.
    pub fn thinking(mut self, reading: Option<Reading>) -> Answers {
        if let (Source::Local(l), Some(reading)) = (&mut self.source, reading) {
            if reading == Reading::Harmony {
                l.out.keep(&l.sub.model.model.tokenizer, &inferd_engine::tools::harmony::MARKERS);
            }
            l.think = (0..self.n).map(|_| Some(Reader::new(reading))).collect();
        }
        self
    }

    /// The choices the answer has.
    pub fn choices(&self) -> u32 {
        self.n
    }

    /// The local model answering (none for an upstream).
    pub fn model(&self) -> Option<&Arc<ModelHandle>> {
        match &self.source {
            Source::Local(l) => Some(&l.sub.model),
            Source::Remote(_) => None,
        }
    }

    /// The request's id at its engine (none for an upstream).
    pub fn id(&self) -> Option<u64> {
        match &self.source {
            Source::Local(l) => Some(l.sub.id),
            Source::Remote(_) => None,
        }
    }

    /// The prompt's length in tokens, where known before the end.
    pub fn prompt_tokens(&self) -> Option<usize> {
        match &self.source {
            Source::Local(l) => Some(l.sub.prompt_tokens),
            Source::Remote(_) => None,
        }
    }

    /// The next event; `None` after the last one ([`Answer::Done`] or [`Answer::Failed`]).
    pub async fn next(&mut self) -> Option<Answer> {
        loop {
            if let Some(a) = self.queue.pop_front() {
                return Some(a);
            }
            if self.over {
                return None;
            }
            match &mut self.source {
                Source::Local(l) => l.step(&mut self.queue).await,
                Source::Remote(r) => r.step(&mut self.queue).await,
            }
            self.over = self.queue.iter().any(|a| matches!(a, Answer::Done(_) | Answer::Failed(_)));
            if self.over {
                // Nothing after the last event.
                let end = self.queue.iter().position(|a| matches!(a, Answer::Done(_) | Answer::Failed(_)));
                self.queue.truncate(end.map_or(self.queue.len(), |e| e + 1));
            }
        }
    }

    /// The whole answer, read to its end.
    pub async fn whole(mut self) -> Result<Whole, ApiError> {
        let mut w = Whole { choices: vec![Choice::default(); self.n as usize], usage: Usage::default() };
        while let Some(a) = self.next().await {
            match a {
                Answer::Text { choice, text, logprobs, .. } => {
                    if let Some(c) = w.choices.get_mut(choice as usize) {
                        c.text.push_str(&text);
                        c.logprobs.extend(logprobs);
                    }
                }
                Answer::Reasoning { choice, text } => {
                    if let Some(c) = w.choices.get_mut(choice as usize) {
                        c.reasoning.push_str(&text);
                    }
                }
                Answer::Call { choice, call, .. } => {
                    if let Some(c) = w.choices.get_mut(choice as usize) {
                        c.calls.push(call);
                    }
                }
                Answer::Finish { choice, reason } => {
                    if let Some(c) = w.choices.get_mut(choice as usize) {
                        c.finish = Some(reason);
                    }
                }
                Answer::Done(u) => {
                    w.usage = u;
                    return Ok(w);
                }
                Answer::Failed(e) => return Err(e),
            }
        }
        Err(ApiError::new(503, "the engine stopped", None))
    }
}

impl Local {
    /// Reads the engine's next event into answers.
    async fn step(&mut self, q: &mut VecDeque<Answer>) {
        let Some(ev) = self.sub.recv().await else {
            // The engine went away without a last word: say so rather than look complete.
            q.push_back(Answer::Failed(ApiError::new(503, "the engine stopped", None)));
            return;
        };
        let model = Arc::clone(&self.sub.model);
        for piece in self.out.on_event(&model.model, ev) {
            self.piece(piece, q);
        }
        if self.out.all_stopped() && !q.iter().any(|a| matches!(a, Answer::Done(_) | Answer::Failed(_))) {
            // Every choice met a stop string: the engine need not go on.
            self.sub.stop();
            if let Piece::Done { completion_tokens, cached_prompt_tokens, stats } = self.out.done_by_stop() {
                q.push_back(Answer::Done(Usage {
                    prompt: self.sub.prompt_tokens,
                    completion: completion_tokens,
                    cached: cached_prompt_tokens.min(self.sub.prompt_tokens),
                    stats,
                }));
            }
        }
    }

    fn piece(&mut self, piece: Piece, q: &mut VecDeque<Answer>) {
        match piece {
            Piece::Text { choice, text, token, logprobs } => self.reason(choice, text, Some(token), logprobs, false, q),
            Piece::End { choice, reason, stop, text, logprobs } => {
                // The held-back tail of the text: no single token completed it.
                self.reason(choice, text, None, logprobs, true, q);
                let called = self.calls.get(choice as usize).is_some_and(|&c| c > 0);
                let reason = match reason {
                    "length" => Finish::Length,
                    _ if called => Finish::ToolCalls,
                    _ => stop.map_or(Finish::Stop, Finish::StopSequence),
                };
                q.push_back(Answer::Finish { choice, reason });
            }
            Piece::Done { completion_tokens, cached_prompt_tokens, stats } => q.push_back(Answer::Done(Usage {
                prompt: self.sub.prompt_tokens,
                completion: completion_tokens,
                cached: cached_prompt_tokens.min(self.sub.prompt_tokens),
                stats,
            })),
            Piece::Failed(m) => q.push_back(Answer::Failed(ApiError::new(500, m, None))),
        }
    }

    /// A choice's text, its reasoning split off when it has a splitter (`last`: flush it);
    /// the answer proper goes on to [`Local::text`].
    fn reason(
        &mut self,
        choice: u32,
        text: String,
        token: Option<u32>,
        logprobs: Vec<Scored>,
        last: bool,
        q: &mut VecDeque<Answer>,
    ) {
        let Some(Some(split)) = self.think.get_mut(choice as usize) else {
            return self.text(choice, text, token, logprobs, last, q);
        };
        let mut parts = split.push(&text);
        if last {
            parts.extend(split.finish());
        }
        let mut content = String::new();
        for p in parts {
            match p {
                Part::Reasoning(r) => q.push_back(Answer::Reasoning { choice, text: r }),
                Part::Content(c) => content.push_str(&c),
                Part::Call(call) => {
                    let i = choice as usize;
                    let index = self.calls[i];
                    self.calls[i] += 1;
                    q.push_back(Answer::Call { choice, index, call });
                }
            }
        }
        let token = token.filter(|_| content == text);
        self.text(choice, content, token, logprobs, last, q);
    }

    /// A choice's text, through its tool-call parser when it has one (`last`: flush it).
    fn text(
        &mut self,
        choice: u32,
        text: String,
        token: Option<u32>,
        logprobs: Vec<Scored>,
        last: bool,
        q: &mut VecDeque<Answer>,
    ) {
        let i = choice as usize;
        let Some(Some(split)) = self.split.get_mut(i) else {
            if !text.is_empty() || !logprobs.is_empty() {
                q.push_back(Answer::Text { choice, text, token, logprobs });
            }
            return;
        };
        let mut deltas = split.push(&text);
        if last {
            deltas.extend(split.finish());
        }
        let mut logprobs = Some(logprobs).filter(|l| !l.is_empty());
        for d in deltas {
            match d {
                Delta::Content(t) if t.is_empty() => {}
                Delta::Content(t) => {
                    let token = token.filter(|_| t == text);
                    q.push_back(Answer::Text { choice, text: t, token, logprobs: logprobs.take().unwrap_or_default() });
                }
                Delta::Call(call) => {
                    if let Some(l) = logprobs.take() {
                        q.push_back(Answer::Text { choice, text: String::new(), token: None, logprobs: l });
                    }
                    let index = self.calls[i];
                    self.calls[i] += 1;
                    q.push_back(Answer::Call { choice, index, call });
                }
            }
        }
        if let Some(l) = logprobs {
            q.push_back(Answer::Text { choice, text: String::new(), token: None, logprobs: l });
        }
    }
}

impl Relay {
    /// Reads the upstream's next event into answers.
    async fn step(&mut self, q: &mut VecDeque<Answer>) {
        let ev = tokio::select! {
            e = self.events.next() => e,
            // Dropping the response closes the upstream's connection.
            () = self.hangup.wait() => {
                q.push_back(Answer::Failed(ApiError::new(499, "the client left", None)));
                return;
            }
        };
        let r = &self.remote;
        match ev {
            None => {
                let (prompt, completion) = self.usage.unwrap_or((0, self.pieces as u64));
                let usage = Usage {
                    prompt: prompt as usize,
                    completion: completion as usize,
                    cached: 0,
                    stats: BTreeMap::new(),
                };
                q.push_back(Answer::Done(usage));
            }
            Some(Err(m)) => {
                r.count_error();
                let e = ApiError::new(502, format!("upstream {} for {}: {m}", r.upstream, r.name), None);
                q.push_back(Answer::Failed(e));
            }
            Some(Ok(Upstream::Text(text))) => {
                self.pieces += 1;
                q.push_back(Answer::Text { choice: 0, text, token: None, logprobs: Vec::new() });
            }
            Some(Ok(Upstream::Reasoning(text))) => q.push_back(Answer::Reasoning { choice: 0, text }),
            Some(Ok(Upstream::Calls(calls))) => {
                for call in calls {
                    q.push_back(Answer::Call { choice: 0, index: self.calls, call });
                    self.calls += 1;
                }
            }
            Some(Ok(Upstream::Finish(why))) => {
                q.push_back(Answer::Finish { choice: 0, reason: Finish::of_openai(&why) })
            }
            Some(Ok(Upstream::Usage { prompt, completion })) => self.usage = Some((prompt, completion)),
        }
    }
}

/// A whole answer: its choices and its usage.
#[derive(Clone, Debug, Default)]
pub struct Whole {
    pub choices: Vec<Choice>,
    pub usage: Usage,
}

/// One whole choice.
#[derive(Clone, Debug, Default)]
pub struct Choice {
    pub text: String,
    pub reasoning: String,
    pub calls: Vec<ToolCall>,
    pub logprobs: Vec<Scored>,
    pub finish: Option<Finish>,
}

impl Choice {
    /// The answer text: beside calls, without the whitespace around them.
    pub fn content(&self) -> &str {
        if self.calls.is_empty() {
            &self.text
        } else {
            self.text.trim()
        }
    }

    /// Why it ended (`stop` when the answer did not say).
    pub fn reason(&self) -> Finish {
        self.finish.clone().unwrap_or(Finish::Stop)
    }
}
