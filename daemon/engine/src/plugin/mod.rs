//! Decoder plugins, host side: the registry of loaded strategies, the trust policy for plugin
//! directories, where each library runs, and sessions (one per request) that drive a strategy
//! through the C ABI.
//!
//! - `loader`: opens a library and checks its declaration.
//! - `host`: the callback table and the per-call context.
//! - `session`: create / plan / observe / destroy with every plugin answer checked.
//! - `runner`: the same calls in this process or in the library's helper process.
//! - `isolated` (the daemon's side), `helper` and `sandbox` (the helper's side), `wire` (their
//!   messages): third-party libraries run in a confined helper process, one per library.
//! - `recorder`, `quarantine`: a library that crashed or hung the daemon or its helper is not
//!   loaded again, across restarts.
//! - `philox`: the counter-based generator behind the `random` callback.

pub mod helper;
pub mod host;
pub mod isolated;
pub mod loader;
pub mod philox;
pub mod quarantine;
pub mod recorder;
pub mod runner;
pub mod sandbox;
pub mod session;
#[cfg(test)]
pub(crate) mod tests;
pub mod wire;

pub use isolated::Isolation;
pub use loader::{Declaration, StrategyDecl};
pub use quarantine::Quarantine;
pub use runner::Runner;
pub use session::{Choice, FinishReason, Session, SessionRequest};
pub use wire::{Declared, StrategyInfo};

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

/// Consecutive failed requests after which a strategy is quarantined.
pub const QUARANTINE_AFTER: u32 = 5;

#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    #[error("{path}: refused: {why}")]
    Refused { path: PathBuf, why: String },
    #[error("unknown decoding strategy {name:?} (available: {available})")]
    UnknownStrategy { name: String, available: String },
    #[error("decoding strategy {0:?} is quarantined: {1}")]
    Quarantined(String, String),
    #[error("invalid request for {strategy}: {message}")]
    Invalid { strategy: String, message: String },
    #[error("{strategy} failed: {message}")]
    Failed { strategy: String, message: String },
}

/// Where plugin files may come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TrustPolicy {
    /// The system daemon: files and their directory owned by root and not writable by group or
    /// others.
    System,
    /// A user's own daemon or command: absolute paths, not writable by others.
    User,
}

/// Why `path` may not be loaded under `policy`, if it may not.
pub fn untrusted(path: &Path, policy: TrustPolicy) -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    if !path.is_absolute() {
        return Some("not an absolute path".into());
    }
    let dir = path.parent().unwrap_or(Path::new("/"));
    for (p, what) in [(path, "the file"), (dir, "its directory")] {
        let m = match std::fs::metadata(p) {
            Ok(m) => m,
            Err(e) => return Some(format!("{what}: {e}")),
        };
        let writable_by = if policy == TrustPolicy::System { 0o022 } else { 0o002 };
        if m.mode() & writable_by != 0 {
            return Some(format!(
                "{what} is writable by {}",
                if m.mode() & 0o002 != 0 { "everyone" } else { "its group" }
            ));
        }
        if policy == TrustPolicy::System && m.uid() != 0 {
            return Some(format!("{what} is not owned by root"));
        }
    }
    None
}

/// The file names of inferd's own strategy libraries: with `Isolate::ThirdParty` these run in
/// the daemon, every other library in a helper process.
pub const BUILT_IN: [&str; 5] = [
    "libinferd_greedy.so",
    "libinferd_nucleus.so",
    "libinferd_min_p.so",
    "libinferd_beam.so",
    "libinferd_speculative.so",
];

/// Which libraries run in a helper process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isolate {
    /// Every library but inferd's own (`BUILT_IN`).
    ThirdParty,
    All,
    /// None: every library is loaded into the daemon.
    None,
}

/// A strategy ready to serve requests.
#[derive(Debug)]
pub struct LoadedStrategy {
    pub info: StrategyInfo,
    pub plugin_name: String,
    pub plugin_version: String,
    /// The minor ABI version the plugin was built for (what it knows of the session init).
    pub abi_minor: u32,
    pub path: PathBuf,
    /// Where its calls run.
    pub runner: Runner,
    failures: AtomicU32,
}

impl LoadedStrategy {
    pub fn name(&self) -> &str {
        &self.info.name
    }

    /// Whether it runs in a helper process.
    pub fn isolated(&self) -> bool {
        matches!(self.runner, Runner::Isolated { .. })
    }

    /// Why it serves no more requests, if it does not.
    pub fn quarantine(&self) -> Option<String> {
        if let Some(f) = self.runner.faulted() {
            return Some(f);
        }
        (self.failures.load(Ordering::Relaxed) >= QUARANTINE_AFTER)
            .then(|| format!("{QUARANTINE_AFTER} consecutive requests failed in it"))
    }

    pub fn quarantined(&self) -> bool {
        self.quarantine().is_some()
    }

    /// Counts a request that failed inside the plugin.
    pub fn failed(&self) {
        self.failures.fetch_add(1, Ordering::Relaxed);
    }

    /// A request went through: the failure streak ends.
    pub fn succeeded(&self) {
        self.failures.store(0, Ordering::Relaxed);
    }
}

/// Every loaded strategy, by name, and where new libraries run.
#[derive(Debug)]
pub struct Registry {
    strategies: Vec<Arc<LoadedStrategy>>,
    isolate: Isolate,
    isolation: Option<Isolation>,
}

/// Every library in the daemon's process: `inferd run`, the tests, embedding programs.
impl Default for Registry {
    fn default() -> Self {
        Registry { strategies: Vec::new(), isolate: Isolate::None, isolation: None }
    }
}

impl Registry {
    /// An empty registry that runs the libraries `isolate` names in helper processes.
    pub fn isolating(isolate: Isolate, isolation: Isolation) -> Registry {
        Registry { strategies: Vec::new(), isolate, isolation: Some(isolation) }
    }

    /// Loads every `*.so` in `dirs` (missing directories are skipped), all in this process.
    /// Returns the registry and one line per refused file naming it and why; a refused file
    /// never stops the others.
    pub fn load_dirs(dirs: &[PathBuf], policy: TrustPolicy) -> (Registry, Vec<String>) {
        let mut reg = Registry::default();
        let refused = reg.load_dirs_into(dirs, policy);
        (reg, refused)
    }

    /// Loads every `*.so` in `dirs` into this registry; one line per refused file.
    pub fn load_dirs_into(&mut self, dirs: &[PathBuf], policy: TrustPolicy) -> Vec<String> {
        let mut refused = Vec::new();
        for dir in dirs {
            let Ok(entries) = std::fs::read_dir(dir) else { continue };
            let mut files: Vec<PathBuf> = entries
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "so"))
                .collect();
            files.sort();
            for f in files {
                if let Err(e) = self.load_file(&f, policy) {
                    refused.push(e.to_string());
                }
            }
        }
        refused
    }

    /// Whether the library at `path` runs in a helper process.
    fn isolates(&self, path: &Path) -> bool {
        let own = path.file_name().and_then(|n| n.to_str()).is_some_and(|n| BUILT_IN.contains(&n));
        match self.isolate {
            Isolate::None => false,
            Isolate::All => true,
            Isolate::ThirdParty => !own,
        }
    }

    /// Loads one plugin file, in this process or in a helper; its strategies join the
    /// registry unless a name is taken.
    pub fn load_file(&mut self, path: &Path, policy: TrustPolicy) -> Result<Declared, PluginError> {
        let refuse = |why: String| PluginError::Refused { path: path.to_owned(), why };
        if let Some(why) = untrusted(path, policy) {
            return Err(refuse(why));
        }
        if let Some(why) = self.isolation.as_ref().and_then(|i| i.quarantine.as_ref()).and_then(|q| q.check(path)) {
            return Err(refuse(why));
        }
        match &self.isolation {
            Some(iso) if self.isolates(path) => {
                let (helper, decl) = isolated::Helper::spawn(path, iso).map_err(refuse)?;
                let runners = (0..decl.strategies.len() as u32)
                    .map(|index| Runner::Isolated { helper: Arc::clone(&helper), index })
                    .collect();
                self.add_runners(decl, runners, path)
            }
            _ => {
                let decl = loader::load(path).map_err(refuse)?;
                self.add(decl, path)
            }
        }
    }

    /// Adds the strategies of a declaration (from [`loader::load`] or [`loader::declare`]),
    /// to run in this process, unless a name is taken.
    pub fn add(&mut self, decl: Declaration, path: &Path) -> Result<Declared, PluginError> {
        let runners = decl.strategies.iter().map(|s| Runner::InProcess(s.fns)).collect();
        self.add_runners(decl.declared(), runners, path)
    }

    fn add_runners(&mut self, decl: Declared, runners: Vec<Runner>, path: &Path) -> Result<Declared, PluginError> {
        let refuse = |why: String| PluginError::Refused { path: path.to_owned(), why };
        if let Some(s) = decl.strategies.iter().find(|s| self.find(&s.name).is_some()) {
            let other = self.find(&s.name).map(|o| o.path.display().to_string()).unwrap_or_default();
            return Err(refuse(format!("strategy {:?} is already provided by {other}", s.name)));
        }
        for (s, runner) in decl.strategies.iter().zip(runners) {
            self.strategies.push(Arc::new(LoadedStrategy {
                info: s.clone(),
                plugin_name: decl.name.clone(),
                plugin_version: decl.version.clone(),
                abi_minor: decl.abi_minor,
                path: path.to_owned(),
                runner,
                failures: AtomicU32::new(0),
            }));
        }
        Ok(decl)
    }

    fn find(&self, name: &str) -> Option<&Arc<LoadedStrategy>> {
        self.strategies.iter().find(|s| s.name() == name)
    }

    /// The strategy called `name`, unless unknown or quarantined.
    pub fn get(&self, name: &str) -> Result<Arc<LoadedStrategy>, PluginError> {
        let s = self.find(name).ok_or_else(|| PluginError::UnknownStrategy {
            name: name.to_owned(),
            available: self.names().join(", "),
        })?;
        if let Some(why) = s.quarantine() {
            return Err(PluginError::Quarantined(name.to_owned(), why));
        }
        Ok(Arc::clone(s))
    }

    pub fn names(&self) -> Vec<String> {
        self.strategies.iter().map(|s| s.name().to_owned()).collect()
    }

    pub fn strategies(&self) -> &[Arc<LoadedStrategy>] {
        &self.strategies
    }
}
