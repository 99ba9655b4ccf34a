//! Where a forward pass's time goes: each pass cut into phases at fixed points (the matrix
//! products by role, attention, and the work between them on the calling thread), with the
//! caller's wait for the thread pool's workers and the bytes of weights each phase read, summed
//! over the passes timed. `inferd bench` reports it for batch-1 decode, next to the machine's
//! read bandwidth.
//!
//! Off by default ([`super::Backend::set_profiling`]); a pass then pays one branch per phase.

use crate::model::Tensor;
use inferd_kernels::pool::{PoolTime, ThreadPool};
use std::time::{Duration, Instant};

/// A stretch of the forward pass. A phase's time runs from the end of the previous one, so
/// the phases of a pass add up to the whole of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Everything between the dispatches below, on the calling thread: the embedding lookup,
    /// RMSNorm, quantizing the activations to 8 bits, QKV biases and norms, RoPE, the K/V
    /// writes, the gated activation, the residual adds.
    Between,
    /// The Q, K and V projections (one dispatch).
    QkvProjection,
    /// Paged attention over the KV cache.
    Attention,
    /// A DeltaNet layer's work between its products: the convolution, the L2 norms, the decay
    /// and write strength, the recurrence over the sequence's state.
    Recurrence,
    /// The attention output projection.
    OutputProjection,
    /// The feed-forward gate and up projections (one dispatch); of a mixture of experts, the
    /// router's.
    FfnGateUp,
    /// The feed-forward down projection; of a mixture of experts, the chosen experts' gate, up
    /// and down products (two dispatches) with the routing and their weighted sum, and the
    /// weights counted are the chosen experts' alone.
    FfnDown,
    /// The output projection of the rows that want logits.
    Logits,
}

impl Phase {
    pub const ALL: [Phase; 8] = [
        Phase::Between,
        Phase::QkvProjection,
        Phase::Attention,
        Phase::Recurrence,
        Phase::OutputProjection,
        Phase::FfnGateUp,
        Phase::FfnDown,
        Phase::Logits,
    ];

    /// The phase's name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Between => "between_dispatches",
            Phase::QkvProjection => "qkv_projection",
            Phase::Attention => "attention",
            Phase::Recurrence => "recurrence",
            Phase::OutputProjection => "attention_output_projection",
            Phase::FfnGateUp => "ffn_gate_up",
            Phase::FfnDown => "ffn_down",
            Phase::Logits => "logits",
        }
    }
}

/// One phase's share of the passes timed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PhaseTime {
    /// Wall time on the calling thread.
    pub time: Duration,
    /// The thread pool's dispatches in it: how many, the caller's own tasks, its wait for the
    /// workers.
    pub pool: PoolTime,
    /// Bytes of weight matrices the phase's products read (each once a pass, whatever the
    /// batch).
    pub weight_bytes: u64,
}

/// The phases of every forward pass since profiling started.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepProfile {
    /// Forward passes timed.
    pub passes: u64,
    /// Tokens they ran (a decode pass: one per sequence).
    pub tokens: u64,
    phases: [PhaseTime; Phase::ALL.len()],
}

impl StepProfile {
    pub fn phase(&self, p: Phase) -> &PhaseTime {
        &self.phases[p as usize]
    }

    /// The passes' whole time: the sum of the phases.
    pub fn time(&self) -> Duration {
        self.phases.iter().map(|p| p.time).sum()
    }

    /// The dispatches of all phases together.
    pub fn pool(&self) -> PoolTime {
        let mut all = PoolTime::default();
        for p in &self.phases {
            all += p.pool;
        }
        all
    }

    pub fn weight_bytes(&self) -> u64 {
        self.phases.iter().map(|p| p.weight_bytes).sum()
    }
}

/// The clock of one forward pass: [`Laps::lap`] at the end of each phase. Without a profile
/// it does nothing.
pub(crate) struct Laps<'a> {
    on: Option<(&'a mut StepProfile, Instant, PoolTime)>,
    pool: &'a ThreadPool,
}

impl<'a> Laps<'a> {
    /// Starts a pass of `tokens` tokens, counted into `profile` if there is one.
    pub(crate) fn start(profile: Option<&'a mut StepProfile>, pool: &'a ThreadPool, tokens: usize) -> Self {
        let on = profile.map(|p| {
            p.passes += 1;
            p.tokens += tokens as u64;
            (p, Instant::now(), pool.time())
        });
        Laps { on, pool }
    }

    /// Ends `phase`, whose products read `weights`: the time and dispatches since the last lap
    /// are its.
    pub(crate) fn lap(&mut self, phase: Phase, weights: &[&Tensor]) {
        self.lap_bytes(phase, weights.iter().map(|w| w.bytes().len() as u64).sum::<u64>());
    }

    /// [`Laps::lap`] for a phase that read `weight_bytes` of weights (some of a tensor's).
    pub(crate) fn lap_bytes(&mut self, phase: Phase, weight_bytes: u64) {
        if let Some((profile, last, pool_last)) = &mut self.on {
            let (now, pool_now) = (Instant::now(), self.pool.time());
            let p = &mut profile.phases[phase as usize];
            p.time += now - *last;
            p.pool += pool_now - *pool_last;
            p.weight_bytes += weight_bytes;
            (*last, *pool_last) = (now, pool_now);
        }
    }
}
