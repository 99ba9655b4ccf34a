//! The models a daemon serves, each in memory only while it is used. They come from the
//! config (`[[model]]`: names, draft bindings, settings; loaded at start) and from the model
//! store (every GGUF file and Hugging Face directory in it, [`super::store`]; loaded on first
//! use). One that no request has held for its `keep_alive` is unloaded (its engine thread
//! ends, its weights are unmapped, its KV pool freed), and the next request that names it loads
//! it again: one load at a time per model; requests arriving meanwhile wait for that load and
//! can watch its progress. `keep_alive` comes from the config (`server.keep_alive`, a model's
//! own) and from requests (Ollama's field: a duration, `0` to unload once idle, `-1` to keep
//! it). With `server.memory_budget_mib`, a load that would not fit first unloads the least
//! recently used idle models on the same device.

use super::api::ApiError;
use super::config::ModelConfig;
use super::ModelHandle;
use inferd_engine::model::facts::Facts;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

/// The shortest idle time before an unload: a request between its model's load and its
/// submission is never caught in between (the reaper needs two looks a second apart).
const MIN_IDLE: Duration = Duration::from_secs(1);

/// How long a load waits for busy models to go idle and leave it room in the memory budget.
const ROOM_WAIT: Duration = Duration::from_secs(120);

/// What loading a model needs beyond its entry: the daemon's threads and scheduler settings.
#[derive(Clone, Debug)]
pub struct LoadOptions {
    pub threads: usize,
    pub token_budget: usize,
    pub max_running: usize,
    /// Seconds an idle engine waits before the free KV blocks' memory goes back (0: never).
    pub kv_release_secs: u64,
    /// Whether users share cached prompt prefixes unless a model says otherwise (a user's
    /// daemon: yes; the system's: no).
    pub share_prefix_cache: bool,
}

/// Where a model's entry comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// A `[[model]]` entry (or `--model`): loaded at start.
    Configured,
    /// A file or directory in the model store: loaded on first use.
    Store,
}

/// How far a load has come: bytes of weights read of the total.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LoadProgress {
    pub done: u64,
    pub total: u64,
    /// Whether a load is under way.
    pub loading: bool,
}

/// One model the daemon can serve, loaded or not.
pub struct Slot {
    /// The name requests use.
    pub name: String,
    pub config: ModelConfig,
    pub source: Source,
    /// What its file says (none when its header cannot be read: loading it says why).
    pub facts: Option<Facts>,
    /// The file's size and modification time when `facts` was read: a store file replaced
    /// under the same name is read again.
    stamp: Option<(u64, std::time::SystemTime)>,
    /// Bytes of its draft model's weights on disk (0: no draft, or one that cannot be read).
    draft_bytes: u64,
    /// The device its weights and KV cache take memory on ("cpu", "cuda").
    pub device: &'static str,
    handle: Mutex<Option<Arc<ModelHandle>>>,
    /// Held while loading: one load at a time.
    loading: tokio::sync::Mutex<()>,
    /// The load under way, for whoever waits for it.
    pub progress: tokio::sync::watch::Sender<LoadProgress>,
    /// How long the model stays loaded once idle; `None`: as long as the daemon runs.
    keep_alive: Mutex<Option<Duration>>,
    /// Its `keep_alive` from the config, which a request without one goes back to.
    configured: Option<Duration>,
    /// Since when no request has held the model, as the reaper saw it.
    idle_since: Mutex<Option<Instant>>,
    /// The last time a request asked for it (least recently used goes first).
    last_used: Mutex<Instant>,
    /// Loads so far (the start's included).
    pub loads: AtomicU64,
}

impl Slot {
    fn new(name: String, config: ModelConfig, source: Source, keep_alive: Option<Duration>) -> Slot {
        let stamp = stamp(&config.path);
        let facts = Facts::read(&config.path).ok();
        let draft_bytes = config.draft.as_deref().and_then(|d| Facts::read(d).ok()).map_or(0, |f| f.size);
        let device = match inferd_engine::backend::choose(config.backend_kind()).0 {
            inferd_engine::backend::BackendKind::Cuda => "cuda",
            _ => "cpu",
        };
        Slot {
            name,
            config,
            source,
            facts,
            stamp,
            draft_bytes,
            device,
            handle: Mutex::new(None),
            loading: tokio::sync::Mutex::new(()),
            progress: tokio::sync::watch::channel(LoadProgress::default()).0,
            keep_alive: Mutex::new(keep_alive),
            configured: keep_alive,
            idle_since: Mutex::new(None),
            last_used: Mutex::new(Instant::now()),
            loads: AtomicU64::new(0),
        }
    }

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

    /// Bytes of its weights on disk (0 when its header cannot be read).
    pub fn weight_bytes(&self) -> u64 {
        self.facts.as_ref().map_or(0, |f| f.size)
    }

    /// Memory the model takes loaded, in bytes: its weights (and its draft's) and the KV
    /// caches it reserves.
    pub fn footprint(&self) -> u64 {
        let weights = self.weight_bytes();
        let draft = self.draft_bytes;
        let kv = (self.config.kv_cache_mib as u64) << 20;
        let draft_kv = if self.config.draft.is_some() { kv / 2 } else { 0 };
        weights + draft + kv + draft_kv
    }

    /// Whether a request holds the model or its engine has work.
    fn busy(h: &Arc<ModelHandle>) -> bool {
        let snap = h.monitor.snapshot();
        Arc::strong_count(h) > 1 || snap.running + snap.waiting > 0
    }

    /// Whether the model is loaded and nobody holds it.
    fn idle(&self) -> bool {
        self.handle.lock().ok().is_some_and(|h| h.as_ref().is_some_and(|h| !Slot::busy(h)))
    }

    fn touch(&self) {
        if let Ok(mut s) = self.idle_since.lock() {
            *s = None;
        }
        if let Ok(mut t) = self.last_used.lock() {
            *t = Instant::now();
        }
    }

    fn last_used(&self) -> Instant {
        self.last_used.lock().map_or_else(|_| Instant::now(), |t| *t)
    }

    fn take(&self) -> Option<Arc<ModelHandle>> {
        self.handle.lock().ok().and_then(|mut h| h.take())
    }
}

/// Every model the daemon knows.
pub struct Models {
    slots: RwLock<Vec<Arc<Slot>>>,
    opts: LoadOptions,
    /// The model store, scanned for models (none with `--model`: that model alone).
    pub store: Option<PathBuf>,
    default_keep_alive: Option<Duration>,
    /// `server.memory_budget_mib` in bytes, per device.
    budget: Option<u64>,
    /// Held while a load makes room: one budget decision at a time. The load itself runs
    /// outside it (models load side by side), its footprint counted from the decision on.
    fit: tokio::sync::Mutex<()>,
    /// Models taken out of a slot a reload replaced or removed, stopped once idle.
    retired: Mutex<Vec<Arc<ModelHandle>>>,
    /// The model a request naming none gets (`server.default_model`).
    default_model: RwLock<Option<String>>,
}

impl std::fmt::Debug for Models {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Models")
            .field("names", &self.slots().iter().map(|s| s.name.clone()).collect::<Vec<_>>())
            .finish()
    }
}

/// What a model store and configuration give: the daemon's model settings.
#[derive(Clone, Debug)]
pub struct Settings {
    pub opts: LoadOptions,
    pub store: Option<PathBuf>,
    pub default_keep_alive: Option<Duration>,
    pub budget_mib: u64,
    /// `server.default_model`.
    pub default_model: Option<String>,
}

impl Models {
    /// The configured models, loaded now (so a model that cannot run stops the start), and
    /// the store's, loaded on use.
    pub fn start(configs: Vec<ModelConfig>, settings: Settings) -> anyhow::Result<Models> {
        let models = Models {
            slots: RwLock::new(Vec::new()),
            opts: settings.opts,
            store: settings.store,
            default_keep_alive: settings.default_keep_alive,
            budget: (settings.budget_mib > 0).then_some(settings.budget_mib << 20),
            fit: tokio::sync::Mutex::new(()),
            retired: Mutex::new(Vec::new()),
            default_model: RwLock::new(settings.default_model.filter(|m| !m.is_empty())),
        };
        let slots = models.configured(configs)?;
        if let Ok(mut all) = models.slots.write() {
            all.extend(slots.iter().cloned());
            sort(&mut all);
        }
        for slot in &slots {
            if let Some(b) = models.budget {
                let loaded: u64 = models.loaded_slots(slot.device).iter().map(|s| s.footprint()).sum();
                if loaded + slot.footprint() > b {
                    eprintln!(
                        "inferd: {} does not fit memory_budget_mib beside the models loaded before it; it loads on use",
                        slot.name
                    );
                    continue;
                }
            }
            let h = super::load(&slot.config, &slot.name, &models.opts, &|_, _| {})?;
            slot.loads.fetch_add(1, Ordering::Relaxed);
            if let Ok(mut g) = slot.handle.lock() {
                *g = Some(Arc::new(h));
            }
        }
        models.rescan();
        Ok(models)
    }

    /// Slots for `configs`, checked (unique names, readable `keep_alive`), none loaded.
    fn configured(&self, configs: Vec<ModelConfig>) -> anyhow::Result<Vec<Arc<Slot>>> {
        let mut slots: Vec<Arc<Slot>> = Vec::new();
        for mc in configs {
            let name = mc.name.clone().unwrap_or_else(|| super::store::model_name(&mc.path));
            if slots.iter().any(|s| s.name == name) {
                anyhow::bail!("two models are named {name:?}: give one a `name` in the config");
            }
            let keep_alive = match mc.keep_alive.as_deref() {
                Some(k) => parse_keep_alive(k).map_err(|e| anyhow::anyhow!("{name}: keep_alive: {e}"))?,
                None => self.default_keep_alive,
            };
            slots.push(Arc::new(Slot::new(name, mc, Source::Configured, keep_alive)));
        }
        Ok(slots)
    }

    /// Every model, configured ones first (in the config's order), then the store's by name.
    pub fn slots(&self) -> Vec<Arc<Slot>> {
        self.slots.read().map(|s| s.clone()).unwrap_or_default()
    }

    /// Whether a model is being loaded now.
    pub fn loading(&self) -> bool {
        self.slots().iter().any(|s| s.progress.borrow().loading)
    }

    /// The models in memory now.
    pub fn loaded(&self) -> Vec<Arc<ModelHandle>> {
        self.slots().iter().filter_map(|s| s.loaded()).collect()
    }

    fn loaded_slots(&self, device: &str) -> Vec<Arc<Slot>> {
        self.slots().into_iter().filter(|s| s.device == device && s.loaded().is_some()).collect()
    }

    /// Reads the store again: new files become models, removed ones (unless loaded) go, and
    /// a file replaced since its header was read (another size or time) is read again. Headers
    /// are read before the list is locked for writing, so a slow or large one delays no request
    /// that only looks a model up; a file's header is read once per (path, size, mtime).
    pub fn rescan(&self) {
        let Some(dir) = &self.store else { return };
        let found = super::store::scan(dir);
        // A configured entry for a store file gives it its name and settings.
        let known = |all: &[Arc<Slot>], name: &str, path: &Path| {
            all.iter().any(|s| s.name == name || (s.source == Source::Configured && same_file(&s.config.path, path)))
        };
        // A store model not loaded whose file changed since its header was read, or whose
        // projector came or went.
        let stale = |s: &Slot| {
            s.source == Source::Store
                && s.loaded().is_none()
                && (s.stamp != stamp(&s.config.path) || s.config.mmproj != super::store::projector_of(&s.config.path))
        };
        let fresh: Vec<Arc<Slot>> = {
            let all = self.slots();
            let current: Vec<Arc<Slot>> = all.iter().filter(|s| !stale(s)).cloned().collect();
            found
                .iter()
                .filter(|(name, path)| !known(&current, name, path))
                .map(|(name, path)| {
                    let mut mc = ModelConfig::for_path(path.clone());
                    mc.mmproj = super::store::projector_of(path);
                    Arc::new(Slot::new(name.clone(), mc, Source::Store, self.default_keep_alive))
                })
                .collect()
        };
        let Ok(mut all) = self.slots.write() else { return };
        all.retain(|s| {
            let replaced = fresh.iter().any(|f| f.name == s.name) && stale(s);
            !replaced
                && (s.source == Source::Configured
                    || s.loaded().is_some()
                    || found.iter().any(|(_, p)| *p == s.config.path))
        });
        for slot in fresh {
            if !known(&all, &slot.name, &slot.config.path) {
                all.push(slot);
            }
        }
        sort(&mut all);
    }

    /// The model a request naming none gets: `server.default_model`, else the first configured
    /// model, else the store's one model. Never "whichever name sorts first": who can write the
    /// store would choose it.
    fn default_slot(&self, all: &[Arc<Slot>]) -> Result<Option<Arc<Slot>>, ApiError> {
        if let Some(name) = self.default_model.read().ok().and_then(|d| d.clone()) {
            return Ok(all.iter().find(|s| s.name == name).cloned());
        }
        if let Some(s) = all.iter().find(|s| s.source == Source::Configured) {
            return Ok(Some(Arc::clone(s)));
        }
        match all {
            [] => Ok(None),
            [one] => Ok(Some(Arc::clone(one))),
            many => Err(ApiError::bad(
                format!(
                    "name a model: the store holds {} ({}) and server.default_model names none",
                    many.len(),
                    many.iter().map(|s| s.name.as_str()).collect::<Vec<_>>().join(", ")
                ),
                "model",
            )),
        }
    }

    /// Sets `server.default_model` (a reload).
    pub fn set_default(&self, name: Option<String>) {
        if let Ok(mut d) = self.default_model.write() {
            *d = name.filter(|n| !n.is_empty());
        }
    }

    /// The slot of model `name` (the default one when none is named).
    pub fn slot(&self, name: Option<&str>) -> Result<Arc<Slot>, ApiError> {
        let find = || {
            let all = self.slots();
            match name {
                None | Some("") => self.default_slot(&all),
                Some(n) => Ok(all.iter().find(|s| s.name == n).cloned()),
            }
        };
        if let Some(s) = find()? {
            return Ok(s);
        }
        // A model installed since the last look.
        self.rescan();
        find()?.ok_or_else(|| match name {
            None | Some("") if self.default_model.read().is_ok_and(|d| d.is_some()) => ApiError::new(
                503,
                format!(
                    "server.default_model names {:?}, which is not installed",
                    self.default_model.read().ok().and_then(|d| d.clone()).unwrap_or_default()
                ),
                None,
            ),
            None | Some("") => ApiError::new(
                503,
                "no model is installed: `inferctl pull REF` installs one, or configure a [[model]]",
                None,
            ),
            Some(n) => {
                let names: Vec<String> = self.slots().iter().map(|s| s.name.clone()).collect();
                ApiError::new(404, format!("unknown model {n:?} (known: {})", names.join(", ")), Some("model"))
            }
        })
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
        let fit = self.fit.lock().await;
        self.make_room(&slot).await?;
        slot.progress.send_replace(LoadProgress { done: 0, total: slot.weight_bytes(), loading: true });
        drop(fit);
        let (mc, opts, s) = (slot.config.clone(), self.opts.clone(), Arc::clone(&slot));
        let started = Instant::now();
        let loaded = tokio::task::spawn_blocking(move || {
            super::load(&mc, &s.name, &opts, &|done, total| {
                s.progress.send_replace(LoadProgress { done, total, loading: true });
            })
        })
        .await;
        let done = slot.progress.borrow().total;
        slot.progress.send_replace(LoadProgress { done, total: done, loading: false });
        let loaded = loaded
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

    /// With a memory budget: unloads the least recently used idle models on `slot`'s device
    /// until it fits, waiting a while for busy ones to go idle. A model larger than the whole
    /// budget is refused with the sizes.
    async fn make_room(&self, slot: &Slot) -> Result<(), ApiError> {
        let Some(budget) = self.budget else { return Ok(()) };
        let need = slot.footprint();
        let mib = |b: u64| b.div_ceil(1 << 20);
        if need > budget {
            return Err(ApiError::new(
                507,
                format!(
                    "{} needs {} MiB ({} MiB of weights, {} MiB of KV cache), more than memory_budget_mib = {} on {}",
                    slot.name,
                    mib(need),
                    mib(need - ((slot.config.kv_cache_mib as u64) << 20)),
                    slot.config.kv_cache_mib,
                    mib(budget),
                    slot.device
                ),
                Some("model"),
            ));
        }
        let t0 = Instant::now();
        loop {
            let loaded = self.loaded_slots(slot.device);
            // Models loading now count as loaded: their room was made before they started.
            let loading: u64 = self
                .slots()
                .iter()
                .filter(|s| s.device == slot.device && s.loaded().is_none() && s.progress.borrow().loading)
                .map(|s| s.footprint())
                .sum();
            let used: u64 = loaded.iter().map(|s| s.footprint()).sum::<u64>() + loading;
            if used + need <= budget {
                return Ok(());
            }
            // The least recently used model nobody holds, unless it was asked for a moment ago
            // (its request is on its way to it).
            let idle =
                loaded.iter().filter(|s| s.last_used().elapsed() >= MIN_IDLE && s.idle()).min_by_key(|s| s.last_used());
            match idle.and_then(|s| s.take()) {
                Some(h) => {
                    eprintln!("inferd: unloading {} to make room for {} (memory_budget_mib)", h.name, slot.name);
                    let _ = stop(h).await;
                }
                None if t0.elapsed() > ROOM_WAIT => {
                    return Err(ApiError::new(
                        503,
                        format!(
                            "{} needs {} MiB and the busy models on {} hold {} of memory_budget_mib = {}: try again later",
                            slot.name,
                            mib(need),
                            slot.device,
                            mib(used),
                            mib(budget)
                        ),
                        None,
                    ));
                }
                None => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }

    /// Unloads model `name` now if nobody holds it, else once its last request ends.
    pub fn unload(&self, name: &str) -> Result<bool, ApiError> {
        let slot = self.slot(Some(name))?;
        slot.set_keep_alive(Some(Some(Duration::ZERO)));
        Ok(slot.loaded().is_some())
    }

    /// The models whose idle time passed their `keep_alive`, and retired ones nobody holds,
    /// taken out of their slots (the caller stops them). A model is busy while a request holds
    /// it.
    pub fn reap(&self) -> Vec<Arc<ModelHandle>> {
        let now = Instant::now();
        let mut out = Vec::new();
        if let Ok(mut retired) = self.retired.lock() {
            let (busy, idle): (Vec<_>, Vec<_>) = retired.drain(..).partition(Slot::busy);
            *retired = busy;
            out.extend(idle);
        }
        for slot in self.slots() {
            let Ok(mut handle) = slot.handle.lock() else { continue };
            let Some(h) = handle.as_ref() else { continue };
            let busy = Slot::busy(h);
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

    /// The slots of a new configuration, checked as start checks them and made ready before
    /// any replaces a running one: each entry added or changed is loaded now (or, when the
    /// memory budget has no room for it beside the loaded models, its header read). A failure
    /// leaves nothing changed: what was loaded for it is stopped.
    pub async fn prepare(&self, configs: Vec<ModelConfig>) -> anyhow::Result<Vec<Arc<Slot>>> {
        let new = self.configured(configs)?;
        let old = self.slots();
        let mut fresh: Vec<Arc<Slot>> = Vec::new();
        let result = async {
            for slot in &new {
                let same =
                    |o: &Arc<Slot>| o.source == Source::Configured && o.name == slot.name && o.config == slot.config;
                if old.iter().any(same) {
                    continue;
                }
                let used: u64 = self
                    .loaded_slots(slot.device)
                    .iter()
                    .filter(|s| s.name != slot.name)
                    .map(|s| s.footprint())
                    .sum::<u64>()
                    + fresh.iter().filter(|s| s.device == slot.device).map(|s| s.footprint()).sum::<u64>();
                if self.budget.is_some_and(|b| used + slot.footprint() > b) {
                    Facts::read(&slot.config.path)
                        .map_err(|e| anyhow::anyhow!("{}: {}: {e}", slot.name, slot.config.path.display()))?;
                    continue;
                }
                let (mc, opts, name) = (slot.config.clone(), self.opts.clone(), slot.name.clone());
                let h = tokio::task::spawn_blocking(move || super::load(&mc, &name, &opts, &|_, _| {}))
                    .await
                    .map_err(|e| anyhow::anyhow!("{}: the load failed: {e}", slot.name))??;
                slot.loads.fetch_add(1, Ordering::Relaxed);
                if let Ok(mut g) = slot.handle.lock() {
                    *g = Some(Arc::new(h));
                }
                fresh.push(Arc::clone(slot));
            }
            anyhow::Ok(())
        }
        .await;
        if let Err(e) = result {
            for slot in fresh {
                if let Some(h) = slot.take() {
                    let _ = stop(h).await;
                }
            }
            return Err(e);
        }
        Ok(new)
    }

    /// Applies a configuration [`Models::prepare`]d: entries unchanged keep their slot (and
    /// model), changed and removed ones are retired (stopped once their requests end), added
    /// and changed ones take their place; what changed, for the log.
    pub fn reconfigure(&self, new: Vec<Arc<Slot>>) -> Vec<(&'static str, String)> {
        let mut changes = Vec::new();
        let Ok(mut all) = self.slots.write() else { return changes };
        let old: Vec<Arc<Slot>> = all.iter().filter(|s| s.source == Source::Configured).cloned().collect();
        let mut kept = Vec::new();
        for slot in &old {
            match new.iter().find(|n| n.name == slot.name) {
                Some(n) if n.config == slot.config => kept.push(slot.name.clone()),
                found => changes.push((if found.is_some() { "changed" } else { "removed" }, slot.name.clone())),
            }
        }
        // What goes: configured entries not kept, and store models a configured name now hides;
        // a loaded one is retired (stopped once its requests end).
        let goes = |s: &Arc<Slot>| match s.source {
            Source::Configured => !kept.contains(&s.name),
            Source::Store => new.iter().any(|n| n.name == s.name),
        };
        for slot in all.iter().filter(|s| goes(s)) {
            if let (Some(h), Ok(mut r)) = (slot.take(), self.retired.lock()) {
                r.push(h);
            }
        }
        all.retain(|s| !goes(s));
        for slot in new {
            if !kept.contains(&slot.name) {
                if !old.iter().any(|o| o.name == slot.name) {
                    changes.push(("added", slot.name.clone()));
                }
                all.push(slot);
            }
        }
        sort(&mut all);
        drop(all);
        self.rescan();
        changes
    }

    /// Removes store model `name`: unloads it and deletes its file or directory, and its
    /// projector.
    pub fn remove(&self, name: &str) -> Result<PathBuf, ApiError> {
        let slot = self.slot(Some(name))?;
        if slot.source != Source::Store {
            return Err(ApiError::new(
                409,
                format!(
                    "{name} is configured in inferd.toml, not installed in the model store: remove its [[model]] entry"
                ),
                Some("model"),
            ));
        }
        if let (Some(h), Ok(mut r)) = (slot.take(), self.retired.lock()) {
            r.push(h);
        }
        let path = slot.config.path.clone();
        for p in std::iter::once(&path).chain(slot.config.mmproj.as_ref()) {
            super::store::remove(p).map_err(|e| ApiError::new(500, format!("removing {}: {e}", p.display()), None))?;
        }
        if let Ok(mut all) = self.slots.write() {
            all.retain(|s| !Arc::ptr_eq(s, &slot));
        }
        Ok(path)
    }
}

/// Configured first, then the store's: the default model, then by name.
fn sort(all: &mut [Arc<Slot>]) {
    let default = super::store::model_name(Path::new(inferd_engine::paths::DEFAULT_MODEL_FILE));
    all.sort_by_key(|s| (s.source == Source::Store, s.source == Source::Store && s.name != default));
    let store_from = all.iter().position(|s| s.source == Source::Store && s.name != default).unwrap_or(all.len());
    all[store_from..].sort_by(|a, b| a.name.cmp(&b.name));
}

/// A file's size and modification time (none when it cannot be read).
fn stamp(path: &Path) -> Option<(u64, std::time::SystemTime)> {
    let m = std::fs::metadata(path).ok()?;
    Some((m.len(), m.modified().ok()?))
}

fn same_file(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    }
}

/// Stops a model taken out of its slot: its engine ends, its thread is joined on a blocking
/// thread, and the memory goes with the last reference. Awaiting it waits for all that.
pub fn stop(h: Arc<ModelHandle>) -> tokio::task::JoinHandle<()> {
    h.engine.shut_down();
    tokio::task::spawn_blocking(move || {
        h.engine.stop(None);
        let name = h.name.clone();
        drop(h);
        inferd_engine::model::mmap::trim_heap();
        eprintln!("inferd: unloaded {name}");
    })
}

/// The longest `keep_alive` kept as a duration (a hundred years); a longer one is "as long as
/// the daemon runs", so a deadline computed from it never overflows a clock.
const LONGEST_KEEP_ALIVE: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// Ollama's `keep_alive`: a duration ("5m", "1h30m", "10s", "250ms"), a number of seconds,
/// `0` (unload once idle) or negative (keep as long as the daemon runs, `None`). A duration
/// past [`LONGEST_KEEP_ALIVE`] (`1e300`, `inf`) also keeps it as long as the daemon runs; `NaN`
/// is not a duration.
pub fn parse_keep_alive(s: &str) -> Result<Option<Duration>, String> {
    parse_duration(s).map(|d| d.filter(|d| *d <= LONGEST_KEEP_ALIVE))
}

/// [`parse_keep_alive`] before the longest is applied.
fn parse_duration(s: &str) -> Result<Option<Duration>, String> {
    let s = s.trim();
    if let Ok(x) = s.parse::<f64>() {
        if x.is_nan() {
            return Err(format!("{s:?} is not a duration (like 5m, 1h, 30s)"));
        }
        return Ok(if x < 0.0 { None } else { Duration::try_from_secs_f64(x).ok() });
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
        // (Past what a `Duration` holds: as long as the daemon runs.)
        let Some(t) = Duration::try_from_secs_f64(n * scale).ok().and_then(|d| total.checked_add(d)) else {
            return Ok(None);
        };
        total = t;
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
        // Once `1e300` and `inf` panicked a runtime worker (found by fuzzing /api/embed).
        for forever in
            ["1e300", "inf", "-inf", "1e18", "876001h", "99999999999999999999h", "99999999999999999999999999h1s"]
        {
            assert_eq!(parse_keep_alive(forever), Ok(None), "{forever}");
        }
        assert!(parse_keep_alive("NaN").is_err());
        assert_eq!(parse_keep_alive("-1"), Ok(None));
        assert_eq!(parse_keep_alive("-1m"), Ok(None));
        assert!(parse_keep_alive("soon").is_err());
        assert!(parse_keep_alive("5x").is_err());
    }
}
