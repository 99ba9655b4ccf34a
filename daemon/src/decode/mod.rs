//! Decoding through strategy plugins: a request's session is asked what to run, the store runs
//! it, and the session observes the logits, until it is done.
//!
//! [`generate`] drives one request by itself (`inferd run`, `inferd plugin probe`, tests);
//! [`generate_batch`] drives several at once, merging every session's plan into one batch per
//! round, as the daemon's scheduler does each engine step.

pub mod bench;
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
}

/// [`generate_with_stats`] for the choices alone.
pub fn generate(strategy: &Arc<LoadedStrategy>, store: &mut dyn SeqStore, req: &SessionRequest<'_>, on_token: &mut dyn FnMut(u32, u32)) -> Result<Vec<Choice>, DecodeError> {
    generate_with_stats(strategy, store, req, on_token).map(|g| g.choices)
}

/// Runs one request to completion. `on_token(choice, token)` sees tokens as they are emitted.
/// Every sequence of the request is freed before this returns, whatever happens.
pub fn generate_with_stats(strategy: &Arc<LoadedStrategy>, store: &mut dyn SeqStore, req: &SessionRequest<'_>, on_token: &mut dyn FnMut(u32, u32)) -> Result<Generation, DecodeError> {
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
        let rows = match store.run(&work) {
            Ok(r) => r,
            Err(e) => break Err(DecodeError::Store(e)),
        };
        if let Err(e) = session.observe(store, &work, &rows, on_token) {
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
    result.map(|()| Generation { choices, stats })
}

/// One request of a [`generate_batch`].
#[derive(Clone, Debug)]
pub struct BatchRequest<'a> {
    pub strategy: Arc<LoadedStrategy>,
    pub req: SessionRequest<'a>,
}

/// Runs several requests together: each round every live session plans, all plans run as one
/// batch (one [`SeqStore::run`]), and each session observes its own rows. A request that fails
/// is closed (its sequences freed) and the others go on; when the batch itself fails, each
/// session's part is retried alone so only the request at fault fails. `on_token(request,
/// choice, token)` sees tokens as they are emitted. Results come in request order.
pub fn generate_batch(store: &mut dyn SeqStore, reqs: &[BatchRequest<'_>], on_token: &mut dyn FnMut(usize, u32, u32)) -> Vec<Result<Generation, DecodeError>> {
    let mut results: Vec<Option<Result<Generation, DecodeError>>> = (0..reqs.len()).map(|_| None).collect();
    let mut live: Vec<(usize, Session, usize)> = Vec::new(); // (request, session, rounds)
    for (i, r) in reqs.iter().enumerate() {
        match Session::create(Arc::clone(&r.strategy), store, &r.req, &mut |c, t| on_token(i, c, t)) {
            Ok(s) => live.push((i, s, 0)),
            Err(e) => results[i] = Some(Err(e.into())),
        }
    }
    let finish = |store: &mut dyn SeqStore, s: Session, outcome: Result<(), DecodeError>| {
        let stats = s.stats().clone();
        let choices = s.close(store);
        outcome.map(|()| Generation { choices, stats })
    };
    while !live.is_empty() {
        // Plans.
        let mut planned: Vec<(usize, Session, usize, crate::plugin::session::Work)> = Vec::new();
        for (i, mut s, rounds) in std::mem::take(&mut live) {
            match s.plan(store, &mut |c, t| on_token(i, c, t)) {
                Ok(Some(w)) => planned.push((i, s, rounds, w)),
                Ok(None) => results[i] = Some(finish(store, s, Ok(()))),
                Err(e) => results[i] = Some(finish(store, s, Err(e.into()))),
            }
        }
        if planned.is_empty() {
            break;
        }
        // One batch for everyone; on failure, each part alone.
        let all: Vec<store::StoreRun> = planned.iter().flat_map(|p| p.3.iter().cloned()).collect();
        let rows: Vec<Result<Vec<Vec<f32>>, store::StoreError>> = match store.run(&all) {
            Ok(mut rows) => planned.iter().map(|p| Ok(rows.drain(..p.3.len()).collect())).collect(),
            Err(_) => planned.iter().map(|p| store.run(&p.3)).collect(),
        };
        for ((i, mut s, rounds, work), rows) in planned.into_iter().zip(rows) {
            let r = &reqs[i].req;
            let limit = 64 + 16 * (r.max_tokens as usize + 1) * (r.n as usize).max(1);
            let outcome = match rows {
                Err(e) => Err(DecodeError::Store(e)),
                Ok(rows) => match s.observe(store, &work, &rows, &mut |c, t| on_token(i, c, t)) {
                    Err(e) => Err(e.into()),
                    Ok(()) if rounds + 1 > limit => {
                        reqs[i].strategy.failed();
                        Err(DecodeError::Runaway { strategy: reqs[i].strategy.name().to_owned(), rounds: rounds + 1 })
                    }
                    Ok(()) => {
                        live.push((i, s, rounds + 1));
                        continue;
                    }
                },
            };
            results[i] = Some(finish(store, s, outcome));
        }
    }
    results.into_iter().map(|r| r.unwrap_or_else(|| Err(DecodeError::Runaway { strategy: "unknown".into(), rounds: 0 }))).collect()
}
