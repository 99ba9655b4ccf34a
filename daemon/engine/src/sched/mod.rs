//! The engine loop: the one thread that owns a model's engine, its KV cache and every request's
//! plugin session. Requests, cancellations and shutdown arrive as [`Command`]s over a channel;
//! each request's tokens leave as [`Event`]s over its own channel.
//!
//! Continuous batching at iteration level (Yu et al., Orca, 2022; as in vLLM): every step
//! 1. takes the commands that arrived,
//! 2. admits waiting requests while the KV cache has room for their prompts,
//! 3. asks every running session for its plan and merges the plans into one batch under the
//!    step's token budget (a plan that does not fit waits for the next step; a prompt that does
//!    not fit is prefilled a chunk at a time, in the same forward as the others' decode tokens),
//! 4. runs the batch once and hands every session its rows,
//! 5. retires finished and failed requests at once, so a short request never waits for a long
//!    one.
//!
//! When the cache runs out mid-generation the newest running request is preempted: its
//! sequences are freed and it waits at the front of the queue to be recomputed, continuing
//! from the tokens it already streamed (they are not sent twice). A request that alone needs
//! more blocks than the whole cache fails at admission.
//!
//! Fairness: the next request admitted is of the best priority class waiting (interactive
//! before background); within it, of the user (peer uid) with the fewest running requests,
//! ties going to the user admitted least recently, so users take turns and one user's batch
//! job cannot starve another's chat. A preempted request goes back first. A request whose
//! prompt shares 128 tokens or more with one still being prefilled waits for that prefill and then
//! finds the shared part in the prefix cache: a system prompt sent by several apps at once is
//! computed once.
//!
//! The loop reports to a [`Monitor`] every turn (status, metrics, the watchdog's heartbeat); it
//! turns at least once a second even when idle.

pub mod monitor;

use crate::decode::store::{SeqStore, StoreError, StoreRun, StoreSeq};
use crate::decode::Generation;
use crate::engine::EngineError;
use crate::plugin::{Choice, FinishReason, LoadedStrategy, Session, SessionRequest};
use monitor::Monitor;
use std::collections::{HashMap, VecDeque};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub type RequestId = u64;

/// A request as the engine thread receives it.
pub struct Submission {
    pub id: RequestId,
    pub strategy: Arc<LoadedStrategy>,
    pub prompt: Vec<u32>,
    pub params: String,
    pub max_tokens: u32,
    pub n: u32,
    pub seed: u64,
    pub logprobs: bool,
    pub meta: RequestMeta,
    pub events: EventSink,
}

/// Who asked and how urgently, for fairness and metrics.
#[derive(Clone, Copy, Debug)]
pub struct RequestMeta {
    /// The local user (socket peer or D-Bus caller).
    pub uid: u32,
    pub priority: Priority,
    /// When the edge accepted it (TTFT and latency count from here).
    pub submitted: Instant,
}

impl Default for RequestMeta {
    fn default() -> Self {
        RequestMeta { uid: 0, priority: Priority::Interactive, submitted: Instant::now() }
    }
}

/// Priority classes: every waiting interactive request is admitted before any background one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub enum Priority {
    #[default]
    Interactive,
    Background,
}

impl Priority {
    pub fn parse(s: &str) -> Option<Priority> {
        match s {
            "interactive" => Some(Priority::Interactive),
            "background" => Some(Priority::Background),
            _ => None,
        }
    }
}

/// Where a request's events go; `false` means the client is gone, which cancels the request
/// (its blocks are freed at the start of the next step).
pub type EventSink = Box<dyn FnMut(Event) -> bool + Send>;

/// An [`EventSink`] over a channel.
pub fn channel_sink(tx: Sender<Event>) -> EventSink {
    Box::new(move |e| tx.send(e).is_ok())
}

/// What a request's client hears.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    Token { choice: u32, token: u32 },
    Finished(Generation),
    Failed(String),
}

pub enum Command {
    Submit(Submission),
    Cancel(RequestId),
    /// The client has what it wants (a stop string matched): end the request as finished.
    Stop(RequestId),
    /// Cancel everything and end the loop.
    Shutdown,
}

/// The shortest shared prompt prefix worth waiting for instead of computing it again.
const SHARED_PREFILL: usize = 128;

/// The smallest prompt chunk a step runs, even when the step's budget is spent.
const MIN_CHUNK: usize = 16;

/// Scheduler settings.
#[derive(Clone, Debug)]
pub struct LoopConfig {
    /// Tokens per step across all sessions (decode tokens and prefill chunks).
    pub token_budget: usize,
    /// Requests running at once, at most.
    pub max_running: usize,
    pub eos: Vec<u32>,
    /// Where the loop reports its state.
    pub monitor: Option<Arc<Monitor>>,
}

impl Default for LoopConfig {
    fn default() -> Self {
        LoopConfig { token_budget: 512, max_running: 64, eos: Vec::new(), monitor: None }
    }
}

struct Waiting {
    sub: Submission,
    /// Tokens already streamed before a preemption (choice 0; continued on recompute).
    streamed: Vec<u32>,
    /// Its first token went out (TTFT recorded).
    started: bool,
    /// It was preempted: it goes back before anyone else.
    resumed: bool,
}

struct Running {
    sub: Submission,
    session: Session,
    streamed: Vec<u32>,
    started: bool,
    /// The client went away: close at the end of the step.
    gone: bool,
    /// The client stopped it (a stop string): finish it at the start of the next step.
    stop: bool,
    /// Its prompt has been run (its first plan was observed).
    prefilled: bool,
    /// Its plan waited for a step with room; it goes first next time.
    deferred: bool,
}

/// Counters for status and tests.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LoopStats {
    pub steps: u64,
    pub finished: u64,
    pub failed: u64,
    pub cancelled: u64,
    pub preempted: u64,
}

fn request<'a>(sub: &'a Submission, streamed: &'a [u32], eos: &'a [u32]) -> SessionRequest<'a> {
    SessionRequest {
        prompt: &sub.prompt,
        generated: streamed,
        params: &sub.params,
        max_tokens: sub.max_tokens - streamed.len() as u32,
        n: sub.n,
        seed: sub.seed,
        eos,
        logprobs: sub.logprobs,
    }
}

/// Which waiting request to admit next: a resumed (preempted) one first, else the best
/// priority class, the user with the fewest running requests (ties: admitted least recently),
/// that user's oldest request.
fn next_waiting(
    waiting: &VecDeque<Waiting>,
    running: &[Running],
    last_admitted: &HashMap<u32, u64>,
    eligible: &dyn Fn(&Waiting) -> bool,
) -> Option<usize> {
    if waiting.front()?.resumed {
        return Some(0);
    }
    let class = waiting.iter().filter(|w| eligible(w)).map(|w| w.sub.meta.priority).min()?;
    let mut load: HashMap<u32, usize> = HashMap::new();
    for r in running {
        *load.entry(r.sub.meta.uid).or_default() += 1;
    }
    // `min_by_key` keeps the first of equals, so the oldest of a user wins.
    waiting
        .iter()
        .enumerate()
        .filter(|(_, w)| w.sub.meta.priority == class && eligible(w))
        .min_by_key(|(_, w)| {
            let uid = w.sub.meta.uid;
            (load.get(&uid).copied().unwrap_or(0), last_admitted.get(&uid).copied().unwrap_or(0))
        })
        .map(|(i, _)| i)
}

/// How many leading tokens `a` and `b` share.
fn shared_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// A token for a request's client: recorded (choice 0 for recompute after a preemption, the
/// first one for TTFT) and sent; a client that is gone marks the request.
struct Emit<'a> {
    sub: &'a mut Submission,
    streamed: &'a mut Vec<u32>,
    started: &'a mut bool,
    gone: &'a mut bool,
    emitted: &'a mut u64,
    monitor: Option<&'a Monitor>,
}

impl Emit<'_> {
    fn token(&mut self, choice: u32, token: u32) {
        if choice == 0 {
            self.streamed.push(token);
        }
        if !*self.started {
            *self.started = true;
            let ttft = self.sub.meta.submitted.elapsed().as_secs_f64();
            if let Some(m) = self.monitor {
                m.update(|s| s.ttft.observe(ttft));
            }
        }
        *self.emitted += 1;
        if !(self.sub.events)(Event::Token { choice, token }) {
            *self.gone = true;
        }
    }
}

/// Runs until [`Command::Shutdown`] or until every sender is gone and no work is left.
pub fn engine_loop(store: &mut dyn SeqStore, rx: &Receiver<Command>, cfg: &LoopConfig) -> LoopStats {
    let mut stats = LoopStats::default();
    let mut waiting: VecDeque<Waiting> = VecDeque::new();
    let mut running: Vec<Running> = Vec::new();
    let mut disconnected = false;
    // After a preemption nothing is admitted until a request leaves: otherwise the preempted
    // request comes straight back and the cache overflows again (livelock).
    let mut hold = false;
    let monitor = cfg.monitor.as_deref();
    let mut last_admitted: HashMap<u32, u64> = HashMap::new();
    let mut admissions = 0u64;
    // Per-strategy outcomes and tokens since the last report.
    let mut outcomes: Vec<(String, bool, u64)> = Vec::new();
    report(monitor, store, &stats, 0, 0, 0, &mut outcomes);
    loop {
        let mut emitted = 0u64;
        if let Some(m) = monitor {
            m.beat();
        }
        // 1. Commands: block (a second at a time, to keep the heartbeat) only when idle.
        let mut cmds = Vec::new();
        if running.is_empty() && waiting.is_empty() {
            match rx.recv_timeout(Duration::from_secs(1)) {
                Ok(c) => cmds.push(c),
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => return stats,
            }
        }
        loop {
            match rx.try_recv() {
                Ok(c) => cmds.push(c),
                Err(std::sync::mpsc::TryRecvError::Empty) => break,
                Err(std::sync::mpsc::TryRecvError::Disconnected) => {
                    disconnected = true;
                    break;
                }
            }
        }
        let mut cmds = cmds.into_iter();
        while let Some(c) = cmds.next() {
            match c {
                Command::Submit(sub) => {
                    waiting.push_back(Waiting { sub, streamed: Vec::new(), started: false, resumed: false })
                }
                Command::Cancel(id) => {
                    if let Some(i) = waiting.iter().position(|w| w.sub.id == id) {
                        if let Some(mut w) = waiting.remove(i) {
                            (w.sub.events)(Event::Failed("cancelled".into()));
                            stats.cancelled += 1;
                        }
                    }
                    if let Some(r) = running.iter_mut().find(|r| r.sub.id == id) {
                        r.gone = true;
                    }
                }
                Command::Stop(id) => {
                    if let Some(r) = running.iter_mut().find(|r| r.sub.id == id) {
                        r.stop = true;
                    }
                    // Preempted and waiting: it ends with what it streamed.
                    if let Some(i) = waiting.iter().position(|w| w.sub.id == id) {
                        if let Some(mut w) = waiting.remove(i) {
                            stats.finished += 1;
                            outcomes.push((w.sub.strategy.name().to_owned(), true, w.streamed.len() as u64));
                            let choice = Choice {
                                tokens: std::mem::take(&mut w.streamed),
                                logprobs: Vec::new(),
                                finish: Some(FinishReason::Stop),
                            };
                            (w.sub.events)(Event::Finished(Generation {
                                choices: vec![choice],
                                stats: Default::default(),
                            }));
                        }
                    }
                }
                Command::Shutdown => {
                    // Everything not finished hears why: the queue, the running requests, and
                    // submissions that came with or after the shutdown.
                    let late = cmds.by_ref().chain(rx.try_iter()).filter_map(|c| match c {
                        Command::Submit(sub) => Some(sub),
                        _ => None,
                    });
                    for mut sub in late.collect::<Vec<_>>() {
                        (sub.events)(Event::Failed("the daemon is shutting down".into()));
                    }
                    for mut w in waiting.drain(..) {
                        (w.sub.events)(Event::Failed("the daemon is shutting down".into()));
                    }
                    for mut r in running.drain(..) {
                        r.session.close(store);
                        (r.sub.events)(Event::Failed("the daemon is shutting down".into()));
                    }
                    report(monitor, store, &stats, 0, 0, 0, &mut outcomes);
                    return stats;
                }
            }
        }
        // Clients that went away lose their sequences in this same step.
        // Requests their clients stopped end as finished, with what they generated.
        for mut r in std::mem::take(&mut running) {
            // A stopped request whose client then left (it got its answer and closed) still
            // counts as finished.
            if r.stop {
                hold = false;
                stats.finished += 1;
                let generation_stats = r.session.stats().clone();
                let choices = r.session.close(store);
                let tokens: u64 = choices.iter().map(|c| c.tokens.len() as u64).sum();
                outcomes.push((r.sub.strategy.name().to_owned(), true, tokens));
                let latency = r.sub.meta.submitted.elapsed().as_secs_f64();
                if let Some(m) = monitor {
                    m.update(|s| s.latency.observe(latency));
                }
                (r.sub.events)(Event::Finished(Generation { choices, stats: generation_stats }));
            } else if r.gone {
                hold = false;
                stats.cancelled += 1;
                r.session.close(store);
                (r.sub.events)(Event::Failed("cancelled".into()));
            } else {
                running.push(r);
            }
        }

        // 2. Admission while the cache has room for the prompt plus one block of growth per
        // running request (and always one request when none runs).
        // A request whose prompt shares SHARED_PREFILL tokens or more with one still being
        // prefilled waits for that prefill: then its prefix comes from the cache instead of
        // being computed twice (the same system prompt from several apps at once is prefilled
        // once). Shorter shared parts (a chat template's opening) are cheaper to recompute than
        // to wait for.
        let block = if store.capacity().is_some() { SHARED_PREFILL } else { usize::MAX };
        let mut prefilling: Vec<Vec<u32>> = if block == usize::MAX || waiting.is_empty() {
            Vec::new()
        } else {
            running.iter().filter(|r| !r.prefilled).map(|r| r.sub.prompt.clone()).collect()
        };
        loop {
            let eligible = |w: &Waiting| !prefilling.iter().any(|p| shared_prefix(p, &w.sub.prompt) >= block);
            let Some(i) = next_waiting(&waiting, &running, &last_admitted, &eligible) else { break };
            if (hold && !running.is_empty()) || running.len() >= cfg.max_running.max(1) {
                break;
            }
            let w = &waiting[i];
            let len = w.sub.prompt.len() + w.streamed.len() + 1;
            if let Some((free, bs)) = store.capacity() {
                let need = len.div_ceil(bs);
                if need + running.len() > free && !running.is_empty() {
                    break;
                }
                if need > free {
                    // Nothing else runs, so everything is free: larger than the cache.
                    let Some(mut w) = waiting.remove(i) else { break };
                    (w.sub.events)(Event::Failed(format!(
                        "the request needs {need} KV blocks, more than the cache holds ({free} free)"
                    )));
                    stats.failed += 1;
                    continue;
                }
            }
            let Some(mut w) = waiting.remove(i) else { break };
            admissions += 1;
            last_admitted.insert(w.sub.meta.uid, admissions);
            // (Creating a session emits nothing.)
            match Session::create(
                Arc::clone(&w.sub.strategy),
                store,
                &request(&w.sub, &w.streamed, &cfg.eos),
                &mut |_, _| {},
            ) {
                Ok(session) => {
                    if block != usize::MAX {
                        prefilling.push(w.sub.prompt.clone());
                    }
                    running.push(Running {
                        sub: w.sub,
                        session,
                        streamed: w.streamed,
                        started: w.started,
                        gone: false,
                        stop: false,
                        prefilled: false,
                        deferred: false,
                    });
                }
                Err(e) => {
                    (w.sub.events)(Event::Failed(e.to_string()));
                    stats.failed += 1;
                    outcomes.push((w.sub.strategy.name().to_owned(), false, 0));
                }
            }
        }
        if running.is_empty() {
            report(monitor, store, &stats, 0, waiting.len(), emitted, &mut outcomes);
            if disconnected && waiting.is_empty() {
                return stats;
            }
            continue;
        }

        // 3. Plans, merged under the token budget (the oldest requests first).
        let mut batch: Vec<StoreRun> = Vec::new();
        let mut parts: Vec<(usize, std::ops::Range<usize>)> = Vec::new();
        let mut budget = cfg.token_budget;
        let mut prefill: Vec<(StoreSeq, usize)> = Vec::new();
        let mut done: Vec<(usize, Result<(), String>)> = Vec::new();
        for (i, r) in running.iter_mut().enumerate() {
            let Running { sub, session, streamed, started, gone, deferred, .. } = r;
            let mut emit = Emit { sub, streamed, started, gone, emitted: &mut emitted, monitor };
            match session.plan(store, &mut |c, t| emit.token(c, t)) {
                Ok(Some(work)) => {
                    let pending: usize = work.iter().map(|w| store.pending(w.seq)).sum();
                    let tokens: usize = work.iter().map(|w| w.tokens.len().max(1)).sum::<usize>() + pending;
                    if tokens > budget && pending > 0 {
                        // Chunked prefill: part of the prompt runs in this step's forward, next
                        // to everyone's decode tokens; the plan comes again next step. (At least
                        // MIN_CHUNK tokens, so a prompt always progresses; at least one token
                        // stays pending for the plan itself when it brings none.)
                        let mut room = budget.max(MIN_CHUNK);
                        let chunks = prefill.len();
                        for w in &work {
                            let keep = usize::from(w.tokens.is_empty());
                            let k = store.pending(w.seq).saturating_sub(keep).min(room);
                            if k > 0 {
                                prefill.push((w.seq, k));
                                room -= k;
                                budget = budget.saturating_sub(k);
                            }
                        }
                        // Nothing left to chunk (one token kept for the plan): the plan itself
                        // goes through the deferral below, so it runs next step at the latest.
                        if prefill.len() > chunks {
                            continue;
                        }
                    }
                    if tokens > budget && !batch.is_empty() && !*deferred {
                        *deferred = true; // next step it runs whatever its size
                        continue;
                    }
                    *deferred = false;
                    budget = budget.saturating_sub(tokens);
                    parts.push((i, batch.len()..batch.len() + work.len()));
                    batch.extend(work);
                }
                Ok(None) => done.push((i, Ok(()))),
                Err(e) => done.push((i, Err(e.to_string()))),
            }
        }

        // 4. One forward for everyone.
        let mut preempt = false;
        if !batch.is_empty() || !prefill.is_empty() {
            stats.steps += 1;
            // Each part's rows, from one batch, or (when the batch failed for another reason
            // than a full cache) from running each part alone, so only the request at fault fails.
            let results: Vec<Result<Vec<Vec<f32>>, StoreError>> = match store.run_with_prefill(&batch, &prefill) {
                Ok(mut rows) => parts.iter().map(|(_, r)| Ok(rows.drain(..r.len()).collect())).collect(),
                Err(StoreError::Engine(EngineError::OutOfBlocks(_))) => {
                    preempt = true;
                    Vec::new()
                }
                Err(_) => parts.iter().map(|(_, r)| store.run(&batch[r.clone()])).collect(),
            };
            for ((i, range), rows) in parts.iter().zip(results) {
                let Running { sub, session, streamed, started, gone, prefilled, .. } = &mut running[*i];
                *prefilled = true;
                let mut emit = Emit { sub, streamed, started, gone, emitted: &mut emitted, monitor };
                let outcome = match rows {
                    Ok(rows) => session
                        .observe(store, &batch[range.clone()], &rows, &mut |c, t| emit.token(c, t))
                        .map_err(|e| e.to_string()),
                    Err(e) => Err(format!("running the model: {e}")),
                };
                if let Err(e) = outcome {
                    done.push((*i, Err(e)));
                }
            }
        }

        // 5. Retire finished and failed requests; preempt when the cache ran out.
        done.sort_by_key(|d| std::cmp::Reverse(d.0));
        done.dedup_by_key(|d| d.0);
        // Requests leaving now give their blocks back: a step that ran out of blocks is simply
        // tried again next step, with nobody preempted or failed.
        let left = !done.is_empty();
        for (i, outcome) in done {
            hold = false;
            let mut r = running.remove(i);
            let stats_map = r.session.stats().clone();
            let choices = r.session.close(store);
            let name = r.sub.strategy.name().to_owned();
            let tokens: u64 = choices.iter().map(|c| c.tokens.len() as u64).sum();
            match outcome {
                Ok(()) => {
                    stats.finished += 1;
                    let mut choices = choices;
                    // The client saw the tokens streamed before a preemption: report them too.
                    if !r.streamed.is_empty() && r.sub.n == 1 {
                        if let Some(c) = choices.first_mut() {
                            let before = r.streamed.len().saturating_sub(c.tokens.len());
                            let mut all = r.streamed[..before].to_vec();
                            all.extend(&c.tokens);
                            c.tokens = all;
                        }
                    }
                    let latency = r.sub.meta.submitted.elapsed().as_secs_f64();
                    if let Some(m) = monitor {
                        m.update(|s| s.latency.observe(latency));
                    }
                    outcomes.push((name, true, tokens));
                    (r.sub.events)(Event::Finished(Generation { choices, stats: stats_map }));
                }
                Err(msg) => {
                    stats.failed += 1;
                    outcomes.push((name, false, tokens));
                    (r.sub.events)(Event::Failed(msg));
                }
            }
        }
        if preempt && !left {
            if running.len() <= 1 {
                // Alone and still out of blocks: it cannot ever fit.
                if let Some(mut r) = running.pop() {
                    r.session.close(store);
                    stats.failed += 1;
                    outcomes.push((r.sub.strategy.name().to_owned(), false, 0));
                    (r.sub.events)(Event::Failed(
                        "out of KV cache blocks: the request does not fit in the cache".into(),
                    ));
                }
            } else if let Some(mut r) = running.pop() {
                // The newest request gives its blocks back and is recomputed later.
                hold = true;
                stats.preempted += 1;
                r.session.close(store);
                if r.sub.n == 1 || r.streamed.is_empty() {
                    waiting.push_front(Waiting { sub: r.sub, streamed: r.streamed, started: r.started, resumed: true });
                } else {
                    stats.failed += 1;
                    outcomes.push((r.sub.strategy.name().to_owned(), false, 0));
                    (r.sub.events)(Event::Failed("preempted: out of KV cache blocks".into()));
                }
            }
        }
        report(monitor, store, &stats, running.len(), waiting.len(), emitted, &mut outcomes);
    }
}

/// The step's state to the monitor.
fn report(
    monitor: Option<&Monitor>,
    store: &dyn SeqStore,
    stats: &LoopStats,
    running: usize,
    waiting: usize,
    emitted: u64,
    outcomes: &mut Vec<(String, bool, u64)>,
) {
    let Some(m) = monitor else { return };
    let cache = store.cache_stats();
    m.update(|s| {
        if let Some(c) = cache {
            s.kv = c.kv;
            s.prompt_tokens = c.prompt_tokens;
            s.cached_prompt_tokens = c.cached_prompt_tokens;
        }
        s.running = running;
        s.waiting = waiting;
        s.steps = stats.steps;
        s.finished = stats.finished;
        s.failed = stats.failed;
        s.cancelled = stats.cancelled;
        s.preempted = stats.preempted;
        s.generated_tokens += emitted;
        for (name, ok, tokens) in outcomes.drain(..) {
            let c = s.strategies.entry(name).or_default();
            if ok {
                c.finished += 1;
            } else {
                c.failed += 1;
            }
            c.tokens += tokens;
        }
    });
}
