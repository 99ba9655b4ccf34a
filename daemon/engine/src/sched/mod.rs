//! The engine loop: the one thread that owns a model's engine, its KV cache and every request's
//! plugin session. Requests, cancellations and shutdown arrive as [`Command`]s over a channel;
//! each request's tokens leave as [`Event`]s through its own sink.
//!
//! The loop itself only moves messages: it takes the commands that arrived, asks the
//! [`Scheduler`] for one step, and reports to the [`Monitor`] (status, metrics, the watchdog's
//! heartbeat), turning at least once a second even when idle. What runs when is the
//! scheduler's (`scheduler.rs`, after vLLM's `Scheduler::schedule`): admission by KV blocks and
//! fairness (`queue.rs`), the token budget of a step (`budget.rs`), embeddings as prompt-like
//! work in the same steps (`embed.rs`), preemption with recompute, and one path by which every
//! request leaves. A request with images waits in the queue while its images encode on the
//! encoder's own thread ([`crate::vision::worker`]), the other requests stepping meanwhile.

pub mod handle;
pub mod monitor;

mod budget;
mod embed;
mod queue;
mod scheduler;
#[cfg(test)]
mod tests;

pub use handle::{EngineHandle, Launch, StartError, Stopped};
pub use scheduler::{Observations, Outcome, RequestState, Scheduler, StepOutput, StrategyOutcome};

use crate::decode::store::SeqStore;
use crate::decode::Generation;
use crate::plugin::LoadedStrategy;
use monitor::Monitor;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, TryRecvError};
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
    /// Each token's log-probability, with this many alternatives.
    pub logprobs: Option<u32>,
    /// The response format the output follows, compiled for this model.
    pub grammar: Option<crate::constraint::Grammar>,
    pub meta: RequestMeta,
    pub events: EventSink,
    /// The prompt's images, each at its first position (registered by the loop when the
    /// request arrives, released when it ends).
    pub images: Vec<crate::vision::media::PromptImage>,
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
    /// A token of a choice, with its log-probability when the request asked for them (NaN
    /// otherwise) and its most probable alternatives when it asked for those.
    Token {
        choice: u32,
        token: u32,
        logprob: f32,
        top: Vec<(u32, f32)>,
    },
    Finished(Generation),
    Failed(String),
}

/// Where an [`Embedding`]'s vectors go, in order; an error names the first text that failed
/// ("cancelled" when its client left).
pub type EmbedReply = Box<dyn FnOnce(Result<Vec<Vec<f32>>, String>) + Send>;

/// Texts to embed (token ids) and where their vectors go.
pub struct Embedding {
    /// For [`Command::Cancel`]; from the same numbering as submissions.
    pub id: RequestId,
    pub meta: RequestMeta,
    pub inputs: Vec<Vec<u32>>,
    pub reply: EmbedReply,
}

pub enum Command {
    Submit(Submission),
    /// Embeddings: work in the steps like a prompt's prefill, under the same token budget
    /// (`embed.rs`), cancelled like a request.
    Embed(Embedding),
    Cancel(RequestId),
    /// The client has what it wants (a stop string matched): end the request as finished.
    Stop(RequestId),
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
    /// Where the loop reports its state.
    pub monitor: Option<Arc<Monitor>>,
    /// The model's vocabulary, for the plugins' `token_bytes`.
    pub vocabulary: Option<Arc<crate::constraint::Vocabulary>>,
    /// After this long with nothing to do, the loop gives the memory of the free KV blocks
    /// back to the system ([`SeqStore::release_free`]; their cached prefixes are forgotten).
    pub kv_release_after: Option<Duration>,
    /// Whose cached prompt prefixes a request may reuse.
    pub prefix_sharing: PrefixSharing,
}

/// Whose cached prompt prefixes a request may reuse. Shared across users, one user could tell
/// from the time to first token that another recently sent the same prefix.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PrefixSharing {
    /// Every request's (one user's daemon; a system prompt an administrator publishes).
    #[default]
    Shared,
    /// Only those of requests by the same user.
    PerUser,
}

impl Default for LoopConfig {
    fn default() -> Self {
        LoopConfig {
            token_budget: 512,
            max_running: 64,
            eos: Vec::new(),
            monitor: None,
            vocabulary: None,
            kv_release_after: None,
            prefix_sharing: Default::default(),
        }
    }
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

/// How long a loop with nothing to run but requests whose images are being encoded waits for
/// the encoder before it looks at its commands again.
const ENCODE_POLL: Duration = Duration::from_millis(10);

/// Runs until [`Command::Shutdown`] or until every sender is gone and no work is left.
pub fn engine_loop(store: &mut dyn SeqStore, rx: &Receiver<Command>, cfg: &LoopConfig) -> LoopStats {
    let mut sched = Scheduler::new(cfg.clone());
    let monitor = cfg.monitor.as_deref();
    let mut disconnected = false;
    report(monitor, store, &mut sched, 0);
    // Since when the loop has had nothing to do, and whether the free KV blocks' memory went
    // back since.
    let (mut idle_since, mut released) = (std::time::Instant::now(), false);
    loop {
        if let Some(m) = monitor {
            m.beat();
        }
        // Commands: block (a second at a time, to keep the heartbeat) only when idle.
        let mut cmds = Vec::new();
        if sched.is_idle() {
            let wait = match cfg.kv_release_after {
                Some(after) if !released => after.saturating_sub(idle_since.elapsed()).min(Duration::from_secs(1)),
                _ => Duration::from_secs(1),
            };
            match rx.recv_timeout(wait) {
                Ok(c) => cmds.push(c),
                Err(RecvTimeoutError::Timeout) => {
                    if cfg.kv_release_after.is_some_and(|a| !released && idle_since.elapsed() >= a) {
                        store.release_free();
                        released = true;
                        report(monitor, store, &mut sched, 0);
                    }
                    continue;
                }
                Err(RecvTimeoutError::Disconnected) => return sched.stats().clone(),
            }
        }
        loop {
            match rx.try_recv() {
                Ok(c) => cmds.push(c),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    disconnected = true;
                    break;
                }
            }
        }
        let mut cmds = cmds.into_iter();
        while let Some(c) = cmds.next() {
            if let Command::Shutdown = c {
                // Everything not finished hears why: the queue, the running requests, and
                // submissions that came with or after the shutdown.
                let late: Vec<Command> = cmds.by_ref().chain(rx.try_iter()).collect();
                sched.shutdown(store, late);
                report(monitor, store, &mut sched, 0);
                return sched.stats().clone();
            }
            sched.handle(c, store);
        }
        let out = sched.step(store);
        report(monitor, store, &mut sched, out.emitted);
        if sched.stalled() {
            // Only images being encoded: wait for the encoder (new commands are taken at the
            // latest this much later).
            store.wait_images(ENCODE_POLL);
        }
        if !sched.is_idle() || out.emitted > 0 {
            (idle_since, released) = (std::time::Instant::now(), false);
        }
        if disconnected && sched.is_idle() {
            return sched.stats().clone();
        }
    }
}

/// The loop's state to the monitor.
fn report(monitor: Option<&Monitor>, store: &dyn SeqStore, sched: &mut Scheduler, emitted: u64) {
    let Some(m) = monitor else { return };
    let cache = store.cache_stats();
    let (running, waiting) = (sched.running(), sched.waiting());
    let stats = sched.stats().clone();
    let seen = sched.take_observations();
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
        for t in seen.ttft {
            s.ttft.observe(t);
        }
        for l in seen.latency {
            s.latency.observe(l);
        }
        for o in seen.outcomes {
            let c = s.strategies.entry(o.strategy).or_default();
            if o.ok {
                c.finished += 1;
            } else {
                c.failed += 1;
            }
            c.tokens += o.tokens;
        }
    });
}
