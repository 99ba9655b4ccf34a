//! A step's token budget: which plans run whole, which prompts get a chunk, which plans wait.
//!
//! Chunked prefill after Sarathi-Serve (Agrawal et al., 2024) and vLLM's budget: decode work
//! goes first (each plan whole, oldest first, a plan that waited once runs whatever its
//! size); prompts share what is left, shortest remaining first, so a short prompt arriving
//! behind a long one is prefilled in the next step, not after it. A prompt that does not fit
//! whole runs in chunks, and while anyone decodes the chunks take at most a quarter of the
//! budget ([`chunk_cap`]), so a long prompt never makes a decode step long; the oldest prompt
//! always advances by at least [`MIN_CHUNK`] tokens, so no prompt starves. A pure function over
//! plan sizes, tested on its own.

/// The smallest prompt chunk the oldest prompt runs, even when the step's budget is spent.
pub(super) const MIN_CHUNK: usize = 16;

/// One running request's plan, as the budget sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct PlanSize {
    /// Tokens the plan itself appends (at least one per item: a logits row costs a position).
    pub tokens: usize,
    /// Prompt tokens appended earlier and not run yet (zero once the prompt has run).
    pub pending: usize,
    /// Of those, how many may run as a chunk without the plan (one stays with a plan that
    /// brings no tokens of its own, so its logits come from the prompt's last position).
    pub chunkable: usize,
    /// It waited for room last step: it runs now, whatever its size.
    pub deferred: bool,
}

/// What a step does with a plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Decision {
    /// The plan runs whole (with its pending prompt).
    Run,
    /// This many pending prompt tokens run; the plan is asked again next step.
    Chunk(usize),
    /// Nothing runs for it this step; it goes first next step.
    Defer,
}

/// The most prompt tokens a step gives to chunks of prompts too long to run whole, when
/// `decoding`: a quarter of the budget, so a long prompt never makes a decode step long.
pub(super) fn chunk_cap(budget: usize, decoding: bool) -> usize {
    if decoding {
        (budget / 4).max(MIN_CHUNK)
    } else {
        budget
    }
}

/// Decides every plan of a step; `plans` are in admission order (oldest first).
pub(super) fn decide(plans: &[PlanSize], budget: usize) -> Vec<Decision> {
    let mut out = vec![Decision::Defer; plans.len()];
    let mut left = budget;
    let mut any = false;
    // Decode work first: deferred plans, then the others oldest first.
    let mut decode: Vec<usize> = (0..plans.len()).filter(|&i| plans[i].pending == 0).collect();
    decode.sort_by_key(|&i| !plans[i].deferred);
    for i in decode {
        let p = plans[i];
        if p.tokens <= left || p.deferred || !any {
            out[i] = Decision::Run;
            left = left.saturating_sub(p.tokens);
            any = true;
        }
    }
    // Prompts, shortest remaining first (ties: oldest): whole while they fit in what is left,
    // in chunks of at most `chunk_cap` tokens in all when they do not.
    let mut room = chunk_cap(budget, any);
    let mut prompts: Vec<usize> = (0..plans.len()).filter(|&i| plans[i].pending > 0).collect();
    let oldest = prompts.first().copied();
    prompts.sort_by_key(|&i| (plans[i].pending + plans[i].tokens, i));
    for i in prompts {
        let p = plans[i];
        let whole = p.pending + p.tokens;
        if whole <= left || (p.deferred && p.chunkable == 0) {
            out[i] = Decision::Run;
            left = left.saturating_sub(whole);
            continue;
        }
        let floor = if Some(i) == oldest { MIN_CHUNK } else { 0 };
        let k = p.chunkable.min(left.min(room).max(floor));
        if k > 0 {
            out[i] = Decision::Chunk(k);
            left = left.saturating_sub(k);
            room = room.saturating_sub(k);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use Decision::{Chunk, Defer, Run};

    fn decode(tokens: usize) -> PlanSize {
        PlanSize { tokens, pending: 0, chunkable: 0, deferred: false }
    }

    fn prompt(pending: usize) -> PlanSize {
        PlanSize { tokens: 1, pending, chunkable: pending, deferred: false }
    }

    #[test]
    fn budget_scenarios() {
        // (plans, budget, decisions)
        let table: Vec<(Vec<PlanSize>, usize, Vec<Decision>)> = vec![
            // Decode tokens of everyone fit.
            (vec![decode(1), decode(1), decode(1)], 8, vec![Run, Run, Run]),
            // A speculative plan larger than what is left waits one step; the first always runs.
            (vec![decode(6), decode(6)], 8, vec![Run, Defer]),
            (vec![decode(20)], 8, vec![Run]),
            // ...and once deferred it runs whatever its size.
            (vec![decode(6), PlanSize { deferred: true, ..decode(6) }], 8, vec![Defer, Run]),
            // A prompt alone takes the whole budget in chunks.
            (vec![prompt(8000)], 512, vec![Chunk(512)]),
            // While another request decodes, a long prompt takes at most a quarter of it.
            (vec![decode(1), prompt(8000)], 512, vec![Run, Chunk(128)]),
            // A short prompt behind a long one goes first, whole, in the same step.
            (vec![decode(1), prompt(8000), prompt(8)], 512, vec![Run, Chunk(128), Run]),
            // Several short prompts arriving at once all run whole, decoding or not.
            (vec![decode(1), prompt(100), prompt(100), prompt(100)], 512, vec![Run, Run, Run, Run]),
            (vec![prompt(8000), prompt(8)], 512, vec![Chunk(503), Run]),
            // The oldest prompt advances even when decode work spent the budget.
            (vec![decode(64), prompt(100)], 64, vec![Run, Chunk(MIN_CHUNK)]),
            // A prompt whose plan brings no tokens keeps its last token for the plan.
            (vec![PlanSize { tokens: 1, pending: 40, chunkable: 39, deferred: false }], 16, vec![Chunk(16)]),
            // Nothing left to chunk: it waits, then runs whole once deferred.
            (vec![decode(16), PlanSize { tokens: 1, pending: 1, chunkable: 0, deferred: false }], 16, vec![Run, Defer]),
            (vec![decode(16), PlanSize { tokens: 1, pending: 1, chunkable: 0, deferred: true }], 16, vec![Run, Run]),
        ];
        for (plans, budget, want) in table {
            assert_eq!(decide(&plans, budget), want, "{plans:?} under {budget}");
        }
    }

    #[test]
    fn prompt_tokens_never_exceed_the_budget_but_always_progress() {
        for budget in [16, 64, 512] {
            for n in 1..6 {
                let plans: Vec<PlanSize> = (0..n).map(|i| prompt(1000 * (i + 1))).collect();
                let d = decide(&plans, budget);
                let run: usize = d.iter().map(|d| if let Chunk(k) = d { *k } else { 0 }).sum();
                assert!(run <= budget.max(MIN_CHUNK), "{run} prompt tokens under {budget}");
                assert!(matches!(d[0], Chunk(k) if k >= MIN_CHUNK.min(budget)), "{d:?}");
            }
        }
    }
}
