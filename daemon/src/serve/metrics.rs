//! `/metrics` in the Prometheus text format (version 0.0.4): request counts and latencies, TTFT,
//! tokens, KV blocks used and cached, queue depth, per-strategy counters, HTTP responses.

use super::Shared;
use inferd_engine::sched::monitor::{Histogram, BUCKETS};
use std::fmt::Write;
use std::sync::atomic::Ordering::Relaxed;

/// Label values are quoted; backslash, quote and newline are escaped.
fn label(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

struct Out(String);

impl Out {
    fn head(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.0, "# HELP {name} {help}\n# TYPE {name} {kind}");
    }

    fn sample(&mut self, name: &str, labels: &str, v: impl std::fmt::Display) {
        let _ = writeln!(self.0, "{name}{{{labels}}} {v}");
    }

    fn histogram(&mut self, name: &str, labels: &str, h: &Histogram) {
        let mut cum = 0;
        for (i, b) in BUCKETS.iter().enumerate() {
            cum += h.counts[i];
            self.sample(&format!("{name}_bucket"), &format!("{labels},le=\"{b}\""), cum);
        }
        self.sample(&format!("{name}_bucket"), &format!("{labels},le=\"+Inf\""), h.count);
        self.sample(&format!("{name}_sum"), labels, h.sum);
        self.sample(&format!("{name}_count"), labels, h.count);
    }
}

pub fn prometheus(sh: &Shared) -> String {
    let mut o = Out(String::new());
    let snaps: Vec<(String, inferd_engine::sched::monitor::Snapshot)> =
        sh.models.loaded().iter().map(|m| (format!("model=\"{}\"", label(&m.name)), m.monitor.snapshot())).collect();
    type Field = fn(&inferd_engine::sched::monitor::Snapshot) -> f64;
    let gauges: [(&str, &str, &str, Field); 8] = [
        ("inferd_requests_running", "gauge", "Requests decoding now.", |s| s.running as f64),
        ("inferd_requests_waiting", "gauge", "Requests waiting for admission (queue depth).", |s| s.waiting as f64),
        ("inferd_kv_blocks_total", "gauge", "KV cache blocks.", |s| s.kv.total as f64),
        ("inferd_kv_blocks_used", "gauge", "KV cache blocks held by sequences or waiting in the prefix cache.", |s| {
            (s.kv.total - s.kv.free) as f64
        }),
        ("inferd_kv_blocks_cached", "gauge", "KV cache blocks registered in the prefix cache.", |s| s.kv.cached as f64),
        ("inferd_tokens_per_second", "gauge", "Generated tokens per second over the last few seconds.", |s| {
            s.tokens_per_second
        }),
        ("inferd_engine_steps_total", "counter", "Forward passes run.", |s| s.steps as f64),
        (
            "inferd_requests_preempted_total",
            "counter",
            "Requests preempted for lack of KV blocks (recomputed later).",
            |s| s.preempted as f64,
        ),
    ];
    for (name, kind, help, f) in gauges {
        o.head(name, kind, help);
        for (l, s) in &snaps {
            o.sample(name, l, f(s));
        }
    }
    o.head("inferd_device_memory_bytes", "gauge", "GPU memory a model holds, by use (weights, kv).");
    for m in sh.models.loaded() {
        if let Some(d) = m.engine.device_memory() {
            let l = format!("model=\"{}\"", label(&m.name));
            o.sample("inferd_device_memory_bytes", &format!("{l},use=\"weights\""), d.weights_bytes);
            o.sample("inferd_device_memory_bytes", &format!("{l},use=\"kv\""), d.kv_bytes);
        }
    }
    o.head("inferd_requests_total", "counter", "Requests that ended, by outcome.");
    for (l, s) in &snaps {
        for (outcome, v) in [("finished", s.finished), ("failed", s.failed), ("cancelled", s.cancelled)] {
            o.sample("inferd_requests_total", &format!("{l},outcome=\"{outcome}\""), v);
        }
    }
    let tokens: [(&str, &str, Field); 3] = [
        ("inferd_generated_tokens_total", "Tokens generated and streamed.", |s| s.generated_tokens as f64),
        ("inferd_prompt_tokens_total", "Prompt tokens admitted.", |s| s.prompt_tokens as f64),
        ("inferd_prompt_tokens_cached_total", "Prompt tokens served from the prefix cache.", |s| {
            s.cached_prompt_tokens as f64
        }),
    ];
    for (name, help, f) in tokens {
        o.head(name, "counter", help);
        for (l, s) in &snaps {
            o.sample(name, l, f(s));
        }
    }
    o.head("inferd_time_to_first_token_seconds", "histogram", "From accepting a request to its first token.");
    for (l, s) in &snaps {
        o.histogram("inferd_time_to_first_token_seconds", l, &s.ttft);
    }
    o.head(
        "inferd_request_duration_seconds",
        "histogram",
        "From accepting a request to its last token (finished requests).",
    );
    for (l, s) in &snaps {
        o.histogram("inferd_request_duration_seconds", l, &s.latency);
    }
    o.head("inferd_strategy_requests_total", "counter", "Requests per decoding strategy, by outcome.");
    for (l, s) in &snaps {
        for (name, c) in &s.strategies {
            for (outcome, v) in [("finished", c.finished), ("failed", c.failed)] {
                o.sample(
                    "inferd_strategy_requests_total",
                    &format!("{l},strategy=\"{}\",outcome=\"{outcome}\"", label(name)),
                    v,
                );
            }
        }
    }
    o.head("inferd_strategy_tokens_total", "counter", "Tokens generated per decoding strategy.");
    for (l, s) in &snaps {
        for (name, c) in &s.strategies {
            o.sample("inferd_strategy_tokens_total", &format!("{l},strategy=\"{}\"", label(name)), c.tokens);
        }
    }
    o.head("inferd_http_responses_total", "counter", "HTTP responses by route and status.");
    for ((route, status), v) in sh.http.snapshot() {
        o.sample("inferd_http_responses_total", &format!("route=\"{}\",status=\"{status}\"", label(&route)), v);
    }
    let remotes = sh.remotes.read().map(|r| r.clone()).unwrap_or_default();
    o.head("inferd_upstream_requests_total", "counter", "Requests forwarded to a remote model's upstream.");
    for r in &remotes {
        o.sample("inferd_upstream_requests_total", &format!("model=\"{}\"", label(&r.name)), r.requests.load(Relaxed));
    }
    o.head(
        "inferd_upstream_errors_total",
        "counter",
        "Forwarded requests that failed (refused, unreachable, upstream errors).",
    );
    for r in &remotes {
        o.sample("inferd_upstream_errors_total", &format!("model=\"{}\"", label(&r.name)), r.errors.load(Relaxed));
    }
    o.head("inferd_upstream_fallbacks_total", "counter", "Requests a remote model's fallback answered.");
    for r in &remotes {
        o.sample(
            "inferd_upstream_fallbacks_total",
            &format!("model=\"{}\"", label(&r.name)),
            r.fallbacks.load(Relaxed),
        );
    }
    o.head("inferd_upstream_response_seconds", "summary", "Time to the upstream's response headers.");
    for r in &remotes {
        let l = format!("model=\"{}\"", label(&r.name));
        o.sample("inferd_upstream_response_seconds_sum", &l, r.latency_us.load(Relaxed) as f64 / 1e6);
        o.sample("inferd_upstream_response_seconds_count", &l, r.answered.load(Relaxed));
    }
    o.head("inferd_uptime_seconds", "gauge", "Seconds since the daemon started.");
    let _ = writeln!(o.0, "inferd_uptime_seconds {}", sh.started.elapsed().as_secs_f64());
    o.0
}
