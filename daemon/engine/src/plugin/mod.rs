//! Decoder plugins, host side: the registry of loaded strategies, the trust policy for plugin
//! directories, and sessions (one per request) that drive a strategy through the C ABI.
//!
//! - `loader`: opens a library and checks its declaration.
//! - `host`: the callback table and the per-call context.
//! - `session`: create / plan / observe / destroy with every plugin answer checked.
//! - `philox`: the counter-based generator behind the `random` callback.

pub mod host;
pub mod loader;
pub mod philox;
pub mod session;
#[cfg(test)]
pub(crate) mod tests;

pub use loader::{Declaration, StrategyDecl};
pub use session::{Choice, FinishReason, Session, SessionRequest};

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
    #[error("decoding strategy {0:?} is quarantined after {QUARANTINE_AFTER} consecutive failures")]
    Quarantined(String),
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

/// A strategy ready to serve requests.
#[derive(Debug)]
pub struct LoadedStrategy {
    pub decl: StrategyDecl,
    pub plugin_name: String,
    pub plugin_version: String,
    /// The minor ABI version the plugin was built for (what it knows of the session init).
    pub abi_minor: u32,
    pub path: PathBuf,
    failures: AtomicU32,
}

impl LoadedStrategy {
    pub fn name(&self) -> &str {
        &self.decl.name
    }

    pub fn quarantined(&self) -> bool {
        self.failures.load(Ordering::Relaxed) >= QUARANTINE_AFTER
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

/// Every loaded strategy, by name.
#[derive(Debug, Default)]
pub struct Registry {
    strategies: Vec<Arc<LoadedStrategy>>,
}

impl Registry {
    /// Loads every `*.so` in `dirs` (missing directories are skipped). Returns the registry and
    /// one line per refused file naming it and why; a refused file never stops the others.
    pub fn load_dirs(dirs: &[PathBuf], policy: TrustPolicy) -> (Registry, Vec<String>) {
        let mut reg = Registry::default();
        let mut refused = Vec::new();
        for dir in dirs {
            let Ok(entries) = std::fs::read_dir(dir) else { continue };
            let mut files: Vec<PathBuf> = entries
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "so"))
                .collect();
            files.sort();
            for f in files {
                if let Err(e) = reg.load_file(&f, policy) {
                    refused.push(e.to_string());
                }
            }
        }
        (reg, refused)
    }

    /// Loads one plugin file; its strategies join the registry unless a name is taken.
    pub fn load_file(&mut self, path: &Path, policy: TrustPolicy) -> Result<Declaration, PluginError> {
        let refuse = |why: String| PluginError::Refused { path: path.to_owned(), why };
        if let Some(why) = untrusted(path, policy) {
            return Err(refuse(why));
        }
        let decl = loader::load(path).map_err(refuse)?;
        self.add(decl, path)
    }

    /// Adds the strategies of a declaration (from [`loader::load`] or [`loader::declare`])
    /// unless a name is taken.
    pub fn add(&mut self, decl: Declaration, path: &Path) -> Result<Declaration, PluginError> {
        let refuse = |why: String| PluginError::Refused { path: path.to_owned(), why };
        if let Some(s) = decl.strategies.iter().find(|s| self.find(&s.name).is_some()) {
            let other = self.find(&s.name).map(|o| o.path.display().to_string()).unwrap_or_default();
            return Err(refuse(format!("strategy {:?} is already provided by {other}", s.name)));
        }
        for s in &decl.strategies {
            self.strategies.push(Arc::new(LoadedStrategy {
                decl: s.clone(),
                plugin_name: decl.name.clone(),
                plugin_version: decl.version.clone(),
                abi_minor: decl.abi_minor,
                path: path.to_owned(),
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
        if s.quarantined() {
            return Err(PluginError::Quarantined(name.to_owned()));
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
