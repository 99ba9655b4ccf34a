//! The scheduler: every request from submission to its one way out.
//!
//! Each [`Scheduler::step`]
//! 1. retires requests whose client stopped them or went away,
//! 2. admits waiting requests while the KV cache has room for their prompts (`queue.rs`),
//! 3. asks every running session for its plan and decides, under the step's token budget,
//!    which plans run, which prompts get a chunk and which wait (`budget.rs`),
//! 4. runs everything in one forward and hands every session its rows,
//! 5. retires finished and failed requests at once, so a short request never waits for a
//!    long one, and preempts when the cache ran out.
//!
//! Preemption (recompute, as vLLM does): when a step does not fit and nobody left, the newest
//! running request gives all its blocks back and waits at the front of the queue; nothing is
//! admitted until a request leaves (otherwise it comes straight back and the cache overflows
//! again). Its client does not notice but for the pause: a single choice continues from the
//! tokens it already streamed (they become part of the prompt); several choices, or any
//! strategy whose state is more than its tokens, are recomputed from the prompt with the same
//! seed (the engine is batch-invariant and the plugin's randomness counter-based, so the same
//! tokens come again) and what was already streamed is not sent twice. A request is failed for
//! want of blocks only when it runs alone and still does not fit: the whole cache is too small
//! for it.
//!
//! Every request leaves through [`Scheduler::retire`]: its session closed (every sequence
//! freed), counted once, its client told once. Embedding jobs (`embed.rs`) run their texts as
//! prompt chunks in the same steps and leave through [`Scheduler::close_embedding`].

use super::budget::{decide, Decision, PlanSize};
use super::embed::{EmbedJob, Started};
use super::queue::{Candidate, Turns};
use super::{Command, Event, LoopConfig, LoopStats, PrefixSharing, RequestId, RequestMeta, Submission};
use crate::decode::store::{SeqStore, StoreError, StoreRun, StoreSeq};
use crate::decode::Generation;
use crate::engine::EngineError;
use crate::plugin::{Choice, FinishReason, Session, SessionRequest};
use std::collections::VecDeque;
use std::sync::Arc;

/// How a request left.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Done, or stopped by its client (a stop string): it got its answer.
    Finished,
    Cancelled,
    Failed(String),
}

/// What one step did, for tests and reports.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepOutput {
    pub admitted: Vec<RequestId>,
    /// Requests that left (this step, or by a command since the last one), and how.
    pub retired: Vec<(RequestId, Outcome)>,
    pub preempted: Vec<RequestId>,
    /// Plans that ran whole, and the tokens they appended (prompts included).
    pub planned: Vec<(RequestId, usize)>,
    /// Prompt chunks that ran without their plan.
    pub chunks: Vec<(RequestId, usize)>,
    /// Embedding chunks: (job, tokens), a text's chunk each.
    pub embedded: Vec<(RequestId, usize)>,
    /// Tokens sent to clients.
    pub emitted: u64,
}

/// Where a request is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestState {
    Waiting,
    /// Preempted, waiting to be recomputed.
    Preempted,
    /// Running, its prompt not run yet (or still in chunks).
    Prefilling,
    Decoding,
}

/// What the monitor counts, gathered since it last looked.
#[derive(Debug, Default)]
pub struct Observations {
    pub ttft: Vec<f64>,
    pub latency: Vec<f64>,
    pub outcomes: Vec<StrategyOutcome>,
}

/// A request of a strategy left: finished or not, with how many tokens.
#[derive(Debug)]
pub struct StrategyOutcome {
    pub strategy: String,
    pub ok: bool,
    pub tokens: u64,
}

/// A request's progress, kept across preemptions.
struct Progress {
    sub: Submission,
    /// Tokens sent to the client, per choice.
    streamed: Vec<Vec<u32>>,
    /// Its first token went out (TTFT recorded).
    started: bool,
}

struct Waiting {
    req: Progress,
    /// It was preempted: it goes back before anyone else.
    resumed: bool,
}

/// How a running session relates to what its client has already been sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Resume {
    /// A fresh request, or a single choice continuing after the first `base` tokens (they are
    /// part of the session's prompt).
    Continue { base: usize },
    /// Recomputed from the prompt: each choice's first tokens are already sent.
    Replay,
}

struct Running {
    req: Progress,
    session: Session,
    resume: Resume,
    /// Tokens the session has emitted per choice (replay: compared with what was sent).
    emitted: Vec<usize>,
    /// The client went away: close at the start of the next step.
    gone: bool,
    /// The client stopped it (a stop string): finish it at the start of the next step.
    stop: bool,
    /// A recompute produced other tokens than the client was sent.
    diverged: bool,
    /// Its prompt has been run (its first plan was observed).
    prefilled: bool,
    /// Its plan waited for a step with room; it goes first next time.
    deferred: bool,
    /// Prompt tokens its start took from the prefix cache.
    cached: usize,
}

/// Sends a running request's tokens: records them, suppresses what a replay already sent,
/// marks a client that is gone.
struct Emit<'a> {
    req: &'a mut Progress,
    resume: Resume,
    emitted: &'a mut Vec<usize>,
    gone: &'a mut bool,
    diverged: &'a mut bool,
    sent: &'a mut u64,
    ttft: &'a mut Vec<f64>,
}

impl Emit<'_> {
    fn token(&mut self, choice: u32, token: u32, logprob: f32, top: &[(u32, f32)]) {
        let c = choice as usize;
        if self.emitted.len() <= c {
            self.emitted.resize(c + 1, 0);
            self.req.streamed.resize(c + 1, Vec::new());
        }
        let k = self.emitted[c];
        self.emitted[c] += 1;
        if self.resume == Resume::Replay && k < self.req.streamed[c].len() {
            if self.req.streamed[c][k] != token {
                *self.diverged = true;
            }
            return;
        }
        self.req.streamed[c].push(token);
        if !self.req.started {
            self.req.started = true;
            self.ttft.push(self.req.sub.meta.submitted.elapsed().as_secs_f64());
        }
        *self.sent += 1;
        if !(self.req.sub.events)(Event::Token { choice, token, logprob, top: top.to_vec() }) {
            *self.gone = true;
        }
    }
}

/// What one step runs: the plans run whole (`items`, `parts` giving each request's range by its
/// index in `running`) and the prompt chunks run without their plans.
#[derive(Default)]
struct Batch {
    items: Vec<StoreRun>,
    parts: Vec<(usize, std::ops::Range<usize>)>,
    chunks: Vec<(StoreSeq, usize)>,
    /// Chunks of embedding texts: (job index, sequence, tokens).
    embeds: Vec<(usize, StoreSeq, usize)>,
}

/// How a request is leaving.
enum Exit {
    /// Done (or stopped by its client) with these choices.
    Finished(Generation),
    Cancelled,
    Failed(String),
}

/// The prefix-cache partition of a request's sequences: its user's, unless shared.
fn partition(sharing: PrefixSharing, meta: &RequestMeta) -> Option<u64> {
    match sharing {
        PrefixSharing::Shared => None,
        PrefixSharing::PerUser => Some(u64::from(meta.uid)),
    }
}

/// The scheduler of one engine; see the module docs.
pub struct Scheduler {
    cfg: LoopConfig,
    waiting: VecDeque<Waiting>,
    running: Vec<Running>,
    /// After a preemption nothing is admitted until a request leaves.
    hold: bool,
    /// Waiting requests whose images were still being encoded at the last admission.
    unready: usize,
    turns: Turns,
    /// Embedding jobs, in arrival order.
    embeds: Vec<EmbedJob>,
    stats: LoopStats,
    out: StepOutput,
    seen: Observations,
}

impl Scheduler {
    pub fn new(cfg: LoopConfig) -> Self {
        Scheduler {
            cfg,
            waiting: VecDeque::new(),
            running: Vec::new(),
            hold: false,
            unready: 0,
            turns: Turns::default(),
            embeds: Vec::new(),
            stats: LoopStats::default(),
            out: StepOutput::default(),
            seen: Observations::default(),
        }
    }

    pub fn stats(&self) -> &LoopStats {
        &self.stats
    }

    /// Requests running, embedding jobs with texts running included.
    pub fn running(&self) -> usize {
        self.running.len() + self.embeds.iter().filter(|j| !j.flight.is_empty()).count()
    }

    pub fn waiting(&self) -> usize {
        self.waiting.len() + self.embeds.iter().filter(|j| j.flight.is_empty()).count()
    }

    /// Every request and where it is: the queue in order, then the running ones.
    pub fn requests(&self) -> Vec<(RequestId, RequestState)> {
        let waiting = self
            .waiting
            .iter()
            .map(|w| (w.req.sub.id, if w.resumed { RequestState::Preempted } else { RequestState::Waiting }));
        let running = self
            .running
            .iter()
            .map(|r| (r.req.sub.id, if r.prefilled { RequestState::Decoding } else { RequestState::Prefilling }));
        let embeds = self
            .embeds
            .iter()
            .map(|j| (j.id, if j.flight.is_empty() { RequestState::Waiting } else { RequestState::Prefilling }));
        waiting.chain(running).chain(embeds).collect()
    }

    pub fn is_idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty() && self.embeds.is_empty()
    }

    /// What the monitor has not seen yet.
    pub fn take_observations(&mut self) -> Observations {
        std::mem::take(&mut self.seen)
    }

    /// Takes one command (a `Shutdown` here is [`Scheduler::shutdown`] with no late commands).
    pub fn handle(&mut self, cmd: Command, store: &mut dyn SeqStore) {
        match cmd {
            Command::Submit(mut sub) => {
                // Images become media ids in the prompt here, before anything keys on it, and
                // start encoding unless the request's partition of the prefix cache holds them.
                store.set_partition(partition(self.cfg.prefix_sharing, &sub.meta));
                let attached = store.attach_images(&mut sub.prompt, &mut sub.images);
                let streamed = vec![Vec::new(); sub.n.max(1) as usize];
                let req = Progress { sub, streamed, started: false };
                match attached {
                    Ok(()) => self.waiting.push_back(Waiting { req, resumed: false }),
                    Err(e) => self.retire(req, None, Exit::Failed(e.to_string()), store),
                }
            }
            Command::Cancel(id) => {
                if let Some(i) = self.waiting.iter().position(|w| w.req.sub.id == id) {
                    if let Some(w) = self.waiting.remove(i) {
                        self.retire(w.req, None, Exit::Cancelled, store);
                    }
                }
                if let Some(r) = self.running.iter_mut().find(|r| r.req.sub.id == id) {
                    r.gone = true;
                }
                if let Some(j) = self.embeds.iter_mut().find(|j| j.id == id) {
                    j.gone = true;
                }
            }
            Command::Stop(id) => {
                if let Some(r) = self.running.iter_mut().find(|r| r.req.sub.id == id) {
                    r.stop = true;
                }
                // Preempted and waiting: it ends with what it streamed.
                if let Some(i) = self.waiting.iter().position(|w| w.req.sub.id == id) {
                    if let Some(w) = self.waiting.remove(i) {
                        let choices = w
                            .req
                            .streamed
                            .iter()
                            .map(|t| Choice {
                                tokens: t.clone(),
                                finish: Some(FinishReason::Stop),
                                ..Choice::default()
                            })
                            .collect();
                        let g = Generation { choices, ..Generation::default() };
                        self.retire(w.req, None, Exit::Finished(g), store);
                    }
                }
            }
            Command::Embed(e) => self.embeds.push(EmbedJob::new(e)),
            Command::Shutdown => self.shutdown(store, Vec::new()),
        }
    }

    /// Fails everything not finished, and the submissions among `late` (commands that came
    /// with or after the shutdown).
    pub fn shutdown(&mut self, store: &mut dyn SeqStore, late: Vec<Command>) {
        const WHY: &str = "the daemon is shutting down";
        for c in late {
            match c {
                Command::Submit(mut sub) => {
                    (sub.events)(Event::Failed(WHY.into()));
                }
                Command::Embed(e) => (e.reply)(Err(WHY.into())),
                _ => {}
            }
        }
        for j in std::mem::take(&mut self.embeds) {
            self.close_embedding(j, Exit::Failed(WHY.into()), store);
        }
        for w in std::mem::take(&mut self.waiting) {
            self.retire(w.req, None, Exit::Failed(WHY.into()), store);
        }
        for r in std::mem::take(&mut self.running) {
            self.retire(r.req, Some(r.session), Exit::Failed(WHY.into()), store);
        }
    }

    /// One step; see the module docs. Returns what it did (and what commands did since).
    pub fn step(&mut self, store: &mut dyn SeqStore) -> StepOutput {
        self.retire_requested(store);
        self.admit(store);
        self.start_embeddings(store);
        if !self.running.is_empty() || self.embeds.iter().any(|j| !j.flight.is_empty()) {
            self.run(store);
        }
        self.finish_embeddings(store);
        std::mem::take(&mut self.out)
    }

    /// Embedding jobs start texts, first come first served, while the cache has room beside
    /// the running requests (a block of growth per running choice) and the texts already
    /// started (`embed.rs`).
    fn start_embeddings(&mut self, store: &mut dyn SeqStore) {
        let cap = store.capacity();
        let bs = cap.map_or(1, |c| c.1);
        let growth: usize = self.running.iter().map(|r| r.req.sub.n.max(1) as usize).sum();
        let reserved: usize = self.embeds.iter().map(|j| j.reserved(store, bs)).sum();
        let mut room = cap.map(|(free, _)| free.saturating_sub(growth + reserved));
        let alone = self.running.is_empty() && reserved == 0;
        let mut failed = Vec::new();
        for (i, j) in self.embeds.iter_mut().enumerate() {
            if j.gone {
                continue;
            }
            store.set_partition(partition(self.cfg.prefix_sharing, &j.meta));
            match j.start(store, &mut room, bs, self.cfg.token_budget, alone && i == 0) {
                Started::Ok => {}
                Started::Full => break,
                Started::Failed(why) => failed.push((i, why)),
            }
        }
        for (i, why) in failed.into_iter().rev() {
            let j = self.embeds.remove(i);
            self.close_embedding(j, Exit::Failed(why), store);
        }
    }

    /// Jobs whose texts have all run answer; gone ones are cancelled.
    fn finish_embeddings(&mut self, store: &mut dyn SeqStore) {
        for mut j in std::mem::take(&mut self.embeds) {
            let exit = if let Some(why) = j.failure.take() {
                Some(Exit::Failed(why))
            } else if j.gone {
                Some(Exit::Cancelled)
            } else {
                match j.collect(store) {
                    Err(why) => Some(Exit::Failed(why)),
                    Ok(()) if j.done() => Some(Exit::Finished(Generation::default())),
                    Ok(()) => None,
                }
            };
            match exit {
                Some(exit) => self.close_embedding(j, exit, store),
                None => self.embeds.push(j),
            }
        }
    }

    /// The one way out of an embedding job: its texts freed, counted once, its client told
    /// once.
    fn close_embedding(&mut self, j: EmbedJob, exit: Exit, store: &mut dyn SeqStore) {
        let id = j.id;
        let (outcome, failure) = match exit {
            Exit::Finished(_) => {
                self.stats.finished += 1;
                self.seen.latency.push(j.meta.submitted.elapsed().as_secs_f64());
                (Outcome::Finished, None)
            }
            Exit::Cancelled => {
                self.stats.cancelled += 1;
                (Outcome::Cancelled, Some("cancelled".to_string()))
            }
            Exit::Failed(why) => {
                self.stats.failed += 1;
                (Outcome::Failed(why.clone()), Some(why))
            }
        };
        j.close(store, failure);
        self.out.retired.push((id, outcome));
    }

    /// Requests whose client stopped them (finished) or went away (cancelled).
    fn retire_requested(&mut self, store: &mut dyn SeqStore) {
        for r in std::mem::take(&mut self.running) {
            // A stopped request whose client then left (it got its answer and closed) still
            // counts as finished.
            if r.stop {
                let stats = r.session.stats().clone();
                let choices = r.session.close(store);
                let g =
                    Generation { choices: merged(&r.req, r.resume, choices), stats, cached_prompt_tokens: r.cached };
                self.retire(r.req, None, Exit::Finished(g), store);
            } else if r.gone {
                self.retire(r.req, Some(r.session), Exit::Cancelled, store);
            } else {
                self.running.push(r);
            }
        }
    }

    /// Admits waiting requests while the cache has room for the prompt, a block for each
    /// further choice (choices diverge at their first token) and one block of growth per
    /// running choice (and always one request when none runs). Counting choices, not
    /// requests, keeps requests with several choices from being admitted only to be preempted.
    fn admit(&mut self, store: &mut dyn SeqStore) {
        // Without a bounded cache there is no prefix cache to wait for either.
        let share = store.capacity().is_some();
        let mut ready = self.images_ready(store);
        loop {
            if (self.hold && !self.running.is_empty()) || self.running.len() >= self.cfg.max_running.max(1) {
                return;
            }
            let next = {
                let cands: Vec<Candidate<'_>> = (self.waiting.iter().zip(&ready))
                    .map(|(w, &ready)| Candidate {
                        meta: w.req.sub.meta,
                        prompt: &w.req.sub.prompt,
                        resumed: w.resumed,
                        ready,
                    })
                    .collect();
                let uids: Vec<u32> = self.running.iter().map(|r| r.req.sub.meta.uid).collect();
                let prefilling: Vec<&[u32]> = if share {
                    self.running.iter().filter(|r| !r.prefilled).map(|r| r.req.sub.prompt.as_slice()).collect()
                } else {
                    Vec::new()
                };
                self.turns.next(&cands, &uids, &prefilling)
            };
            let Some(i) = next else { return };
            let w = &self.waiting[i];
            let resume = resume_for(&w.req);
            if let Some((free, bs)) = store.capacity() {
                let base = match resume {
                    Resume::Continue { base } => base,
                    Resume::Replay => 0,
                };
                let need = (w.req.sub.prompt.len() + base + 1).div_ceil(bs) + w.req.sub.n.max(1) as usize - 1;
                let growth: usize = self.running.iter().map(|r| r.req.sub.n.max(1) as usize).sum();
                if need + growth > free && !self.running.is_empty() {
                    return;
                }
                if need > free {
                    // Nothing else runs, so everything is free: larger than the cache.
                    ready.remove(i);
                    if let Some(w) = self.waiting.remove(i) {
                        let why =
                            format!("the request needs {need} KV blocks, more than the cache holds ({free} free)");
                        self.retire(w.req, None, Exit::Failed(why), store);
                    }
                    continue;
                }
            }
            ready.remove(i);
            let Some(w) = self.waiting.remove(i) else { return };
            self.turns.admitted(w.req.sub.meta.uid);
            let generated: &[u32] = match resume {
                Resume::Continue { base } => &w.req.streamed[0][..base],
                Resume::Replay => &[],
            };
            let req = SessionRequest {
                prompt: &w.req.sub.prompt,
                generated,
                params: &w.req.sub.params,
                max_tokens: w.req.sub.max_tokens - generated.len() as u32,
                n: w.req.sub.n,
                seed: w.req.sub.seed,
                eos: &self.cfg.eos,
                logprobs: w.req.sub.logprobs,
                vocabulary: self.cfg.vocabulary.as_ref(),
                grammar: w.req.sub.grammar.as_ref(),
            };
            // (Creating a session emits nothing.)
            store.set_partition(partition(self.cfg.prefix_sharing, &w.req.sub.meta));
            // Sessions start one at a time, so the store's count moves by this request's alone.
            let before = store.cache_stats().map_or(0, |c| c.cached_prompt_tokens);
            match Session::create(Arc::clone(&w.req.sub.strategy), store, &req, &mut |_, _, _, _| {}) {
                Ok(session) => {
                    let cached = store.cache_stats().map_or(0, |c| c.cached_prompt_tokens).saturating_sub(before);
                    self.out.admitted.push(w.req.sub.id);
                    let emitted = vec![0; w.req.streamed.len()];
                    self.running.push(Running {
                        req: w.req,
                        session,
                        resume,
                        emitted,
                        gone: false,
                        stop: false,
                        diverged: false,
                        prefilled: false,
                        deferred: false,
                        cached: cached as usize,
                    });
                }
                Err(e) => self.retire(w.req, None, Exit::Failed(e.to_string()), store),
            }
        }
    }

    /// Whether each waiting request's images are ready (`admit`); a request whose image the
    /// encoder failed on leaves, failed. Counts those not ready for [`Scheduler::stalled`].
    fn images_ready(&mut self, store: &mut dyn SeqStore) -> Vec<bool> {
        let (mut ready, mut failed) = (Vec::with_capacity(self.waiting.len()), Vec::new());
        for (i, w) in self.waiting.iter().enumerate() {
            match w.req.sub.images.is_empty() {
                true => ready.push(true),
                false => match store.images_ready(&w.req.sub.images) {
                    Ok(r) => ready.push(r),
                    Err(e) => failed.push((i, e.to_string())),
                },
            }
        }
        for (i, why) in failed.into_iter().rev() {
            if let Some(w) = self.waiting.remove(i) {
                self.retire(w.req, None, Exit::Failed(why), store);
            }
        }
        self.unready = ready.iter().filter(|r| !**r).count();
        ready
    }

    /// Whether the loop has nothing to run until an image is encoded: nothing running, and
    /// every waiting request waits for its images. The loop then waits for the encoder
    /// ([`SeqStore::wait_images`]) instead of turning idly.
    pub fn stalled(&self) -> bool {
        self.running.is_empty()
            && self.embeds.is_empty()
            && !self.waiting.is_empty()
            && self.unready == self.waiting.len()
    }

    /// Plans, budget, one forward, observe, retire, preempt.
    fn run(&mut self, store: &mut dyn SeqStore) {
        let mut sent = 0u64;
        let mut done: Vec<(usize, Result<(), String>)> = Vec::new();
        let plans = self.plan(store, &mut sent, &mut done);
        let batch = self.batch(store, plans);
        let preempt = self.forward(store, &batch, &mut sent, &mut done);
        self.out.emitted += sent;
        // A recompute that diverged from what its client saw cannot go on consistently.
        for (i, r) in self.running.iter().enumerate() {
            if r.diverged {
                let why = "recomputing after a preemption gave other tokens than were sent".to_string();
                done.push((i, Err(why)));
            }
        }
        // Requests leaving give their blocks back: a step that did not fit is simply tried
        // again; when nobody left, the newest request makes room.
        let left = !done.is_empty();
        self.retire_done(store, done);
        if preempt && !left {
            // Embedding texts give their blocks back first: they start over at no client's
            // expense.
            match self.embeds.iter_mut().rev().find(|j| !j.flight.is_empty()) {
                Some(j) => j.restart(store),
                None => self.preempt(store),
            }
        }
    }

    /// Every running session's plan, by its index in `running`; sessions that are done or
    /// failed go to `done`.
    fn plan(
        &mut self,
        store: &mut dyn SeqStore,
        sent: &mut u64,
        done: &mut Vec<(usize, Result<(), String>)>,
    ) -> Vec<(usize, Vec<StoreRun>)> {
        let mut plans = Vec::new();
        let sharing = self.cfg.prefix_sharing;
        for (i, r) in self.running.iter_mut().enumerate() {
            let Running { req, session, resume, emitted, gone, diverged, .. } = r;
            store.set_partition(partition(sharing, &req.sub.meta));
            let mut emit =
                Emit { req, resume: *resume, emitted, gone, diverged, sent: &mut *sent, ttft: &mut self.seen.ttft };
            match session.plan(store, &mut |c, t, lp, top| emit.token(c, t, lp, top)) {
                Ok(Some(work)) => plans.push((i, work)),
                Ok(None) => done.push((i, Ok(()))),
                Err(e) => done.push((i, Err(e.to_string()))),
            }
        }
        plans
    }

    /// What runs this step: the budget's decision on every plan (`budget.rs`).
    fn batch(&mut self, store: &dyn SeqStore, plans: Vec<(usize, Vec<StoreRun>)>) -> Batch {
        let mut sizes: Vec<PlanSize> = plans
            .iter()
            .map(|(i, work)| {
                let pending: usize = work.iter().map(|w| store.pending(w.seq)).sum();
                let kept = work.iter().filter(|w| w.tokens.is_empty() && store.pending(w.seq) > 0).count();
                PlanSize {
                    tokens: work.iter().map(|w| w.tokens.len().max(1)).sum(),
                    pending,
                    chunkable: pending - kept,
                    deferred: self.running[*i].deferred,
                }
            })
            .collect();
        // Embedding texts after every request's plan: prompts without a plan of their own.
        let texts: Vec<(usize, StoreSeq, usize)> = (self.embeds.iter().enumerate())
            .flat_map(|(j, job)| job.flight.iter().map(move |&(_, s)| (j, s)))
            .map(|(j, s)| (j, s, store.pending(s)))
            .filter(|t| t.2 > 0)
            .collect();
        sizes.extend(texts.iter().map(|t| PlanSize { tokens: 0, pending: t.2, chunkable: t.2, deferred: false }));
        let mut decisions = decide(&sizes, self.cfg.token_budget);
        let mut b = Batch::default();
        for (&(j, s, pending), d) in texts.iter().zip(decisions.split_off(plans.len())) {
            let k = match d {
                Decision::Run => pending,
                Decision::Chunk(k) => k,
                Decision::Defer => continue,
            };
            b.embeds.push((j, s, k));
            self.out.embedded.push((self.embeds[j].id, k));
        }
        for ((i, work), (d, size)) in plans.into_iter().zip(decisions.into_iter().zip(&sizes)) {
            let id = self.running[i].req.sub.id;
            self.running[i].deferred = d == Decision::Defer;
            match d {
                Decision::Run => {
                    self.out.planned.push((id, size.tokens + size.pending));
                    b.parts.push((i, b.items.len()..b.items.len() + work.len()));
                    b.items.extend(work);
                }
                Decision::Chunk(mut k) => {
                    self.out.chunks.push((id, k));
                    for w in &work {
                        let keep = usize::from(w.tokens.is_empty());
                        let take = store.pending(w.seq).saturating_sub(keep).min(k);
                        if take > 0 {
                            b.chunks.push((w.seq, take));
                            k -= take;
                        }
                    }
                }
                Decision::Defer => {}
            }
        }
        b
    }

    /// Runs the batch in one forward and hands every session its rows; true when the cache
    /// ran out (nothing changed then). When the batch fails for another reason each part runs
    /// alone, so only the request at fault fails.
    fn forward(
        &mut self,
        store: &mut dyn SeqStore,
        b: &Batch,
        sent: &mut u64,
        done: &mut Vec<(usize, Result<(), String>)>,
    ) -> bool {
        if b.items.is_empty() && b.chunks.is_empty() && b.embeds.is_empty() {
            return false;
        }
        self.stats.steps += 1;
        let texts: Vec<(StoreSeq, usize)> = b.embeds.iter().map(|&(_, s, k)| (s, k)).collect();
        let chunks: Vec<(StoreSeq, usize)> = b.chunks.iter().chain(&texts).copied().collect();
        let results: Vec<Result<Vec<Vec<f32>>, StoreError>> = match store.run_with_prefill(&b.items, &chunks) {
            Ok(mut rows) => b.parts.iter().map(|(_, r)| Ok(rows.drain(..r.len()).collect())).collect(),
            Err(StoreError::Engine(EngineError::OutOfBlocks(_))) => return true,
            Err(_) => {
                // Each part alone, so only the one at fault fails; the embedding texts too
                // (a backend without embeddings fails their jobs, nobody else).
                if !texts.is_empty() {
                    if let Err(e) = store.run_with_prefill(&[], &texts) {
                        for &(j, _, _) in &b.embeds {
                            self.embeds[j].failure.get_or_insert_with(|| format!("running the model: {e}"));
                        }
                    }
                }
                b.parts.iter().map(|(_, r)| store.run(&b.items[r.clone()])).collect()
            }
        };
        for ((i, range), rows) in b.parts.iter().zip(results) {
            let Running { req, session, resume, emitted, gone, diverged, prefilled, .. } = &mut self.running[*i];
            store.set_partition(partition(self.cfg.prefix_sharing, &req.sub.meta));
            *prefilled = true;
            let mut emit =
                Emit { req, resume: *resume, emitted, gone, diverged, sent: &mut *sent, ttft: &mut self.seen.ttft };
            let outcome = match rows {
                Ok(mut rows) => session
                    .observe(store, &b.items[range.clone()], &mut rows, &mut |c, t, lp, top| emit.token(c, t, lp, top))
                    .map_err(|e| e.to_string()),
                Err(e) => Err(format!("running the model: {e}")),
            };
            if let Err(e) = outcome {
                done.push((*i, Err(e)));
            }
        }
        false
    }

    /// Retires the requests in `done` (indices into `running`; the first outcome of each).
    fn retire_done(&mut self, store: &mut dyn SeqStore, mut done: Vec<(usize, Result<(), String>)>) {
        done.sort_by_key(|d| std::cmp::Reverse(d.0));
        done.dedup_by_key(|d| d.0);
        for (i, outcome) in done {
            let r = self.running.remove(i);
            match outcome {
                Ok(()) => {
                    let stats = r.session.stats().clone();
                    let choices = r.session.close(store);
                    let g = Generation {
                        choices: merged(&r.req, r.resume, choices),
                        stats,
                        cached_prompt_tokens: r.cached,
                    };
                    self.retire(r.req, None, Exit::Finished(g), store);
                }
                Err(msg) => self.retire(r.req, Some(r.session), Exit::Failed(msg), store),
            }
        }
    }

    /// The newest running request gives its blocks back and waits to be recomputed; alone, it
    /// can never fit and fails.
    fn preempt(&mut self, store: &mut dyn SeqStore) {
        let Some(r) = self.running.pop() else { return };
        if self.running.is_empty() {
            let why = "out of KV cache blocks: the request does not fit in the cache".to_string();
            self.retire(r.req, Some(r.session), Exit::Failed(why), store);
            return;
        }
        self.hold = true;
        self.stats.preempted += 1;
        self.out.preempted.push(r.req.sub.id);
        r.session.close(store);
        self.waiting.push_front(Waiting { req: r.req, resumed: true });
    }

    /// The one way out: the session (if any) closed, the request counted once and its client
    /// told once.
    fn retire(&mut self, mut req: Progress, session: Option<Session>, exit: Exit, store: &mut dyn SeqStore) {
        if let Some(s) = session {
            s.close(store);
        }
        store.release_images(&req.sub.images);
        self.hold = false;
        let id = req.sub.id;
        let strategy = req.sub.strategy.name().to_owned();
        let (outcome, event) = match exit {
            Exit::Finished(g) => {
                self.stats.finished += 1;
                let tokens = g.choices.iter().map(|c| c.tokens.len() as u64).sum();
                self.seen.outcomes.push(StrategyOutcome { strategy, ok: true, tokens });
                self.seen.latency.push(req.sub.meta.submitted.elapsed().as_secs_f64());
                (Outcome::Finished, Event::Finished(g))
            }
            Exit::Cancelled => {
                self.stats.cancelled += 1;
                (Outcome::Cancelled, Event::Failed("cancelled".into()))
            }
            Exit::Failed(msg) => {
                self.stats.failed += 1;
                let tokens = req.streamed.iter().map(|t| t.len() as u64).sum();
                self.seen.outcomes.push(StrategyOutcome { strategy, ok: false, tokens });
                (Outcome::Failed(msg.clone()), Event::Failed(msg))
            }
        };
        (req.sub.events)(event);
        self.out.retired.push((id, outcome));
    }
}

/// How a (re)admitted request relates to what its client was sent: one choice continues from
/// its streamed tokens; several are recomputed from the prompt.
fn resume_for(req: &Progress) -> Resume {
    if req.sub.n <= 1 {
        Resume::Continue { base: req.streamed.first().map_or(0, Vec::len) }
    } else {
        Resume::Replay
    }
}

/// A session's choices as the client saw them: a continued choice gets back the tokens it had
/// streamed before the session began.
fn merged(req: &Progress, resume: Resume, mut choices: Vec<Choice>) -> Vec<Choice> {
    if let (Resume::Continue { base }, Some(c), Some(s)) = (resume, choices.first_mut(), req.streamed.first()) {
        if base > 0 {
            let mut all = s[..base].to_vec();
            all.append(&mut c.tokens);
            c.tokens = all;
        }
    }
    choices
}
