//! One request's run of a strategy: create, then plan / observe rounds, then destroy.
//!
//! The session owns the request's view of the world that callbacks act on: the handles the
//! plugin holds (each mapped to a store sequence; handles are never reused, so a stale one is
//! refused), the choices' tokens and finish reasons, and the seed. Every answer from the plugin
//! is checked: plan items name live handles and in-vocabulary tokens, emits stay within `n` and
//! `max_tokens`. A failing call fails this request only and counts toward the strategy's
//! quarantine; the caller then [`Session::close`]s it, which frees every sequence it still holds.

use super::host::{HostErr, HostSide};
use super::runner::{CallError, Handle, MAX_ITEMS, MAX_LOGITS};
use super::wire::{InitData, RawPlan};
use super::{philox, LoadedStrategy, PluginError};
use crate::constraint::mask::Masker;
use crate::constraint::{Grammar, Vocabulary};
use crate::decode::store::{SeqStore, StoreRun, StoreSeq};
use inferd_plugin_api::abi;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Alternatives per token, at most (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: u32 = 20;

/// Handles are unique for the life of the process.
static NEXT_HANDLE: AtomicU64 = AtomicU64::new(1);

/// What the host knows about a request when it creates (or validates) a session.
#[derive(Clone, Debug)]
pub struct SessionRequest<'a> {
    pub prompt: &'a [u32],
    /// Tokens already generated for this request (they follow the prompt in the sequence and
    /// count for penalties, not against `max_tokens`).
    pub generated: &'a [u32],
    pub params: &'a str,
    pub max_tokens: u32,
    pub n: u32,
    pub seed: u64,
    pub eos: &'a [u32],
    /// The client wants each token's log-probability, with this many alternatives (0..=20).
    pub logprobs: Option<u32>,
    /// The model's vocabulary (the plugins' `token_bytes`), when the host built one.
    pub vocabulary: Option<&'a Arc<Vocabulary>>,
    /// The response format the output must follow, compiled.
    pub grammar: Option<&'a Grammar>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    Stop,
    Length,
}

/// One completion of a request.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Choice {
    pub tokens: Vec<u32>,
    pub logprobs: Vec<f32>,
    /// Each token's most probable alternatives, when the request asked for them.
    pub top_logprobs: Vec<Vec<(u32, f32)>>,
    pub finish: Option<FinishReason>,
}

/// A token as it is emitted: `(choice, token, logprob, alternatives)`.
pub type OnToken<'a> = &'a mut dyn FnMut(u32, u32, f32, &[(u32, f32)]);

struct State {
    strategy: String,
    stats: BTreeMap<String, f64>,
    handles: HashMap<abi::Seq, StoreSeq>,
    choices: Vec<Choice>,
    max_tokens: u32,
    vocab: u32,
    seed: u64,
    /// Alternatives wanted per token: every emit then carries them.
    top_logprobs: u32,
    vocabulary: Option<Arc<Vocabulary>>,
    /// The response format's state, when the request has one.
    masker: Option<Masker>,
}

/// The callbacks' view during one call: the session state, and the store (absent in validate).
struct Side<'a> {
    st: &'a mut State,
    store: Option<&'a mut dyn SeqStore>,
    on_token: OnToken<'a>,
}

impl Side<'_> {
    fn store(&mut self) -> Result<&mut dyn SeqStore, HostErr> {
        match self.store.as_deref_mut() {
            Some(s) => Ok(s),
            None => Err(HostErr::invalid("sequences are not available during validate")),
        }
    }

    fn seq(&self, h: abi::Seq) -> Result<StoreSeq, HostErr> {
        self.st
            .handles
            .get(&h)
            .copied()
            .ok_or_else(|| HostErr::invalid(format!("sequence handle {h} is not one of this request's")))
    }

    fn adopt(&mut self, s: StoreSeq) -> abi::Seq {
        let h = NEXT_HANDLE.fetch_add(1, Ordering::Relaxed);
        self.st.handles.insert(h, s);
        h
    }

    fn choice(&mut self, c: u32) -> Result<&mut Choice, HostErr> {
        let n = self.st.choices.len();
        let ch = self
            .st
            .choices
            .get_mut(c as usize)
            .ok_or_else(|| HostErr::invalid(format!("choice {c} out of range (n = {n})")))?;
        if ch.finish.is_some() {
            return Err(HostErr::invalid(format!("choice {c} is already finished")));
        }
        Ok(ch)
    }

    /// Appends an emitted token to its choice (checked against the vocabulary, `max_tokens`
    /// and the response format) and passes it on.
    fn append(&mut self, choice: u32, token: i32, logprob: f32, top: Vec<(u32, f32)>) -> Result<(), HostErr> {
        let (vocab, max) = (self.st.vocab, self.st.max_tokens);
        if token < 0 || token as u32 >= vocab {
            return Err(HostErr::invalid(format!("emitted token {token} outside the vocabulary of {vocab}")));
        }
        let ch = self.choice(choice)?;
        if ch.tokens.len() >= max as usize {
            return Err(HostErr::invalid(format!("emitted more than max_tokens ({max}) tokens for choice {choice}")));
        }
        if let Some(m) = &mut self.st.masker {
            m.emit(choice, token as u32).map_err(HostErr::invalid)?;
        }
        let ch = self.choice(choice)?;
        ch.tokens.push(token as u32);
        ch.logprobs.push(logprob);
        (self.on_token)(choice, token as u32, logprob, &top);
        if !top.is_empty() {
            self.choice(choice)?.top_logprobs.push(top);
        }
        Ok(())
    }
}

fn store_err(e: crate::decode::store::StoreError) -> HostErr {
    HostErr { status: e.status(), message: e.to_string() }
}

impl HostSide for Side<'_> {
    fn log(&mut self, level: i32, message: &str) {
        let lvl = match level {
            abi::LOG_ERROR => "error",
            abi::LOG_WARN => "warning",
            abi::LOG_INFO => "info",
            _ => "debug",
        };
        if level <= abi::LOG_INFO {
            eprintln!("inferd: {} plugin {lvl}: {message}", self.st.strategy);
        }
    }

    fn seq_create(&mut self, role: u32) -> Result<abi::Seq, HostErr> {
        let s = self.store()?.create(role, &[]).map_err(store_err)?;
        Ok(self.adopt(s))
    }

    fn seq_fork(&mut self, seq: abi::Seq) -> Result<abi::Seq, HostErr> {
        let s = self.seq(seq)?;
        let f = self.store()?.fork(s).map_err(store_err)?;
        let h = self.adopt(f);
        if let Some(m) = &mut self.st.masker {
            m.fork(seq, h);
        }
        Ok(h)
    }

    fn seq_truncate(&mut self, seq: abi::Seq, len: u32) -> Result<(), HostErr> {
        let s = self.seq(seq)?;
        self.store()?.truncate(s, len as usize).map_err(store_err)
    }

    fn seq_free(&mut self, seq: abi::Seq) -> Result<(), HostErr> {
        let s = self.seq(seq)?;
        self.store()?.free(s);
        self.st.handles.remove(&seq);
        if let Some(m) = &mut self.st.masker {
            m.free(seq);
        }
        Ok(())
    }

    fn seq_tokens(&mut self, seq: abi::Seq) -> Result<Vec<u32>, HostErr> {
        let s = self.seq(seq)?;
        Ok(self.store()?.tokens(s))
    }

    fn emit(&mut self, choice: u32, token: i32, logprob: f32) -> Result<(), HostErr> {
        if self.st.top_logprobs > 0 {
            return Err(HostErr::invalid("the request wants top_logprobs: tokens go out through emit_top"));
        }
        self.append(choice, token, logprob, Vec::new())
    }

    fn emit_top(&mut self, choice: u32, token: i32, logprob: f32, top: &[(i32, f32)]) -> Result<(), HostErr> {
        let (k, vocab) = (self.st.top_logprobs, self.st.vocab);
        if k == 0 {
            return Err(HostErr::invalid("emit_top without top_logprobs: tokens go out through emit"));
        }
        if top.len() > k as usize {
            return Err(HostErr::invalid(format!("{} alternatives, more than the {k} asked for", top.len())));
        }
        let mut alts = Vec::with_capacity(top.len());
        for &(t, lp) in top {
            if t < 0 || t as u32 >= vocab || lp.is_nan() || lp > 0.0 {
                return Err(HostErr::invalid(format!("alternative ({t}, {lp}) is no token with a log-probability")));
            }
            alts.push((t as u32, lp));
        }
        self.append(choice, token, logprob, alts)
    }

    fn finish(&mut self, choice: u32, reason: u32) -> Result<(), HostErr> {
        let r = match reason {
            abi::FINISH_STOP => FinishReason::Stop,
            abi::FINISH_LENGTH => FinishReason::Length,
            other => return Err(HostErr::invalid(format!("unknown finish reason {other}"))),
        };
        self.choice(choice)?;
        if let (FinishReason::Stop, Some(m)) = (r, &mut self.st.masker) {
            m.finish(choice).map_err(HostErr::invalid)?;
        }
        self.choice(choice)?.finish = Some(r);
        Ok(())
    }

    fn random(&mut self, stream: u64, counter: u64) -> [u32; 4] {
        philox::random(self.st.seed, stream, counter)
    }

    fn report(&mut self, key: &str, value: f64) -> Result<(), HostErr> {
        let ok = (1..=64).contains(&key.len())
            && key.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
        if !ok || !value.is_finite() {
            return Err(HostErr::invalid(format!("bad statistic {key:?} = {value}")));
        }
        if !self.st.stats.contains_key(key) && self.st.stats.len() >= 32 {
            return Err(HostErr::invalid("more than 32 statistics"));
        }
        *self.st.stats.entry(key.to_owned()).or_default() += value;
        Ok(())
    }

    fn token_bytes(&mut self, token: i32) -> Result<Vec<u8>, HostErr> {
        let v = self.st.vocabulary.as_ref().ok_or_else(|| HostErr::invalid("this model has no vocabulary"))?;
        let b = u32::try_from(token).ok().and_then(|t| v.token_bytes(t));
        b.map(<[u8]>::to_vec).ok_or_else(|| HostErr::invalid(format!("token {token} is outside the vocabulary")))
    }
}

fn init_for(req: &SessionRequest<'_>, vocab: u32, roles: u32, seq: abi::Seq) -> InitData {
    InitData {
        params: req.params.to_owned(),
        seq,
        prompt_len: req.prompt.len() as u32,
        vocab,
        max_tokens: req.max_tokens,
        n: req.n,
        eos: req.eos.iter().map(|&t| t as i32).collect(),
        roles,
        seed: req.seed,
        logprobs: u32::from(req.logprobs.is_some()),
        constrained: u32::from(req.grammar.is_some()),
        top_logprobs: req.logprobs.unwrap_or(0),
    }
}

/// A run of sequence work the session asked for, in store terms.
pub type Work = Vec<StoreRun>;

/// A live session of one strategy for one request.
pub struct Session {
    strategy: Arc<LoadedStrategy>,
    handle: Option<Handle>,
    st: State,
    failed: bool,
}

impl Session {
    fn fail(&mut self, message: String) -> PluginError {
        if !self.failed {
            self.failed = true;
            self.strategy.failed();
        }
        PluginError::Failed { strategy: self.strategy.name().to_owned(), message }
    }

    fn call_failed(&mut self, e: CallError) -> PluginError {
        self.fail(e.into_message())
    }

    /// Admission check: the strategy accepts the parameters and the request (no sequences yet).
    /// `roles`: bit `1 << abi::ROLE_*` for each sequence role the request can use.
    pub fn validate(
        strategy: &LoadedStrategy,
        vocab: u32,
        roles: u32,
        req: &SessionRequest<'_>,
    ) -> Result<(), PluginError> {
        let invalid = |message: String| PluginError::Invalid { strategy: strategy.name().to_owned(), message };
        if req.n == 0 {
            return Err(invalid("n must be at least 1".into()));
        }
        match req.logprobs {
            Some(k) if k > MAX_TOP_LOGPROBS => {
                return Err(invalid(format!("top_logprobs must be at most {MAX_TOP_LOGPROBS}")));
            }
            Some(k) if k > 0 && strategy.abi_minor < 2 => {
                let why = format!("top_logprobs is not reported by plugins built for ABI 1.{}", strategy.abi_minor);
                return Err(invalid(why));
            }
            _ => {}
        }
        let init = init_for(req, vocab, roles, 0);
        let mut st = State {
            strategy: strategy.name().to_owned(),
            stats: BTreeMap::new(),
            handles: HashMap::new(),
            choices: Vec::new(),
            max_tokens: req.max_tokens,
            vocab,
            seed: req.seed,
            top_logprobs: req.logprobs.unwrap_or(0),
            vocabulary: req.vocabulary.cloned(),
            masker: None,
        };
        let mut nothing = |_: u32, _: u32, _: f32, _: &[(u32, f32)]| {};
        let mut side = Side { st: &mut st, store: None, on_token: &mut nothing };
        match strategy.runner.validate(&strategy.path, &mut side, &init) {
            Ok(()) => Ok(()),
            Err(CallError::Failed(m)) => Err(invalid(m)),
            Err(CallError::Fault(m)) => Err(PluginError::Failed { strategy: strategy.name().to_owned(), message: m }),
        }
    }

    /// Creates the request's target sequence (prompt, prefix-cached) and the plugin session.
    pub fn create(
        strategy: Arc<LoadedStrategy>,
        store: &mut dyn SeqStore,
        req: &SessionRequest<'_>,
        on_token: OnToken<'_>,
    ) -> Result<Session, PluginError> {
        let (vocab, roles) = (store.vocab() as u32, store.roles());
        Self::validate(&strategy, vocab, roles, req)?;
        let mut s = Session {
            st: State {
                strategy: strategy.name().to_owned(),
                stats: BTreeMap::new(),
                handles: HashMap::new(),
                choices: vec![Choice::default(); req.n as usize],
                max_tokens: req.max_tokens,
                vocab,
                seed: req.seed,
                top_logprobs: req.logprobs.unwrap_or(0),
                vocabulary: req.vocabulary.cloned(),
                masker: None,
            },
            strategy,
            handle: None,
            failed: false,
        };
        let full: Vec<u32> = req.prompt.iter().chain(req.generated).copied().collect();
        let seq = match store.create(abi::ROLE_TARGET, &full) {
            Ok(q) => q,
            Err(e) => return Err(s.fail(e.to_string())),
        };
        let h = NEXT_HANDLE.fetch_add(1, Ordering::Relaxed);
        s.st.handles.insert(h, seq);
        if let Some(g) = req.grammar {
            match Masker::new(g, h, req.prompt.len(), req.generated, req.n as usize) {
                Ok(m) => s.st.masker = Some(m),
                Err(message) => {
                    s.release(store);
                    return Err(PluginError::Invalid { strategy: s.strategy.name().to_owned(), message });
                }
            }
        }
        let init = init_for(req, vocab, roles, h);
        let strategy = Arc::clone(&s.strategy);
        let created = {
            let mut side = Side { st: &mut s.st, store: Some(&mut *store), on_token };
            strategy.runner.create(&strategy.path, &mut side, &init)
        };
        match created {
            Ok(handle) => {
                s.handle = Some(handle);
                Ok(s)
            }
            Err(e) => {
                s.release(store);
                Err(s.call_failed(e))
            }
        }
    }

    /// The session's next work, or `None` when every choice is done.
    pub fn plan(&mut self, store: &mut dyn SeqStore, on_token: OnToken<'_>) -> Result<Option<Work>, PluginError> {
        let Some(handle) = &mut self.handle else { return Err(self.fail("the session is closed".into())) };
        let planned = {
            let mut side = Side { st: &mut self.st, store: Some(&mut *store), on_token };
            self.strategy.runner.plan(&self.strategy.path, &mut side, handle)
        };
        let plan = match planned {
            Ok(p) => p,
            Err(e) => return Err(self.call_failed(e)),
        };
        if plan.done {
            return Ok(None);
        }
        match self.check_plan(plan) {
            Ok(w) if w.is_empty() => Err(self.fail("plan asked for nothing but is not done".into())),
            Ok(w) => Ok(Some(w)),
            Err(e) => Err(self.fail(e)),
        }
    }

    /// The plan in store terms, every item checked: the request's own live handles, each
    /// once, tokens in the vocabulary, rows within bounds.
    fn check_plan(&self, plan: RawPlan) -> Result<Work, String> {
        if plan.items.len() > MAX_ITEMS as usize {
            return Err(format!("plan has {} items (at most {MAX_ITEMS})", plan.items.len()));
        }
        let mut work: Work = Vec::with_capacity(plan.items.len());
        for (i, it) in plan.items.into_iter().enumerate() {
            let seq =
                *self.st.handles.get(&it.seq).ok_or_else(|| {
                    format!("plan item {i} names sequence handle {} which is not this request's", it.seq)
                })?;
            if work.iter().any(|w| w.seq == seq) {
                return Err(format!("plan names sequence handle {} twice", it.seq));
            }
            if it.n_logits > MAX_LOGITS {
                return Err(format!("plan item {i} asks for {} logits rows (at most {MAX_LOGITS})", it.n_logits));
            }
            if let Some(&bad) = it.tokens.iter().find(|&&t| t < 0 || t as u32 >= self.st.vocab) {
                return Err(format!("plan item {i} appends token {bad} outside the vocabulary"));
            }
            let tokens = it.tokens.into_iter().map(|t| t as u32).collect();
            work.push(StoreRun { seq, tokens, n_logits: it.n_logits as usize });
        }
        Ok(work)
    }

    /// Hands the logits of the last plan's work to the plugin (`rows[i]` for item `i`), masked
    /// first when the request has a response format.
    pub fn observe(
        &mut self,
        store: &mut dyn SeqStore,
        work: &[StoreRun],
        rows: &mut [Vec<f32>],
        on_token: OnToken<'_>,
    ) -> Result<(), PluginError> {
        let vocab = store.vocab();
        if let Err(e) = self.mask(store, work, rows, vocab) {
            return Err(PluginError::Invalid { strategy: self.strategy.name().to_owned(), message: e });
        }
        let counts: Vec<u32> =
            work.iter().zip(rows.iter()).map(|(w, r)| (w.n_logits.min(r.len() / vocab.max(1))) as u32).collect();
        let Some(handle) = &mut self.handle else { return Err(self.fail("the session is closed".into())) };
        let observed = {
            let mut side = Side { st: &mut self.st, store: Some(&mut *store), on_token };
            self.strategy.runner.observe(&self.strategy.path, &mut side, handle, rows, &counts, vocab)
        };
        observed.map_err(|e| self.call_failed(e))
    }

    /// Applies the response format's mask to every constrained row, and counts its cost in
    /// the request's statistics (`mask_ms`, `masked_rows`).
    fn mask(
        &mut self,
        store: &dyn SeqStore,
        work: &[StoreRun],
        rows: &mut [Vec<f32>],
        vocab: usize,
    ) -> Result<(), String> {
        let Some(m) = &mut self.st.masker else { return Ok(()) };
        let before = m.cost();
        for (w, row) in work.iter().zip(rows.iter_mut()) {
            let Some((&h, _)) = self.st.handles.iter().find(|(_, &s)| s == w.seq) else { continue };
            let tokens = store.tokens(w.seq);
            m.mask(h, &tokens, row, vocab)?;
        }
        let after = m.cost();
        *self.st.stats.entry("mask_ms".into()).or_default() += (after.0 - before.0).as_secs_f64() * 1e3;
        *self.st.stats.entry("masked_rows".into()).or_default() += (after.1 - before.1) as f64;
        Ok(())
    }

    /// Destroys the plugin session and frees every sequence it still holds.
    fn release(&mut self, store: &mut dyn SeqStore) {
        if let Some(h) = self.handle.take() {
            self.strategy.runner.destroy(&self.strategy.path, h);
        }
        for (_, s) in self.st.handles.drain() {
            store.free(s);
        }
    }

    /// Statistics the strategy reported so far (`report`), by key.
    pub fn stats(&self) -> &BTreeMap<String, f64> {
        &self.st.stats
    }

    /// Ends the session: the choices, unfinished ones marked by why they stopped.
    pub fn close(mut self, store: &mut dyn SeqStore) -> Vec<Choice> {
        self.release(store);
        if !self.failed {
            self.strategy.succeeded();
        }
        let max = self.st.max_tokens as usize;
        let mut choices = std::mem::take(&mut self.st.choices);
        for c in &mut choices {
            c.finish.get_or_insert(if c.tokens.len() >= max { FinishReason::Length } else { FinishReason::Stop });
        }
        choices
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        // A session dropped without `close` still frees the plugin's state; its sequences
        // belong to a store we no longer see.
        if let Some(h) = self.handle.take() {
            self.strategy.runner.destroy(&self.strategy.path, h);
        }
    }
}
