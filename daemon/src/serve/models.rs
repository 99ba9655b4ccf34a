//! The models a daemon serves, each in memory only while it is used. A configured model loads
//! at start; one that no request has held for its `keep_alive` is unloaded (its engine thread
//! ends, its weights are unmapped, its KV pool freed), and the next request that names it
//! loads it again: one load at a time per model, requests arriving meanwhile wait for that
//! load. `keep_alive` comes from the config (`server.keep_alive`, a model's own) and from
//! requests (Ollama's field: a duration, `0` to unload once idle, `-1` to keep it).

use super::config::ModelConfig;
use super::request::ApiError;
use super::ModelHandle;
use inferd_engine::sched::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The shortest idle time before an unload: a request between its model's load and its
/// submission is never caught in between (the reaper needs two looks a second apart).
const MIN_IDLE: Duration = Duration::from_secs(1);

/// What loading a model needs beyond its entry: the daemon's threads and scheduler settings.
#[derive(Clone, Debug)]
pub struct LoadOptions {
    pub threads: usize,
    pub token_budget: usize,
    pub max_running: usize,
}

/// One model the daemon can serve, loaded or not.
pub struct Slot {
    /// The name requests use.
    pub name: String,
    pub config: ModelConfig,
    handle: Mutex<Option<Arc<ModelHandle>>>,
    /// Held while loading: one load at a time.
    loading: tokio::sync::Mutex<()>,
    /// How long the model stays loaded once idle; `None`: as long as the daemon runs.
    keep_alive: Mutex<Option<Duration>>,
    /// Its `keep_alive` from the config, which a request without one goes back to.
    configured: Option<Duration>,
    /// Since when no request has held the model, as the reaper saw it.
    idle_since: Mutex<Option<Instant>>,
    /// Loads so far (the start's included).
    pub loads: AtomicU64,
}

impl Slot {
    /// The loaded model, if it is.
    pub fn loaded(&self) -> Option<Arc<ModelHandle>> {
        self.handle.lock().ok().and_then(|h| h.clone())
    }

    pub fn keep_alive(&self) -> Option<Duration> {
        self.keep_alive.lock().ok().and_then(|k| *k)
    }

    /// A request's `keep_alive` for this model (the configured one when the request has none),
    /// from now on.
    pub fn set_keep_alive(&self, k: Option<Option<Duration>>) {
        let k = k.unwrap_or(self.configured);
        if let Ok(mut g) = self.keep_alive.lock() {
            *g = k;
        }
    }

    /// When an idle model will be unloaded, if it is idle now.
    pub fn expires(&self) -> Option<Instant> {
        let since = self.idle_since.lock().ok().and_then(|s| *s)?;
        self.keep_alive().map(|k| since + k.max(MIN_IDLE))
    }

    fn touch(&self) {
        if let Ok(mut s) = self.idle_since.lock() {
            *s = None;
        }
    }
}

/// Every model the daemon knows.
pub struct Models {
    pub slots: Vec<Arc<Slot>>,
    opts: LoadOptions,
}

impl std::fmt::Debug for Models {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Models").field("names", &self.slots.iter().map(|s| &s.name).collect::<Vec<_>>()).finish()
    }
}

impl Models {
    /// The configured models, loaded now (so a model that cannot run stops the start).
    pub fn start(
        configs: Vec<ModelConfig>,
        opts: LoadOptions,
        default_keep_alive: Option<Duration>,
    ) -> anyhow::Result<Models> {
        let mut slots: Vec<Arc<Slot>> = Vec::new();
        for mc in configs {
            let handle = super::load(&mc, &opts)?;
            if slots.iter().any(|s| s.name == handle.name) {
                anyhow::bail!("two models are named {:?}: give one a `name` in the config", handle.name);
            }
            let keep_alive = match mc.keep_alive.as_deref() {
                Some(k) => parse_keep_alive(k).map_err(|e| anyhow::anyhow!("{}: keep_alive: {e}", handle.name))?,
                None => default_keep_alive,
            };
            slots.push(Arc::new(Slot {
                name: handle.name.clone(),
                config: mc,
                handle: Mutex::new(Some(Arc::new(handle))),
                loading: tokio::sync::Mutex::new(()),
                keep_alive: Mutex::new(keep_alive),
                configured: keep_alive,
                idle_since: Mutex::new(None),
                loads: AtomicU64::new(1),
            }));
        }
        Ok(Models { slots, opts })
    }

    /// The models in memory now.
    pub fn loaded(&self) -> Vec<Arc<ModelHandle>> {
        self.slots.iter().filter_map(|s| s.loaded()).collect()
    }

    /// The slot of model `name` (the first one when none is named).
    pub fn slot(&self, name: Option<&str>) -> Result<&Arc<Slot>, ApiError> {
        match name {
            None | Some("") => self.slots.first().ok_or_else(|| ApiError::new(503, "no model is configured", None)),
            Some(n) => self.slots.iter().find(|s| s.name == n).ok_or_else(|| {
                let names: Vec<&str> = self.slots.iter().map(|s| s.name.as_str()).collect();
                ApiError::new(404, format!("unknown model {n:?} (known: {})", names.join(", ")), Some("model"))
            }),
        }
    }

    /// Model `name`, loaded first if it is not (waiting for a load already under way).
    pub async fn acquire(&self, name: Option<&str>) -> Result<Arc<ModelHandle>, ApiError> {
        let slot = self.slot(name)?;
        slot.touch();
        if let Some(h) = slot.loaded() {
            return Ok(h);
        }
        let _one = slot.loading.lock().await;
        if let Some(h) = slot.loaded() {
            return Ok(h);
        }
        let (mc, opts) = (slot.config.clone(), self.opts.clone());
        let started = Instant::now();
        let loaded = tokio::task::spawn_blocking(move || super::load(&mc, &opts))
            .await
            .map_err(|e| ApiError::new(500, format!("loading {}: {e}", slot.name), None))?
            .map_err(|e| ApiError::new(503, format!("loading {}: {e:#}", slot.name), None))?;
        let h = Arc::new(loaded);
        if let Ok(mut g) = slot.handle.lock() {
            *g = Some(Arc::clone(&h));
        }
        slot.touch();
        slot.loads.fetch_add(1, Ordering::Relaxed);
        eprintln!("inferd: loaded {} in {:.2} s", slot.name, started.elapsed().as_secs_f64());
        Ok(h)
    }

    /// The models whose idle time passed their `keep_alive`, taken out of their slots (the
    /// caller stops them). A model is busy while a request holds it.
    pub fn reap(&self) -> Vec<Arc<ModelHandle>> {
        let now = Instant::now();
        let mut out = Vec::new();
        for slot in &self.slots {
            let Ok(mut handle) = slot.handle.lock() else { continue };
            let Some(h) = handle.as_ref() else { continue };
            let snap = h.monitor.snapshot();
            let busy = Arc::strong_count(h) > 1 || snap.running + snap.waiting > 0;
            let Ok(mut idle) = slot.idle_since.lock() else { continue };
            if busy {
                *idle = None;
                continue;
            }
            let since = *idle.get_or_insert(now);
            if slot.keep_alive().is_some_and(|k| now.duration_since(since) >= k.max(MIN_IDLE)) {
                out.extend(handle.take());
                *idle = None;
            }
        }
        out
    }
}

/// Stops a model taken out of its slot (on the runtime): its engine ends, its thread is joined
/// on a blocking thread, and the memory goes with the last reference.
pub fn stop(h: Arc<ModelHandle>) {
    if let Ok(tx) = h.engine.lock() {
        let _ = tx.send(Command::Shutdown);
    }
    tokio::task::spawn_blocking(move || {
        if let Some(t) = h.thread.lock().ok().and_then(|mut t| t.take()) {
            let _ = t.join();
        }
        eprintln!("inferd: unloaded {}", h.name);
    });
}

/// Ollama's `keep_alive`: a duration ("5m", "1h30m", "10s", "250ms"), a number of seconds,
/// `0` (unload once idle) or negative (keep as long as the daemon runs, `None`).
pub fn parse_keep_alive(s: &str) -> Result<Option<Duration>, String> {
    let s = s.trim();
    if let Ok(x) = s.parse::<f64>() {
        return Ok((x >= 0.0).then(|| Duration::from_secs_f64(x)));
    }
    if s.starts_with('-') {
        return Ok(None);
    }
    let mut total = Duration::ZERO;
    let mut rest = s;
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(rest.len());
        let n: f64 = rest[..digits].parse().map_err(|_| format!("{s:?} is not a duration (like 5m, 1h, 30s)"))?;
        rest = &rest[digits..];
        let unit = rest.find(|c: char| c.is_ascii_digit() || c == '.').unwrap_or(rest.len());
        let scale = match &rest[..unit] {
            "h" => 3600.0,
            "m" => 60.0,
            "s" => 1.0,
            "ms" => 0.001,
            _ => return Err(format!("{s:?} is not a duration (like 5m, 1h, 30s)")),
        };
        total += Duration::from_secs_f64(n * scale);
        rest = &rest[unit..];
    }
    Ok(Some(total))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keep_alive_reads_ollamas_forms() {
        assert_eq!(parse_keep_alive("5m"), Ok(Some(Duration::from_secs(300))));
        assert_eq!(parse_keep_alive("1h30m"), Ok(Some(Duration::from_secs(5400))));
        assert_eq!(parse_keep_alive("250ms"), Ok(Some(Duration::from_millis(250))));
        assert_eq!(parse_keep_alive("0"), Ok(Some(Duration::ZERO)));
        assert_eq!(parse_keep_alive("30"), Ok(Some(Duration::from_secs(30))));
        assert_eq!(parse_keep_alive("-1"), Ok(None));
        assert_eq!(parse_keep_alive("-1m"), Ok(None));
        assert!(parse_keep_alive("soon").is_err());
        assert!(parse_keep_alive("5x").is_err());
    }
}
