//! The daemon: one engine thread per loaded model (`inferd_engine::sched`; [`models`] loads them
//! on use and unloads them when idle), behind two edges that
//! share one request path ([`request`]): HTTP on a Unix socket ([`http`]) and D-Bus
//! ([`dbus`]). [`run`] wires them to systemd ([`notify`]): READY after the models are loaded
//! and the socket listens, the watchdog fed by the engine loops' heartbeats, SIGHUP reloads,
//! SIGTERM drains.

pub mod answer;
pub mod anthropic;
pub mod api;
pub mod bench;
pub mod bench_clients;
pub mod chat;
pub mod config;
pub mod conn;
pub mod dbus;
pub mod dbus_options;
pub mod embed;
pub mod fields;
pub mod fim;
pub mod gate;
pub mod guard;
pub mod http;
pub mod image_fetch;
pub mod infill;
pub mod loading;
pub mod manage;
pub mod metrics;
pub mod models;
pub mod notify;
pub mod ollama;
pub mod openai;
pub mod pull;
pub mod reasoning;
pub mod remote;
pub mod request;
pub mod rerank;
pub mod responses;
pub mod store;
pub mod stored;
pub mod tcp_owner;
pub mod upload;

use config::{Config, Limits, Mode};
use inferd_engine::engine::EngineOptions;
use inferd_engine::model::Model;
use inferd_engine::plugin::{recorder, Isolation, Quarantine, Registry, TrustPolicy};
use inferd_engine::sched::monitor::Monitor;
use inferd_engine::sched::{EngineHandle, Launch, LoopConfig, PrefixSharing, Stopped};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

/// A loaded model and its engine thread.
pub struct ModelHandle {
    /// The name requests use.
    pub name: String,
    pub model: Arc<Model>,
    /// The bound draft model's name, if any.
    pub draft: Option<String>,
    /// `1 << abi::ROLE_*` for each sequence role its store offers.
    pub roles: u32,
    /// Its vocabulary for response formats and the plugins' `token_bytes` (none when the
    /// model declares no end-of-sequence token: constrained output could never end).
    pub vocabulary: Option<Arc<inferd_engine::constraint::Vocabulary>>,
    /// Its engine thread (where it runs: [`EngineHandle::backend`]).
    pub engine: EngineHandle,
    pub monitor: Arc<Monitor>,
}

impl ModelHandle {
    /// Prompt plus generated tokens, at most: the model's context, capped by the config
    /// (`Model::limit_context`).
    pub fn context_len(&self) -> usize {
        self.model.config.context_len
    }
}

impl std::fmt::Debug for ModelHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelHandle").field("name", &self.name).finish_non_exhaustive()
    }
}

/// What every edge shares.
#[derive(Debug)]
pub struct Shared {
    pub models: models::Models,
    registry: RwLock<Arc<Registry>>,
    limits: RwLock<Limits>,
    pub users: request::UserLimits,
    pub next_id: AtomicU64,
    /// SIGTERM arrived: new requests get 503.
    pub draining: AtomicBool,
    pub started: Instant,
    pub http: http::HttpCounters,
    /// Plugin files refused at the last scan, with the reason.
    pub refused: Mutex<Vec<String>>,
    /// Permits for requests' CPU work off the runtime ([`Shared::cpu`]): one per core.
    pub cpu_permits: tokio::sync::Semaphore,
    /// Plugin libraries that crashed or hung, kept across restarts.
    pub quarantine: Arc<Quarantine>,
    /// Chat templates render here: helper processes bounded in memory and time.
    pub templates: inferd_engine::template_host::TemplateHost,
    /// The models an upstream server serves.
    pub remotes: RwLock<Vec<Arc<remote::Remote>>>,
    /// The reloads (SIGHUP) so far, and the last one's outcome: `None` applied, or why it was
    /// refused.
    pub reloads: Mutex<(u64, Option<String>)>,
    /// Who may manage models (`server.manage`).
    managers: RwLock<manage::Managers>,
    /// Model files arriving for the store.
    pub uploads: upload::Uploads,
    /// The Responses API's stored responses, per user.
    pub responses: stored::Responses,
    /// Where `/infill` puts the typed text (`server.infill_layout`).
    infill_layout: RwLock<fim::Layout>,
    /// Whether image URLs are fetched (`server.fetch_images`).
    fetch_images: AtomicBool,
}

impl Shared {
    /// Who may manage models.
    pub fn managers(&self) -> manage::Managers {
        self.managers.read().map(|m| m.clone()).unwrap_or_else(|_| manage::Managers::new(&[]))
    }

    /// Reads the model store again ([`models::Models::rescan`]) on a blocking thread, for the
    /// handlers that list it: no header is read on an async worker.
    pub async fn rescan_store(self: &Arc<Self>) {
        let sh = Arc::clone(self);
        let _ = tokio::task::spawn_blocking(move || sh.models.rescan()).await;
    }

    pub fn registry(&self) -> Arc<Registry> {
        self.registry.read().map(|r| Arc::clone(&r)).unwrap_or_default()
    }

    pub fn infill_layout(&self) -> fim::Layout {
        self.infill_layout.read().map(|l| *l).unwrap_or_default()
    }

    /// Whether `http(s)` image URLs are fetched ([`image_fetch`]).
    pub fn fetch_images(&self) -> bool {
        self.fetch_images.load(Ordering::Relaxed)
    }

    pub fn limits(&self) -> Limits {
        self.limits.read().map(|l| l.clone()).unwrap_or_default()
    }

    /// Requests accepted and not yet answered in full, over both edges.
    pub fn in_flight(&self) -> usize {
        self.users.snapshot().values().sum()
    }

    /// A one-line summary (systemd's STATUS=).
    pub fn summary(&self) -> String {
        let loaded = self.models.loaded();
        let names: Vec<&str> = loaded.iter().map(|m| m.name.as_str()).collect();
        let (run, wait) = loaded.iter().fold((0, 0), |(r, w), m| {
            let s = m.monitor.snapshot();
            (r + s.running, w + s.waiting)
        });
        let names =
            if names.is_empty() { "no model loaded".to_string() } else { format!("serving {}", names.join(", ")) };
        format!("{names}; {run} running, {wait} waiting")
    }
}

/// How `inferd serve` was asked to run: the mode, the config file, and flags that override it.
#[derive(Clone, Debug)]
pub struct ServeArgs {
    pub mode: Mode,
    /// `--config` (must exist) or the mode's default file (may be missing).
    pub config: Option<PathBuf>,
    pub model: Option<PathBuf>,
    pub socket: Option<PathBuf>,
    pub plugin_dirs: Vec<PathBuf>,
    pub threads: Option<usize>,
}

impl ServeArgs {
    /// The configuration file, and whether it must exist (it was named).
    fn config_file(&self) -> (PathBuf, bool) {
        match &self.config {
            Some(p) => (p.clone(), true),
            None => (self.mode.config_path(), false),
        }
    }

    /// The configuration: the file, then the flags on top.
    pub fn config(&self) -> anyhow::Result<Config> {
        let (path, required) = self.config_file();
        let mut cfg = Config::load(&path, required)?;
        if let Some(m) = &self.model {
            cfg.models = vec![config::ModelConfig::for_path(m.clone())];
        }
        if let Some(s) = &self.socket {
            cfg.server.socket = Some(s.clone());
        }
        if !self.plugin_dirs.is_empty() {
            cfg.plugin_dirs = self.plugin_dirs.clone();
        }
        if let Some(t) = self.threads {
            cfg.server.threads = t;
        }
        Ok(cfg)
    }
}

/// Loads the plugin directories: inferd's own libraries in this process, the others (unless
/// configured otherwise) each in a sandboxed helper process, quarantined ones not at all.
fn load_plugins(cfg: &Config, mode: Mode, quarantine: &Arc<Quarantine>) -> (Registry, Vec<String>) {
    let policy = match mode {
        Mode::System => TrustPolicy::System,
        Mode::User => TrustPolicy::User,
    };
    let p = &cfg.plugins;
    let isolation = Isolation {
        // The running executable even when an upgrade has replaced the file on disk: the
        // helper must speak this daemon's protocol.
        exe: PathBuf::from("/proc/self/exe"),
        call_timeout: Duration::from_millis(p.call_timeout_ms.max(1)),
        memory_mib: p.memory_limit_mib.max(64),
        quarantine: Some(Arc::clone(quarantine)),
    };
    let mut reg = Registry::isolating(p.isolate(), isolation);
    let refused = reg.load_dirs_into(&inferd_engine::paths::plugin_dirs(&cfg.plugin_dirs), policy);
    for r in &refused {
        eprintln!("inferd: plugin refused: {r}");
    }
    (reg, refused)
}

/// Loads model `mc` (and its draft) as `name` and starts its engine thread, reporting the
/// bytes of weights read so far to `progress`.
fn load(
    mc: &config::ModelConfig,
    name: &str,
    lo: &models::LoadOptions,
    progress: &dyn Fn(u64, u64),
) -> anyhow::Result<ModelHandle> {
    let mut files = vec![mc.path.as_path()];
    files.extend(mc.draft.as_deref());
    files.extend(mc.mmproj.as_deref());
    store::read_ahead(&files, progress);
    let mut model = Model::load(&mc.path).map_err(|e| anyhow::anyhow!("loading {}: {e}", mc.path.display()))?;
    model.limit_context(mc.context_len);
    if let Some(p) = &mc.mmproj {
        model.pair_projector(p).map_err(|e| anyhow::anyhow!("the projector {} of {}: {e}", p.display(), model.name))?;
    }
    if let Some(t) = &mc.chat_template {
        let text = std::fs::read_to_string(t)
            .map_err(|e| anyhow::anyhow!("reading the chat template {} of {}: {e}", t.display(), model.name))?;
        inferd_engine::chat::ChatTemplate::new(Some(&text), String::new(), String::new())
            .map_err(|e| anyhow::anyhow!("the chat template {} of {}: {e}", t.display(), model.name))?;
        model.chat_template = Some(text);
    }
    let model = Arc::new(model);
    let draft = mc
        .draft
        .as_ref()
        .map(|p| {
            let mut d = Model::load(p).map_err(|e| anyhow::anyhow!("loading draft model {}: {e}", p.display()))?;
            d.limit_context(mc.context_len);
            // What it proposes is verified: its logits may come from a cheaper copy.
            d.cheapen_output_for_drafting(EngineOptions { threads: lo.threads, ..EngineOptions::default() }.threads());
            Ok::<_, anyhow::Error>(Arc::new(d))
        })
        .transpose()?;
    if let Some(d) = &draft {
        if d.config.vocab != model.config.vocab {
            anyhow::bail!(
                "draft model {} has a vocabulary of {} tokens, its target {} has {}",
                d.name,
                d.config.vocab,
                model.name,
                model.config.vocab
            );
        }
    }
    let name = name.to_string();
    let monitor = Arc::new(Monitor::new(name.clone()));
    let opts =
        EngineOptions { threads: lo.threads, kv_budget_bytes: mc.kv_cache_mib << 20, ..EngineOptions::default() };
    let vocabulary = match inferd_engine::constraint::Vocabulary::new(&model.tokenizer) {
        Ok(v) => Some(Arc::new(v)),
        Err(e) => {
            eprintln!("inferd: {name}: no response formats: {e}");
            None
        }
    };
    let loop_cfg = LoopConfig {
        token_budget: lo.token_budget,
        max_running: lo.max_running,
        eos: model.tokenizer.eos().to_vec(),
        monitor: Some(Arc::clone(&monitor)),
        vocabulary: vocabulary.clone(),
        kv_release_after: (lo.kv_release_secs > 0).then(|| Duration::from_secs(lo.kv_release_secs)),
        prefix_sharing: if mc.share_prefix_cache.unwrap_or(lo.share_prefix_cache) {
            PrefixSharing::Shared
        } else {
            PrefixSharing::PerUser
        },
    };
    // The engines are opened here, so a model the backend cannot run fails the start.
    let launch = Launch {
        model: &model,
        backend: mc.backend_kind(),
        options: opts,
        draft: draft.as_deref().map(|d| (d, mc.draft_backend_kind())),
        config: loop_cfg,
    };
    let engine = EngineHandle::start(&name, launch)?;
    eprintln!("inferd: {name} runs on {}", engine.backend());
    let roles = 1 << inferd_plugin_api::abi::ROLE_TARGET
        | if draft.is_some() { 1 << inferd_plugin_api::abi::ROLE_DRAFT } else { 0 };
    Ok(ModelHandle { name, model, draft: draft.map(|d| d.name.clone()), roles, vocabulary, engine, monitor })
}

/// The listening socket: the one systemd passed (LISTEN_FDS), else a fresh one at the
/// configured path with the configured mode and group.
fn listen(cfg: &Config, mode: Mode) -> anyhow::Result<(std::os::unix::net::UnixListener, Option<PathBuf>)> {
    if let Some(l) = notify::activated_listener()? {
        return Ok((l, None));
    }
    let path = cfg.server.socket.clone().unwrap_or_else(|| mode.default_socket());
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| anyhow::anyhow!("creating {}: {e}", dir.display()))?;
    }
    // A socket file left by a previous run would make bind fail; anything else is not ours.
    if let Ok(meta) = std::fs::symlink_metadata(&path) {
        use std::os::unix::fs::FileTypeExt;
        if !meta.file_type().is_socket() {
            anyhow::bail!("{} exists and is not a socket", path.display());
        }
        if std::os::unix::net::UnixStream::connect(&path).is_ok() {
            anyhow::bail!("another daemon is already serving {}", path.display());
        }
        std::fs::remove_file(&path)?;
    }
    let l = std::os::unix::net::UnixListener::bind(&path)
        .map_err(|e| anyhow::anyhow!("binding {}: {e}", path.display()))?;
    set_permissions(&path, cfg)?;
    Ok((l, Some(path)))
}

fn set_permissions(path: &Path, cfg: &Config) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let mode = cfg.socket_mode().map_err(|e| anyhow::anyhow!(e))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))?;
    if let Some(g) = &cfg.server.socket_group {
        let gid = config::group_id(g).ok_or_else(|| anyhow::anyhow!("server.socket_group: no group named {g:?}"))?;
        std::os::unix::fs::chown(path, None, Some(gid))
            .map_err(|e| anyhow::anyhow!("giving {} to group {g}: {e}", path.display()))?;
    }
    Ok(())
}

/// `inferd serve`: runs the daemon until SIGTERM or SIGINT.
pub fn run(args: &ServeArgs) -> anyhow::Result<()> {
    // Models come and go: what one allocated must go back to the kernel when it is unloaded.
    inferd_engine::model::mmap::map_large_allocations();
    let cfg = args.config()?;
    let remote_models = check(&cfg)?;
    for name in manage::Managers::new(&cfg.server.manage).unknown() {
        eprintln!("inferd: server.manage: no user or group {name:?} here; it grants nothing");
    }
    let quarantine = Arc::new(recover_plugins(&cfg));
    let (reg, refused) = load_plugins(&cfg, args.mode, &quarantine);
    let keep_alive =
        models::parse_keep_alive(&cfg.server.keep_alive).map_err(|e| anyhow::anyhow!("server.keep_alive: {e}"))?;
    let settings = models::Settings {
        opts: models::LoadOptions {
            threads: cfg.server.threads,
            token_budget: cfg.scheduler.token_budget,
            max_running: cfg.scheduler.max_running,
            kv_release_secs: cfg.scheduler.kv_release_secs,
            share_prefix_cache: args.mode == Mode::User,
        },
        // `--model` serves that model alone; otherwise the store's models are listed too.
        store: args
            .model
            .is_none()
            .then(|| cfg.server.model_store.clone().unwrap_or_else(|| store::default_dir(args.mode))),
        default_keep_alive: keep_alive,
        budget_mib: cfg.server.memory_budget_mib,
        default_model: cfg.server.default_model.clone(),
    };
    if let Some(dir) = &settings.store {
        store::prepare(dir);
    }
    let models = models::Models::start(cfg.models.clone(), settings)?;
    let shared = Arc::new(Shared {
        models,
        registry: RwLock::new(Arc::new(reg)),
        limits: RwLock::new(cfg.limits.clone()),
        users: request::UserLimits::default(),
        next_id: AtomicU64::new(1),
        draining: AtomicBool::new(false),
        started: Instant::now(),
        http: http::HttpCounters::default(),
        refused: Mutex::new(refused),
        cpu_permits: tokio::sync::Semaphore::new(std::thread::available_parallelism().map_or(2, |n| n.get())),
        quarantine,
        // The running executable, as for plugin helpers: it must speak this daemon's protocol.
        templates: inferd_engine::template_host::TemplateHost::new(PathBuf::from("/proc/self/exe")),
        remotes: RwLock::new(remote_models),
        reloads: Mutex::new((0, None)),
        managers: RwLock::new(manage::Managers::new(&cfg.server.manage)),
        uploads: upload::Uploads::new(cfg.server.max_model_gib),
        responses: stored::Responses::new(inferd_engine::paths::state_dir().join("responses")),
        infill_layout: RwLock::new(cfg.server.infill_layout),
        fetch_images: AtomicBool::new(cfg.server.fetch_images),
    });
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let call_limit = Duration::from_millis(cfg.plugins.call_timeout_ms.max(1));
    let result = rt.block_on(serve(Arc::clone(&shared), args, cfg));
    // The engines end with their senders; wait for them so no request is cut mid-step, but
    // not for ever: an engine inside a call that never returns (a plugin in this process)
    // must not keep the daemon from stopping.
    let deadline = Instant::now() + ENGINE_STOP;
    let mut stuck = Vec::new();
    for m in shared.models.loaded() {
        if m.engine.stop(Some(deadline)) == Stopped::Stuck {
            stuck.push(m.name.clone());
        }
    }
    if !stuck.is_empty() {
        for (lib, open) in recorder::hung(call_limit) {
            let why = format!(
                "one call into it had not returned after {:.1} s when the daemon had to stop",
                open.as_secs_f64()
            );
            eprintln!("inferd: plugin {}: {why}: quarantined", lib.display());
            let _ = shared.quarantine.add(&lib, &why);
        }
        anyhow::bail!(
            "the engine of {} did not stop within {} s; exiting without it",
            stuck.join(", "),
            ENGINE_STOP.as_secs()
        );
    }
    result
}

/// What start refuses in `cfg` beyond what parsing it checked, for reload to refuse alike:
/// durations, the socket's mode and group, the TCP guard's settings; the remote models, made.
fn check(cfg: &Config) -> anyhow::Result<Vec<Arc<remote::Remote>>> {
    models::parse_keep_alive(&cfg.server.keep_alive).map_err(|e| anyhow::anyhow!("server.keep_alive: {e}"))?;
    models::parse_keep_alive(&cfg.server.idle_exit).map_err(|e| anyhow::anyhow!("server.idle_exit: {e}"))?;
    cfg.socket_mode().map_err(|e| anyhow::anyhow!(e))?;
    if let Some(g) = &cfg.server.socket_group {
        config::group_id(g).ok_or_else(|| anyhow::anyhow!("server.socket_group: no group named {g:?}"))?;
    }
    if cfg.server.tcp.is_some() {
        let s = &cfg.server;
        guard::Guard::new(&s.tcp_hosts, &s.cors_origins, s.tcp_key_file.as_deref())?;
    }
    remotes(cfg)
}

/// The remote models of `cfg`.
fn remotes(cfg: &Config) -> anyhow::Result<Vec<Arc<remote::Remote>>> {
    cfg.remotes.iter().map(|r| remote::Remote::new(r).map(Arc::new).map_err(|e| anyhow::anyhow!(e))).collect()
}

/// How long the engines get to stop once the requests have drained or been cancelled.
const ENGINE_STOP: Duration = Duration::from_secs(5);

/// Opens the plugin quarantine and starts the crash recorder; a library the last run's record
/// blames (it crashed the daemon, or hung it until it was killed) joins the quarantine.
fn recover_plugins(cfg: &Config) -> Quarantine {
    let state = inferd_engine::paths::state_dir();
    let quarantine = Quarantine::open(&state.join("plugin-quarantine"));
    match recorder::install(&state.join("plugin-calls"), Duration::from_millis(cfg.plugins.call_timeout_ms.max(1))) {
        Ok(blamed) => {
            for (lib, why) in blamed {
                eprintln!("inferd: plugin {}: {why}: quarantined", lib.display());
                if let Err(e) = quarantine.add(&lib, &why) {
                    eprintln!("inferd: recording the quarantine in {}: {e}", quarantine.file().display());
                }
            }
        }
        Err(e) => eprintln!("inferd: no plugin crash record in {} ({e})", state.display()),
    }
    quarantine
}

async fn serve(sh: Arc<Shared>, args: &ServeArgs, cfg: Config) -> anyhow::Result<()> {
    // Signal handlers first: a SIGTERM or SIGHUP right after READY=1 must not hit the default
    // action (termination).
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut int = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())?;
    let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())?;
    let (listener, path) = listen(&cfg, args.mode)?;
    let activated = path.is_none();
    let listener = gate::Gate::new(listener)?;
    let door = listener.state();
    let idle_exit = models::parse_keep_alive(&cfg.server.idle_exit)
        .map_err(|e| anyhow::anyhow!("server.idle_exit: {e}"))?
        .filter(|d| !d.is_zero() && activated);
    let stop = Arc::new(tokio::sync::Notify::new());
    let mut servers = tokio::task::JoinSet::new();
    let conn_limits = |sh: &Arc<Shared>| {
        let sh = Arc::clone(sh);
        move || {
            let l = sh.limits();
            conn::ConnLimits {
                header_timeout: Duration::from_secs(l.request_timeout_secs.max(1)),
                per_peer: l.max_connections_per_user.max(1),
            }
        }
    };
    servers.spawn(conn::serve(listener, http::router(Arc::clone(&sh)), conn_limits(&sh), Arc::clone(&stop)));
    if let Some(addr) = &cfg.server.tcp {
        let tcp = tokio::net::TcpListener::bind(addr).await.map_err(|e| anyhow::anyhow!("server.tcp {addr}: {e}"))?;
        let local = tcp.local_addr()?;
        if !local.ip().is_loopback() {
            anyhow::bail!("server.tcp must be a loopback address, not {local}");
        }
        let s = &cfg.server;
        let g = Arc::new(guard::Guard::new(&s.tcp_hosts, &s.cors_origins, s.tcp_key_file.as_deref())?);
        let r =
            http::router(Arc::clone(&sh)).layer(g.cors()).layer(axum::middleware::from_fn_with_state(g, guard::check));
        servers.spawn(conn::serve(tcp, r, conn_limits(&sh), Arc::clone(&stop)));
    }
    let bus = if cfg.server.dbus {
        match dbus::serve(Arc::clone(&sh), args.mode).await {
            Ok(c) => Some(c),
            Err(e) => {
                eprintln!("inferd: D-Bus unavailable ({e}); serving the socket only");
                None
            }
        }
    } else {
        None
    };
    let where_ = path.as_ref().map_or_else(|| "the socket systemd passed".to_string(), |p| p.display().to_string());
    let mut names: Vec<String> = sh.models.slots().iter().map(|m| m.name.clone()).collect();
    names.extend(sh.remote_models().iter().map(|r| format!("{} (remote, {})", r.name, r.upstream)));
    eprintln!("inferd: serving {} on {where_}", names.join(", "));
    notify::ready(&sh.summary());
    let watchdog = notify::watchdog(Arc::clone(&sh));

    let mut status_tick = tokio::time::interval(Duration::from_secs(5));
    let mut reap_tick = tokio::time::interval(Duration::from_millis(500));
    let mut idle_tick = tokio::time::interval(Duration::from_millis(250));
    loop {
        tokio::select! {
            // Socket-activated, nothing loaded or loading, no request and no connection for
            // idle_exit: exit; the gate accepts nothing more, so a client connecting now waits
            // in the socket's backlog for the next start.
            _ = idle_tick.tick(), if idle_exit.is_some() => {
                let idle = idle_exit.unwrap_or_default();
                let quiet = sh.models.loaded().is_empty() && !sh.models.loading() && sh.in_flight() == 0;
                if quiet && door.close_if_idle(idle) {
                    eprintln!("inferd: idle for {} s with no model loaded: exiting (the socket starts inferd again)", idle.as_secs_f64());
                    break;
                }
            }
            _ = term.recv() => break,
            _ = int.recv() => break,
            _ = hup.recv() => reload(&sh, args).await,
            _ = status_tick.tick() => notify::status(&sh.summary()),
            _ = reap_tick.tick() => for h in sh.models.reap() {
                drop(models::stop(h));
            },
            Some(r) = servers.join_next() => {
                // A listener ended by itself: that is an error worth exiting for.
                match r {
                    Ok(()) => anyhow::bail!("the HTTP listener stopped"),
                    Err(e) => anyhow::bail!("the HTTP listener panicked: {e}"),
                }
            }
        }
    }
    // Drain: refuse new requests, let running ones finish within the grace time, then cancel
    // the rest (their clients get an error) and close the listeners.
    // Refuse new requests before telling anyone we stop: a client that saw STOPPING=1 (or
    // systemd's "deactivating") must get 503, not a request that slipped in between.
    sh.draining.store(true, Ordering::SeqCst);
    notify::stopping();
    let grace = Duration::from_secs(cfg.server.shutdown_grace_secs);
    let t0 = Instant::now();
    while sh.in_flight() > 0 && t0.elapsed() < grace {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for m in sh.models.loaded() {
        m.engine.shut_down();
    }
    stop.notify_waiters();
    let _ = tokio::time::timeout(Duration::from_secs(5), async { while servers.join_next().await.is_some() {} }).await;
    watchdog.abort();
    drop(bus);
    if let Some(p) = path {
        let _ = std::fs::remove_file(p);
    }
    eprintln!("inferd: stopped");
    Ok(())
}

/// SIGHUP: reread the config and apply it whole or not at all. It is checked as start checks
/// it, and every `[[model]]` entry added or changed is loaded (the new model beside the old)
/// before anything changes; then limits apply at once, the plugin directories and the store
/// are read again, and the new models replace the old ones (which finish their requests). A
/// file that fails any of that, or an empty one (an editor caught mid-write), leaves the running
/// configuration as it was. The socket and the other `[server]` settings need a restart.
async fn reload(sh: &Arc<Shared>, args: &ServeArgs) {
    notify::reloading();
    let prepared = async {
        let (path, _) = args.config_file();
        if std::fs::read_to_string(&path).is_ok_and(|t| t.trim().is_empty()) {
            anyhow::bail!("{} is empty", path.display());
        }
        let cfg = args.config()?;
        let remotes = check(&cfg)?;
        let slots = sh.models.prepare(cfg.models.clone()).await?;
        anyhow::Ok((cfg, remotes, slots))
    };
    match prepared.await {
        Ok((cfg, new_remotes, slots)) => {
            let (reg, refused) = load_plugins(&cfg, args.mode, &sh.quarantine);
            if let Ok(mut r) = sh.registry.write() {
                *r = Arc::new(reg);
            }
            if let Ok(mut r) = sh.refused.lock() {
                *r = refused;
            }
            if let Ok(mut l) = sh.limits.write() {
                *l = cfg.limits.clone();
            }
            if let Ok(mut m) = sh.managers.write() {
                *m = manage::Managers::new(&cfg.server.manage);
            }
            sh.models.set_default(cfg.server.default_model.clone());
            sh.uploads.max_bytes.store(cfg.server.max_model_gib.saturating_mul(1 << 30), Ordering::Relaxed);
            if let Ok(mut l) = sh.infill_layout.write() {
                *l = cfg.server.infill_layout;
            }
            sh.fetch_images.store(cfg.server.fetch_images, Ordering::Relaxed);
            if let Ok(mut old) = sh.remotes.write() {
                *old = new_remotes;
            }
            for (what, name) in sh.models.reconfigure(slots) {
                eprintln!("inferd: model {name} {what}");
            }
            eprintln!("inferd: reloaded the configuration and {} strategies", sh.registry().names().len());
            if let Ok(mut r) = sh.reloads.lock() {
                *r = (r.0 + 1, None);
            }
        }
        Err(e) => {
            eprintln!("inferd: reload refused, keeping the running configuration: {e:#}");
            if let Ok(mut r) = sh.reloads.lock() {
                *r = (r.0 + 1, Some(format!("{e:#}")));
            }
        }
    }
    notify::ready(&sh.summary());
}
