//! What an engine loop tells the rest of the daemon about itself: a [`Monitor`] per model that
//! the loop writes once per step (KV blocks, queue depth, counters, TTFT and latency
//! histograms, per-strategy counters, a heartbeat) and that `/v1/status`, `/metrics`, D-Bus'
//! `Status` property and the systemd watchdog read. The loop never waits on a reader: the lock
//! is held only to copy numbers.

use crate::kv::KvStats;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Upper bounds (seconds) of the latency histogram buckets.
pub const BUCKETS: [f64; 14] = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0];

/// A Prometheus-style histogram: cumulative counts are computed when rendered.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Histogram {
    /// Observations per bucket of [`BUCKETS`], plus one past the last bound.
    pub counts: [u64; BUCKETS.len() + 1],
    pub sum: f64,
    pub count: u64,
}

impl Histogram {
    pub fn observe(&mut self, seconds: f64) {
        let i = BUCKETS.iter().position(|&b| seconds <= b).unwrap_or(BUCKETS.len());
        self.counts[i] += 1;
        self.sum += seconds;
        self.count += 1;
    }
}

/// Requests and tokens of one decoding strategy.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StrategyCounters {
    pub finished: u64,
    pub failed: u64,
    pub tokens: u64,
}

/// One copy of an engine's state.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Snapshot {
    pub kv: KvStats,
    pub running: usize,
    pub waiting: usize,
    pub steps: u64,
    pub finished: u64,
    pub failed: u64,
    pub cancelled: u64,
    pub preempted: u64,
    /// Tokens streamed to clients.
    pub generated_tokens: u64,
    pub prompt_tokens: u64,
    /// Prompt tokens found in the prefix cache instead of being computed.
    pub cached_prompt_tokens: u64,
    /// Generated tokens per second over the last few seconds.
    pub tokens_per_second: f64,
    pub ttft: Histogram,
    pub latency: Histogram,
    pub strategies: BTreeMap<String, StrategyCounters>,
}

#[derive(Debug)]
pub struct Monitor {
    pub model: String,
    started: Instant,
    /// Milliseconds after `started` of the loop's last turn.
    heartbeat: AtomicU64,
    state: Mutex<Snapshot>,
    window: Mutex<(Instant, u64)>,
}

/// The window over which [`Snapshot::tokens_per_second`] is measured.
const RATE_WINDOW: Duration = Duration::from_secs(5);

impl Monitor {
    pub fn new(model: impl Into<String>) -> Monitor {
        let now = Instant::now();
        Monitor {
            model: model.into(),
            started: now,
            heartbeat: AtomicU64::new(0),
            state: Mutex::new(Snapshot::default()),
            window: Mutex::new((now, 0)),
        }
    }

    /// The loop is alive (called every turn, idle or not).
    pub fn beat(&self) {
        self.heartbeat.store(self.started.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    /// Time since the loop's last turn.
    pub fn since_beat(&self) -> Duration {
        let last = Duration::from_millis(self.heartbeat.load(Ordering::Relaxed));
        self.started.elapsed().saturating_sub(last)
    }

    pub fn uptime(&self) -> Duration {
        self.started.elapsed()
    }

    /// Changes the state under the lock (the loop's writes).
    pub fn update(&self, f: impl FnOnce(&mut Snapshot)) {
        if let Ok(mut s) = self.state.lock() {
            f(&mut s);
            if let Ok(mut w) = self.window.lock() {
                let dt = w.0.elapsed();
                if dt >= RATE_WINDOW {
                    s.tokens_per_second = (s.generated_tokens - w.1) as f64 / dt.as_secs_f64();
                    *w = (Instant::now(), s.generated_tokens);
                }
            }
        }
    }

    pub fn snapshot(&self) -> Snapshot {
        self.state.lock().map(|s| s.clone()).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_hold_their_bounds() {
        let mut h = Histogram::default();
        for s in [0.001, 0.005, 0.0051, 200.0] {
            h.observe(s);
        }
        assert_eq!(h.counts[0], 2, "<= 5 ms, the bound included");
        assert_eq!(h.counts[1], 1);
        assert_eq!(h.counts[BUCKETS.len()], 1, "past the last bound");
        assert_eq!(h.count, 4);
        assert!((h.sum - 200.0111).abs() < 1e-9);
    }

    #[test]
    fn the_heartbeat_ages() {
        let m = Monitor::new("m");
        m.beat();
        assert!(m.since_beat() < Duration::from_secs(1));
        std::thread::sleep(Duration::from_millis(30));
        assert!(m.since_beat() >= Duration::from_millis(20));
        m.beat();
        assert!(m.since_beat() < Duration::from_millis(20));
    }
}
