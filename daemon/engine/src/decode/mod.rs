//! Decoding through strategy plugins: a request's session is asked what to run, the store runs
//! it, and the session observes the logits, until it is done.
//!
//! [`generate`] drives one request by itself (`inferd run`, `inferd plugin probe`, tests); the
//! scheduler (`sched`) drives many, merging every session's plan into
//! one batch per step.

pub mod mock;
pub mod store;

use crate::plugin::{Choice, LoadedStrategy, PluginError, Session, SessionRequest};
use std::collections::BTreeMap;
use std::sync::Arc;
use store::SeqStore;

#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error(transparent)]
    Plugin(#[from] PluginError),
    #[error("running the model: {0}")]
    Store(#[from] store::StoreError),
    #[error("{strategy} did not finish within {rounds} rounds")]
    Runaway { strategy: String, rounds: usize },
}

/// A finished request: its choices and the statistics its strategy reported.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Generation {
    pub choices: Vec<Choice>,
    pub stats: BTreeMap<String, f64>,
    /// Tokens of its prompt whose K/V came from the prefix cache (the engine loop counts them
    /// when it starts the request; of a request that was preempted, at its last start).
    pub cached_prompt_tokens: usize,
}

/// [`generate_with_stats`] for the choices alone.
pub fn generate(
    strategy: &Arc<LoadedStrategy>,
    store: &mut dyn SeqStore,
    req: &SessionRequest<'_>,
    on_token: &mut dyn FnMut(u32, u32),
) -> Result<Vec<Choice>, DecodeError> {
    generate_with_stats(strategy, store, req, on_token).map(|g| g.choices)
}

/// Runs one request to completion. `on_token(choice, token)` sees tokens as they are emitted.
/// Every sequence of the request is freed before this returns, whatever happens.
pub fn generate_with_stats(
    strategy: &Arc<LoadedStrategy>,
    store: &mut dyn SeqStore,
    req: &SessionRequest<'_>,
    on_token: &mut dyn FnMut(u32, u32),
) -> Result<Generation, DecodeError> {
    let on_token = &mut |c: u32, t: u32, _logprob: f32, _top: &[(u32, f32)]| on_token(c, t);
    let mut session = Session::create(Arc::clone(strategy), store, req, on_token)?;
    // Each round must make progress; a strategy gets generous room (speculative rounds, beams).
    let limit = 64 + 16 * (req.max_tokens as usize + 1) * (req.n as usize).max(1);
    let mut rounds = 0;
    let result = loop {
        let work = match session.plan(store, on_token) {
            Ok(Some(w)) => w,
            Ok(None) => break Ok(()),
            Err(e) => break Err(e.into()),
        };
        let mut rows = match store.run(&work) {
            Ok(r) => r,
            Err(e) => break Err(DecodeError::Store(e)),
        };
        if let Err(e) = session.observe(store, &work, &mut rows, on_token) {
            break Err(e.into());
        }
        rounds += 1;
        if rounds > limit {
            strategy.failed();
            break Err(DecodeError::Runaway { strategy: strategy.name().to_owned(), rounds });
        }
    };
    let stats = session.stats().clone();
    let choices = session.close(store);
    result.map(|()| Generation { choices, stats, cached_prompt_tokens: 0 })
}
