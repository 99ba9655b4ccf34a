//! The engine loop: the one thread that owns a model's engine, its KV cache and every request's
//! plugin session. Requests, cancellations and shutdown arrive as [`Command`]s over a channel;
//! each request's tokens leave as [`Event`]s over its own channel.
//!
//! Continuous batching at iteration level (Yu et al., Orca, 2022; as in vLLM): every step
//! 1. takes the commands that arrived,
//! 2. admits waiting requests while the KV cache has room for their prompts,
//! 3. asks every running session for its plan and merges the plans into one batch under the
//!    step's token budget (a plan that does not fit waits for the next step),
//! 4. runs the batch once and hands every session its rows,
//! 5. retires finished and failed requests at once, so a short request never waits for a long
//!    one.
//!
//! When the cache runs out mid-generation the newest running request is preempted: its
//! sequences are freed and it waits at the front of the queue to be recomputed, continuing
//! from the tokens it already streamed (they are not sent twice). A request that alone needs
//! more blocks than the whole cache fails at admission.

use crate::decode::store::{SeqStore, StoreError, StoreRun};
use crate::decode::Generation;
use crate::engine::EngineError;
use crate::plugin::{LoadedStrategy, Session, SessionRequest};
use std::collections::VecDeque;
use std::sync::mpsc::{Receiver, Sender};
use std::sync::Arc;

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
    pub events: EventSink,
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
    /// Cancel everything and end the loop.
    Shutdown,
}

/// Scheduler settings.
#[derive(Clone, Debug)]
pub struct LoopConfig {
    /// Tokens per step across all sessions (decode tokens and prefill chunks).
    pub token_budget: usize,
    /// Requests running at once, at most.
    pub max_running: usize,
    pub eos: Vec<u32>,
}

struct Waiting {
    sub: Submission,
    /// Tokens already streamed before a preemption (choice 0; continued on recompute).
    streamed: Vec<u32>,
}

struct Running {
    sub: Submission,
    session: Session,
    streamed: Vec<u32>,
    /// The client went away: close at the end of the step.
    gone: bool,
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

/// Runs until [`Command::Shutdown`] or until every sender is gone and no work is left.
pub fn engine_loop(store: &mut dyn SeqStore, rx: &Receiver<Command>, cfg: &LoopConfig) -> LoopStats {
    let mut stats = LoopStats::default();
    let mut waiting: VecDeque<Waiting> = VecDeque::new();
    let mut running: Vec<Running> = Vec::new();
    let mut disconnected = false;
    // After a preemption nothing is admitted until a request leaves: otherwise the preempted
    // request comes straight back and the cache overflows again (livelock).
    let mut hold = false;
    loop {
        // 1. Commands: block only when there is nothing to do.
        let mut cmds = Vec::new();
        if running.is_empty() && waiting.is_empty() {
            match rx.recv() {
                Ok(c) => cmds.push(c),
                Err(_) => return stats,
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
        for c in cmds {
            match c {
                Command::Submit(sub) => waiting.push_back(Waiting { sub, streamed: Vec::new() }),
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
                Command::Shutdown => {
                    for mut w in waiting.drain(..) {
                        (w.sub.events)(Event::Failed("the daemon is shutting down".into()));
                    }
                    for mut r in running.drain(..) {
                        r.session.close(store);
                        (r.sub.events)(Event::Failed("the daemon is shutting down".into()));
                    }
                    return stats;
                }
            }
        }
        // Clients that went away lose their sequences in this same step.
        for mut r in std::mem::take(&mut running) {
            if r.gone {
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
        while let Some(w) = waiting.front() {
            if (hold && !running.is_empty()) || running.len() >= cfg.max_running.max(1) {
                break;
            }
            let len = w.sub.prompt.len() + w.streamed.len() + 1;
            if let Some((free, bs)) = store.capacity() {
                let need = len.div_ceil(bs);
                if need + running.len() > free && !running.is_empty() {
                    break;
                }
                if need > free {
                    // Nothing else runs, so everything is free: larger than the cache.
                    let Some(mut w) = waiting.pop_front() else { break };
                    (w.sub.events)(Event::Failed(format!("the request needs {need} KV blocks, more than the cache holds ({free} free)")));
                    stats.failed += 1;
                    continue;
                }
            }
            let Some(mut w) = waiting.pop_front() else { break };
            // (Creating a session emits nothing.)
            match Session::create(Arc::clone(&w.sub.strategy), store, &request(&w.sub, &w.streamed, &cfg.eos), &mut |_, _| {}) {
                Ok(session) => running.push(Running { sub: w.sub, session, streamed: w.streamed, gone: false, deferred: false }),
                Err(e) => {
                    (w.sub.events)(Event::Failed(e.to_string()));
                    stats.failed += 1;
                }
            }
        }
        if running.is_empty() {
            if disconnected && waiting.is_empty() {
                return stats;
            }
            continue;
        }

        // 3. Plans, merged under the token budget (the oldest requests first).
        let mut batch: Vec<StoreRun> = Vec::new();
        let mut parts: Vec<(usize, std::ops::Range<usize>)> = Vec::new();
        let mut budget = cfg.token_budget;
        let mut done: Vec<(usize, Result<(), String>)> = Vec::new();
        for (i, r) in running.iter_mut().enumerate() {
            let Running { sub, session, streamed, gone, deferred } = r;
            let mut on = |c: u32, t: u32| {
                if c == 0 {
                    streamed.push(t);
                }
                if !(sub.events)(Event::Token { choice: c, token: t }) {
                    *gone = true;
                }
            };
            match session.plan(store, &mut on) {
                Ok(Some(work)) => {
                    let tokens: usize = work.iter().map(|w| w.tokens.len().max(1)).sum();
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
        if !batch.is_empty() {
            stats.steps += 1;
            // Each part's rows, from one batch, or (when the batch failed for another reason
            // than a full cache) from running each part alone, so only the request at fault fails.
            let results: Vec<Result<Vec<Vec<f32>>, StoreError>> = match store.run(&batch) {
                Ok(mut rows) => parts.iter().map(|(_, r)| Ok(rows.drain(..r.len()).collect())).collect(),
                Err(StoreError::Engine(EngineError::OutOfBlocks(_))) => {
                    preempt = true;
                    Vec::new()
                }
                Err(_) => parts.iter().map(|(_, r)| store.run(&batch[r.clone()])).collect(),
            };
            for ((i, range), rows) in parts.iter().zip(results) {
                let Running { sub, session, streamed, gone, .. } = &mut running[*i];
                let mut on = |c: u32, t: u32| {
                    if c == 0 {
                        streamed.push(t);
                    }
                    if !(sub.events)(Event::Token { choice: c, token: t }) {
                        *gone = true;
                    }
                };
                let outcome = match rows {
                    Ok(rows) => session.observe(store, &batch[range.clone()], &rows, &mut on).map_err(|e| e.to_string()),
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
        for (i, outcome) in done {
            hold = false;
            let mut r = running.remove(i);
            let stats_map = r.session.stats().clone();
            let choices = r.session.close(store);
            match outcome {
                Ok(()) => {
                    stats.finished += 1;
                    let mut choices = choices;
                    // The client saw the tokens streamed before a preemption: report them too.
                    if !r.streamed.is_empty() && r.sub.n == 1 {
                        if let Some(c) = choices.first_mut() {
                            let before = r.streamed.len() - c.tokens.len();
                            let mut all = r.streamed[..before].to_vec();
                            all.extend(&c.tokens);
                            c.tokens = all;
                        }
                    }
                    (r.sub.events)(Event::Finished(Generation { choices, stats: stats_map }));
                }
                Err(msg) => {
                    stats.failed += 1;
                    (r.sub.events)(Event::Failed(msg));
                }
            }
        }
        if preempt {
            if running.len() <= 1 {
                // Alone and still out of blocks: it cannot ever fit.
                if let Some(mut r) = running.pop() {
                    r.session.close(store);
                    stats.failed += 1;
                    (r.sub.events)(Event::Failed("out of KV cache blocks: the request does not fit in the cache".into()));
                }
            } else if let Some(mut r) = running.pop() {
                // The newest request gives its blocks back and is recomputed later.
                hold = true;
                stats.preempted += 1;
                r.session.close(store);
                if r.sub.n == 1 || r.streamed.is_empty() {
                    waiting.push_front(Waiting { sub: r.sub, streamed: r.streamed });
                } else {
                    stats.failed += 1;
                    (r.sub.events)(Event::Failed("preempted: out of KV cache blocks".into()));
                }
            }
        }
    }
}
