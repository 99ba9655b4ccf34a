//! The waiting queue's policy: which request is admitted next.
//!
//! A preempted request goes back first (it already had its turn and its client is mid-stream).
//! Otherwise the best priority class waiting (interactive before background); within it, the
//! user (peer uid) with the fewest running requests, ties to the user admitted least recently,
//! then that user's oldest request: users take turns, and one user's batch job cannot starve
//! another's chat. A request whose prompt shares [`SHARED_PREFILL`] tokens or more with one
//! still being prefilled is not eligible until that prefill ends: then it finds the shared
//! part in the prefix cache instead of computing it again. A request whose images are still
//! being encoded is not eligible either (the others run meanwhile).

use super::RequestMeta;
use std::collections::HashMap;

/// The shortest shared prompt prefix worth waiting for instead of computing it again.
pub(super) const SHARED_PREFILL: usize = 128;

/// What the policy needs to know of a waiting request.
pub(super) struct Candidate<'a> {
    pub meta: RequestMeta,
    pub prompt: &'a [u32],
    /// It was preempted and waits to be recomputed.
    pub resumed: bool,
    /// Its images are encoded (or it has none): it may run.
    pub ready: bool,
}

/// Admission turns per user.
#[derive(Debug, Default)]
pub(super) struct Turns {
    last_admitted: HashMap<u32, u64>,
    admissions: u64,
}

impl Turns {
    pub fn admitted(&mut self, uid: u32) {
        self.admissions += 1;
        self.last_admitted.insert(uid, self.admissions);
    }

    /// The index in `waiting` of the request to admit next, if any is eligible. `running`
    /// holds the uids of the running requests; `prefilling` the prompts still being prefilled.
    pub fn next(&self, waiting: &[Candidate<'_>], running: &[u32], prefilling: &[&[u32]]) -> Option<usize> {
        let eligible =
            |c: &Candidate<'_>| c.ready && !prefilling.iter().any(|p| shared_prefix(p, c.prompt) >= SHARED_PREFILL);
        if let Some(i) = waiting.iter().position(|c| c.resumed && c.ready) {
            return Some(i);
        }
        let class = waiting.iter().filter(|c| eligible(c)).map(|c| c.meta.priority).min()?;
        let mut load: HashMap<u32, usize> = HashMap::new();
        for &uid in running {
            *load.entry(uid).or_default() += 1;
        }
        // `min_by_key` keeps the first of equals, so the oldest of a user wins.
        waiting
            .iter()
            .enumerate()
            .filter(|(_, c)| c.meta.priority == class && eligible(c))
            .min_by_key(|(_, c)| {
                let uid = c.meta.uid;
                (load.get(&uid).copied().unwrap_or(0), self.last_admitted.get(&uid).copied().unwrap_or(0))
            })
            .map(|(i, _)| i)
    }
}

/// How many leading tokens `a` and `b` share.
pub(super) fn shared_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}
