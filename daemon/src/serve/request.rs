//! The request path both edges share (HTTP and D-Bus): a typed [`Request`] (each edge builds
//! it, `fields.rs`), checked and turned into a [`Submission`] for the right model's engine
//! thread; the per-user
//! limit; and the way back, [`Output`], which turns the engine's token events into text pieces
//! per choice, with stop strings applied. Errors are [`ApiError`]s, which each edge renders in
//! its own protocol (the OpenAI error object, a D-Bus error).

use super::api::ApiError;
use super::conn::Hangup;
use super::{ModelHandle, Shared};
use inferd_engine::constraint::Grammar;
use inferd_engine::model::Model;
use inferd_engine::plugin::{FinishReason, LoadedStrategy, PluginError, Session, SessionRequest};
use inferd_engine::request::Request;
use inferd_engine::sched::{Command, Event, Priority, RequestId, RequestMeta, Submission};
use inferd_engine::tokenizer::stream::StreamDecoder;
use serde_json::Value;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

/// A checked request, ready for its engine thread.
pub struct Prepared {
    pub model: Arc<ModelHandle>,
    pub strategy: Arc<LoadedStrategy>,
    pub prompt: Vec<u32>,
    pub params: String,
    pub max_tokens: u32,
    pub n: u32,
    pub seed: u64,
    pub priority: Priority,
    pub stop: Vec<String>,
    /// The strategy reports each token's log-probability, with this many alternatives.
    pub logprobs: Option<u32>,
    /// The response format, compiled for the model.
    pub grammar: Option<Grammar>,
    /// The prompt's images, at their positions.
    pub images: Vec<inferd_engine::vision::media::PromptImage>,
}

impl Shared {
    /// Runs a request's CPU work (parsing its JSON, tokenizing, rendering a chat template,
    /// compiling a grammar) on the blocking pool, one job per core at a time, so that the
    /// runtime's two workers only move bytes: a client sending megabytes of prompt delays
    /// nobody's `/health` or token stream.
    pub async fn cpu<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
    ) -> Result<T, ApiError> {
        let _permit =
            self.cpu_permits.acquire().await.map_err(|_| ApiError::new(503, "the daemon is shutting down", None))?;
        tokio::task::spawn_blocking(f)
            .await
            .unwrap_or_else(|e| Err(ApiError::new(500, format!("internal error preparing the request: {e}"), None)))
    }

    /// [`Shared::cpu`] on a request's body: `f` gets the daemon's state and the body.
    pub async fn cpu_with<T: Send + 'static>(
        self: &Arc<Self>,
        body: &axum::body::Bytes,
        f: impl FnOnce(&Arc<Shared>, &[u8]) -> Result<T, ApiError> + Send + 'static,
    ) -> Result<T, ApiError> {
        let (sh, body) = (Arc::clone(self), body.clone());
        self.cpu(move || f(&sh, &body)).await
    }

    /// The model a request names (`model` field), or the first one configured, if it is
    /// loaded (the routes load it first, [`Shared::warm`]).
    pub fn model(&self, name: Option<&str>) -> Result<Arc<ModelHandle>, ApiError> {
        let slot = self.models.slot(name)?;
        slot.loaded().ok_or_else(|| ApiError::new(503, format!("{} is not loaded", slot.name), None))
    }

    /// Loads the model a JSON body names (`model`, Ollama's `name`; `:latest` dropped) unless
    /// it is loaded; with `ollama`, the body's `keep_alive` becomes the model's when user `uid`
    /// may manage models ([`Shared::wanted`]). A body that is not a JSON object is left to the
    /// route's own checks.
    pub async fn warm(&self, body: &[u8], ollama: bool, uid: Option<u32>) -> Result<(), ApiError> {
        match self.wanted(body, ollama, uid)? {
            Some((name, keep_alive)) => self.load(name.as_deref(), keep_alive).await,
            None => Ok(()),
        }
    }

    /// The model a JSON body names and its `keep_alive` (Ollama's routes), checked without
    /// loading anything; `None` for a body that is not a JSON object naming a model by text.
    /// How long a model stays loaded is model management (`server.manage`): from anyone else
    /// than user `uid` a `keep_alive` is ignored, and one of 0 (Ollama's unload) refused (the
    /// right is looked up only for a body that has one).
    #[allow(clippy::type_complexity)]
    pub fn wanted(
        &self,
        body: &[u8],
        ollama: bool,
        uid: Option<u32>,
    ) -> Result<Option<(Option<String>, Option<Option<std::time::Duration>>)>, ApiError> {
        #[derive(serde::Deserialize)]
        struct Named {
            model: Option<serde_json::Value>,
            name: Option<serde_json::Value>,
            keep_alive: Option<serde_json::Value>,
        }
        let Ok(n) = serde_json::from_slice::<Named>(body) else { return Ok(None) };
        let name = match n.model.or(if ollama { n.name } else { None }) {
            None | Some(serde_json::Value::Null) => None,
            Some(serde_json::Value::String(s)) => Some(s.strip_suffix(":latest").unwrap_or(&s).to_owned()),
            Some(_) => return Ok(None),
        };
        let name = name.filter(|s| !s.is_empty());
        let keep_alive = match n.keep_alive.filter(|k| ollama && !k.is_null()) {
            None => None,
            Some(serde_json::Value::String(s)) => Some(super::models::parse_keep_alive(&s)),
            Some(serde_json::Value::Number(x)) => Some(super::models::parse_keep_alive(&x.to_string())),
            Some(_) => Some(Err("keep_alive must be a duration or a number of seconds".into())),
        };
        let keep_alive = keep_alive.transpose().map_err(|e| ApiError::bad(format!("keep_alive: {e}"), "keep_alive"))?;
        let keep_alive = match keep_alive {
            Some(k) => {
                let managers = self.managers();
                if k == Some(std::time::Duration::ZERO) {
                    managers.check(uid, "unloading a model (keep_alive 0)")?;
                }
                Some(k).filter(|_| managers.may(uid))
            }
            None => None,
        };
        Ok(Some((name, keep_alive)))
    }

    /// Loads model `name` unless it is loaded. As in Ollama, each request sets how long the
    /// model stays once idle: its own `keep_alive`, else the configured one.
    pub async fn load(
        &self,
        name: Option<&str>,
        keep_alive: Option<Option<std::time::Duration>>,
    ) -> Result<(), ApiError> {
        self.models.acquire(name).await?;
        self.models.slot(name)?.set_keep_alive(keep_alive);
        Ok(())
    }
}

/// A raw prompt's text as token ids: special-token text (`<|fim_prefix|>`, `<|im_start|>`)
/// becomes the special tokens, so a client can write a prompt in the model's own format, as
/// llama-server, vLLM and Ollama's `raw` read it. (Chat message content never does.)
pub fn encode_prompt(model: &Model, text: &str) -> Result<Vec<u32>, ApiError> {
    model.tokenizer.encode(text, true).map_err(|e| ApiError::bad(e.to_string(), "prompt"))
}

/// Token ids a client gave (a prompt, Ollama's `context`, `/detokenize`'s), each checked
/// against the model's vocabulary.
pub fn prompt_ids(model: &Model, ids: &[Value], param: &'static str) -> Result<Vec<u32>, ApiError> {
    let vocab = model.config.vocab as u64;
    ids.iter()
        .map(|v| v.as_u64().filter(|&t| t < vocab).map(|t| t as u32))
        .collect::<Option<_>>()
        .ok_or_else(|| ApiError::bad(format!("{param} must be token ids below {vocab}"), param))
}

/// Checks request `req`, whose prompt is `prompt`, for `model`: the same checks and messages
/// whichever edge built it.
pub fn prepare(sh: &Shared, model: Arc<ModelHandle>, req: Request, prompt: Vec<u32>) -> Result<Prepared, ApiError> {
    let ctx = model.context_len() as u64;
    let cap = u64::from(sh.limits().max_tokens).min(ctx);
    let n = match req.n {
        None => 1,
        Some(0) => return Err(ApiError::bad("n must be at least 1", "n")),
        Some(x) if x <= 16 => x as u32,
        Some(_) => return Err(ApiError::bad("n must be an integer between 0 and 16", "n")),
    };
    let seed =
        req.seed.unwrap_or_else(|| sh.next_id.load(Ordering::Relaxed).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x5eed);
    if req.stop.len() > 4 || req.stop.iter().any(String::is_empty) {
        return Err(ApiError::bad("stop takes at most 4 non-empty strings", "stop"));
    }
    if let Some(k) = req.sampling.non_finite() {
        return Err(ApiError::bad(format!("{k} must be a finite number"), k));
    }
    let (priority, stop, logprobs) = (req.priority, req.stop.clone(), req.logprobs);
    let (name, params) = req.strategy();
    let strategy = match sh.registry().get(&name) {
        Ok(s) => s,
        Err(e @ PluginError::UnknownStrategy { .. }) => return Err(ApiError::new(404, e.to_string(), Some("decoder"))),
        Err(e) => return Err(ApiError::new(503, e.to_string(), Some("decoder"))),
    };
    if prompt.is_empty() {
        return Err(ApiError::bad("the prompt is empty", "prompt"));
    }
    let kv = model.monitor.snapshot().kv;
    let max_tokens = match req.max_tokens {
        // As OpenAI, Ollama and llama-server do: until the end of the turn or of the context,
        // within the daemon's limit and what the KV cache can hold for n choices.
        None => {
            let room = ctx.saturating_sub(prompt.len() as u64);
            let blocks = kv.total.saturating_sub(prompt.len().div_ceil(kv.block_size.max(1)));
            let cache = if kv.total > 0 { (blocks / n as usize * kv.block_size) as u64 } else { room };
            let m = cap.min(room).min(cache);
            if m == 0 {
                return Err(ApiError::new(
                    413,
                    format!("{} prompt tokens leave no room to generate in the context of {ctx}", prompt.len()),
                    Some("prompt"),
                ));
            }
            m
        }
        Some(x) if x <= cap => x,
        Some(_) => {
            return Err(ApiError::bad(format!("max_tokens must be an integer between 0 and {cap}"), "max_tokens"))
        }
    } as u32;
    if prompt.len() as u64 + u64::from(max_tokens) > ctx {
        return Err(ApiError::new(
            413,
            format!("{} prompt tokens + max_tokens {max_tokens} exceed the context length {ctx}", prompt.len()),
            Some("prompt"),
        ));
    }
    // Larger than the whole KV cache: it could never run (each choice grows its own blocks).
    if kv.total > 0 && kv.block_size > 0 {
        let need = prompt.len().div_ceil(kv.block_size) + n as usize * (max_tokens as usize).div_ceil(kv.block_size);
        if need > kv.total {
            return Err(ApiError::new(413, format!("the request needs {need} KV cache blocks ({} prompt tokens, max_tokens {max_tokens}, n {n}); the cache holds {}", prompt.len(), kv.total), Some("max_tokens")));
        }
    }
    // Compiled here, on the caller's thread: a schema the engine cannot enforce is a 400 before
    // anything is scheduled.
    let grammar = match (&req.response_format, &model.vocabulary) {
        (None, _) => None,
        (Some(f), Some(v)) => Some(v.compile(f).map_err(|e| ApiError::bad(e.to_string(), "response_format"))?),
        (Some(_), None) => {
            return Err(ApiError::bad(
                format!("model {} declares no end-of-sequence token, so constrained output could not end", model.name),
                "response_format",
            ))
        }
    };
    let tok = &model.model.tokenizer;
    let req = SessionRequest {
        prompt: &prompt,
        generated: &[],
        params: &params,
        max_tokens,
        n,
        seed,
        eos: tok.eos(),
        logprobs,
        vocabulary: model.vocabulary.as_ref(),
        grammar: grammar.as_ref(),
    };
    Session::validate(&strategy, model.model.config.vocab as u32, model.roles, &req)
        .map_err(|e| ApiError::bad(e.to_string(), "decoder_params"))?;
    let images = Vec::new();
    Ok(Prepared { model, strategy, prompt, params, max_tokens, n, seed, priority, stop, logprobs, grammar, images })
}

/// Requests in flight per user, against `limits.max_requests_per_user`.
#[derive(Debug, Default)]
pub struct UserLimits {
    active: Mutex<HashMap<u32, usize>>,
}

/// One request's place under its user's limit, given back when dropped.
#[derive(Debug)]
pub struct Slot {
    owner: Arc<Shared>,
    uid: u32,
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Ok(mut a) = self.owner.users.active.lock() {
            if let Some(c) = a.get_mut(&self.uid) {
                *c -= 1;
                if *c == 0 {
                    a.remove(&self.uid);
                }
            }
        }
    }
}

impl UserLimits {
    /// Requests in flight per uid.
    pub fn snapshot(&self) -> BTreeMap<u32, usize> {
        self.active.lock().map(|a| a.iter().map(|(k, v)| (*k, *v)).collect()).unwrap_or_default()
    }
}

/// A submitted request: its id (for cancelling), its user slot, its events. Dropped before
/// its last event (a client gone, a handler that stopped listening), it cancels the request.
pub struct Submitted {
    pub id: RequestId,
    pub model: Arc<ModelHandle>,
    pub slot: Slot,
    pub prompt_tokens: usize,
    events: tokio::sync::mpsc::UnboundedReceiver<Event>,
    /// The HTTP client's connection: when it goes, the request is cancelled.
    hangup: Option<Arc<Hangup>>,
    /// A last event (finished or failed) arrived, or the cancel was sent.
    over: bool,
}

impl Submitted {
    /// The next event; once the client has gone, the request is cancelled (the engine drops
    /// it at its next step and answers with a last `Failed` event).
    pub async fn recv(&mut self) -> Option<Event> {
        let ev = match &self.hangup {
            Some(h) if !self.over => tokio::select! {
                ev = self.events.recv() => Some(ev),
                _ = h.wait() => None,
            },
            _ => Some(self.events.recv().await),
        };
        let ev = match ev {
            Some(ev) => ev,
            None => {
                self.cancel();
                self.events.recv().await
            }
        };
        if matches!(ev, None | Some(Event::Finished(_)) | Some(Event::Failed(_))) {
            self.over = true;
        }
        ev
    }

    /// Tells the engine the request has what it wants (a stop string matched): it ends as
    /// finished and its blocks are freed at the next step.
    pub fn stop(&mut self) {
        self.end(Command::Stop);
    }

    /// Cancels the request (its blocks are freed at the engine's next step).
    pub fn cancel(&mut self) {
        self.end(Command::Cancel);
    }

    /// Sends the engine the request's last command, unless its end is already known.
    fn end(&mut self, command: fn(RequestId) -> Command) {
        if !self.over {
            self.over = true;
            self.model.engine.send(command(self.id));
        }
    }
}

impl Drop for Submitted {
    fn drop(&mut self) {
        self.cancel();
    }
}

/// A place under user `uid`'s limit for one request, unless the daemon is draining or the
/// user has `limits.max_requests_per_user` in flight.
pub fn user_place(sh: &Arc<Shared>, uid: u32) -> Result<Slot, ApiError> {
    if sh.draining.load(Ordering::Relaxed) {
        return Err(ApiError::new(503, "the daemon is shutting down", None));
    }
    let max = sh.limits().max_requests_per_user;
    let mut a = sh.users.active.lock().map_err(|_| ApiError::new(500, "internal error: poisoned lock", None))?;
    let c = a.entry(uid).or_default();
    if *c >= max {
        return Err(ApiError::new(
            429,
            format!("user {uid} already has {max} requests in flight (limits.max_requests_per_user)"),
            None,
        ));
    }
    *c += 1;
    Ok(Slot { owner: Arc::clone(sh), uid })
}

/// Takes a place under `uid`'s limit (429 past it) and hands the request to its engine thread;
/// it is cancelled when `hangup` trips.
pub fn submit(sh: &Arc<Shared>, p: Prepared, uid: u32, hangup: Option<Arc<Hangup>>) -> Result<Submitted, ApiError> {
    let slot = user_place(sh, uid)?;
    let prompt_tokens = p.prompt.len();
    let id = sh.next_id.fetch_add(1, Ordering::Relaxed);
    let (tx, events) = tokio::sync::mpsc::unbounded_channel::<Event>();
    let meta = RequestMeta { uid, priority: p.priority, submitted: std::time::Instant::now() };
    let sub = Submission {
        id,
        strategy: p.strategy,
        prompt: p.prompt,
        params: p.params,
        max_tokens: p.max_tokens,
        n: p.n,
        seed: p.seed,
        logprobs: p.logprobs,
        meta,
        events: Box::new(move |e| tx.send(e).is_ok()),
        grammar: p.grammar,
        images: p.images,
    };
    let sent = p.model.engine.submit(sub);
    if !sent {
        return Err(ApiError::new(503, "the engine is not running", None));
    }
    Ok(Submitted { id, model: p.model, slot, prompt_tokens, events, hangup, over: false })
}

/// What a client hears, choice by choice, once tokens are text.
#[derive(Clone, Debug, PartialEq)]
pub enum Piece {
    Text {
        choice: u32,
        text: String,
        token: u32,
        /// The tokens whose text this piece completes, with their log-probabilities.
        logprobs: Vec<Scored>,
    },
    /// A choice ended: "stop" (end of sequence or a stop string) or "length".
    End {
        choice: u32,
        reason: &'static str,
        /// The stop string that ended it, if one did.
        stop: Option<String>,
        text: String,
        logprobs: Vec<Scored>,
    },
    /// Every choice ended.
    Done {
        completion_tokens: usize,
        /// Prompt tokens the prefix cache held (0 where the engine did not say).
        cached_prompt_tokens: usize,
        stats: BTreeMap<String, f64>,
    },
    Failed(String),
}

/// A generated token with its log-probability (NaN unless the request asked for them) and
/// its most probable alternatives (empty unless it asked for those).
#[derive(Clone, Debug, PartialEq)]
pub struct Scored {
    pub token: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// Turns engine [`Event`]s into [`Piece`]s: incremental detokenization per choice, stop strings
/// (text after a stop string is never sent; text that may begin one is held back until it
/// cannot).
pub struct Output {
    stop: Vec<String>,
    choices: Vec<ChoiceOut>,
}

#[derive(Default)]
struct ChoiceOut {
    dec: StreamDecoder,
    /// Text decoded but not sent yet (it may be the start of a stop string).
    held: String,
    /// Tokens whose text is not sent yet.
    pending: Vec<Scored>,
    tokens: usize,
    ended: bool,
}

impl Output {
    pub fn new(n: u32, stop: Vec<String>) -> Output {
        Output {
            stop,
            choices: (0..n).map(|_| ChoiceOut { dec: StreamDecoder::new(true), ..ChoiceOut::default() }).collect(),
        }
    }

    /// Tool-call markers that are special tokens (`[TOOL_CALLS]` in Mistral's vocabulary) are
    /// kept in the text, for the parser; the other special tokens stay out as before.
    pub fn keeping_special(mut self, tok: &inferd_engine::tokenizer::Tokenizer) -> Output {
        self.keep(tok, &inferd_engine::tools::parse::MARKERS);
        self
    }

    /// `markers` that are single special tokens of this vocabulary are kept in the text too
    /// (with those kept already); the other specials (a turn's `<|im_start|>` the model writes
    /// before a call) stay out of the answer.
    pub fn keep(&mut self, tok: &inferd_engine::tokenizer::Tokenizer, markers: &[&str]) {
        let more = markers.iter().filter_map(|m| match tok.encode_bare(m, true).ok()?.as_slice() {
            [id] if tok.is_special(*id) => Some(*id),
            _ => None,
        });
        let mut keep: Vec<u32> = self.choices.first().map(|c| c.dec.kept().to_vec()).unwrap_or_default();
        for id in more {
            if !keep.contains(&id) {
                keep.push(id);
            }
        }
        for c in &mut self.choices {
            c.dec = StreamDecoder::keeping(keep.clone());
        }
    }

    /// Every choice ended through a stop string: the request can be cancelled.
    pub fn all_stopped(&self) -> bool {
        self.choices.iter().all(|c| c.ended)
    }

    pub fn on_event(&mut self, model: &Model, ev: Event) -> Vec<Piece> {
        let tok = &model.tokenizer;
        match ev {
            Event::Token { choice, token, logprob, top } => {
                let Some(c) = self.choices.get_mut(choice as usize) else { return Vec::new() };
                if c.ended {
                    return Vec::new();
                }
                c.tokens += 1;
                c.pending.push(Scored { token, logprob, top });
                let text = c.dec.push(tok, token).unwrap_or_default();
                c.held.push_str(&text);
                let found = self.stop.iter().filter_map(|s| c.held.find(s.as_str()).map(|at| (at, s))).min();
                if let Some((at, stop)) = found {
                    c.held.truncate(at);
                    c.ended = true;
                    let logprobs = std::mem::take(&mut c.pending);
                    let (text, stop) = (std::mem::take(&mut c.held), Some(stop.clone()));
                    return vec![Piece::End { choice, reason: "stop", stop, text, logprobs }];
                }
                // Keep back the longest tail that could still begin a stop string.
                let keep = self.stop.iter().map(|s| partial_suffix(&c.held, s)).max().unwrap_or(0);
                let send = c.held.len() - keep;
                let out: String = c.held.drain(..send).collect();
                let logprobs = if keep == 0 { std::mem::take(&mut c.pending) } else { Vec::new() };
                vec![Piece::Text { choice, text: out, token, logprobs }]
            }
            Event::Finished(g) => {
                let mut out = Vec::new();
                for (i, c) in self.choices.iter_mut().enumerate() {
                    if c.ended {
                        continue;
                    }
                    let mut text = std::mem::take(&mut c.held);
                    text.push_str(&c.dec.finish());
                    // (Every token of a choice was emitted, so streamed: the text is complete.)
                    let fin = g.choices.get(i);
                    let reason =
                        if fin.and_then(|f| f.finish) == Some(FinishReason::Length) { "length" } else { "stop" };
                    out.push(Piece::End {
                        choice: i as u32,
                        reason,
                        stop: None,
                        text,
                        logprobs: std::mem::take(&mut c.pending),
                    });
                }
                out.push(Piece::Done {
                    completion_tokens: self.choices.iter().map(|c| c.tokens).sum(),
                    cached_prompt_tokens: g.cached_prompt_tokens,
                    stats: g.stats,
                });
                out
            }
            Event::Failed(m) => vec![Piece::Failed(m)],
        }
    }

    /// The closing piece when every choice stopped on a stop string (the request is cancelled,
    /// so no `Finished` event comes).
    pub fn done_by_stop(&self) -> Piece {
        Piece::Done {
            completion_tokens: self.choices.iter().map(|c| c.tokens).sum(),
            cached_prompt_tokens: 0,
            stats: BTreeMap::new(),
        }
    }
}

/// The length of the longest proper prefix of `stop` that `text` ends with (on a character
/// boundary of `text`).
fn partial_suffix(text: &str, stop: &str) -> usize {
    (1..stop.len())
        .rev()
        .find(|&k| {
            text.len() >= k
                && text.is_char_boundary(text.len() - k)
                && stop.is_char_boundary(k)
                && text.ends_with(&stop[..k])
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::partial_suffix;

    #[test]
    fn partial_stop_strings_are_held_back() {
        assert_eq!(partial_suffix("hello wor", "world"), 3);
        assert_eq!(partial_suffix("hello", "world"), 0);
        assert_eq!(partial_suffix("a\n", "\n\n"), 1);
        assert_eq!(partial_suffix("x", "x"), 0, "a whole match is not partial");
        assert_eq!(partial_suffix("é", "éa"), 2);
    }
}
