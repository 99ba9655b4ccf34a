//! Where inferd looks for things when no flag says: the default model and its directories, the
//! plugin directories, the cache of compiled GPU kernels.

use std::path::PathBuf;

/// File name of the default model, as `packaging/fetch-model` installs it.
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// Model directories, most specific first: `$INFERD_MODEL_DIR`, the user's data directory
/// (`$XDG_DATA_HOME/inferd/models`), then the system store `/var/lib/inferd/models`.
pub fn model_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Some(d) = std::env::var_os("INFERD_MODEL_DIR") {
        dirs.push(PathBuf::from(d));
    }
    let data = std::env::var_os("XDG_DATA_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local/share")));
    if let Some(d) = data {
        dirs.push(d.join("inferd/models"));
    }
    dirs.push(PathBuf::from("/var/lib/inferd/models"));
    dirs
}

/// The default model's path, if it is installed in one of [`model_dirs`].
pub fn default_model() -> Option<PathBuf> {
    model_dirs().into_iter().map(|d| d.join(DEFAULT_MODEL_FILE)).find(|p| p.exists())
}

/// Plugin directories: `explicit` when given, else `$INFERD_PLUGIN_DIR`, the directory of the
/// running executable unless it is a system bin directory (a build tree: `cargo build` puts
/// the plugins next to `inferd`), the
/// user's `$XDG_DATA_HOME/inferd/plugins` and the system's `/usr/lib/inferd/plugins`.
pub fn plugin_dirs(explicit: &[PathBuf]) -> Vec<PathBuf> {
    if !explicit.is_empty() {
        return explicit.iter().map(|d| std::path::absolute(d).unwrap_or_else(|_| d.clone())).collect();
    }
    let mut dirs = Vec::new();
    if let Some(d) = std::env::var_os("INFERD_PLUGIN_DIR") {
        dirs.push(PathBuf::from(d));
    }
    // The executable's own directory when it is a build tree, not a system bin directory
    // (which holds other shared objects, such as ld.so, that are no plugins).
    if let Some(d) = std::env::current_exe().ok().and_then(|e| e.parent().map(PathBuf::from)) {
        if !["/usr/bin", "/usr/local/bin", "/bin", "/usr/sbin", "/sbin"].iter().any(|b| d == std::path::Path::new(b)) {
            dirs.push(d);
        }
    }
    let data = std::env::var_os("XDG_DATA_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local/share")));
    if let Some(d) = data {
        dirs.push(d.join("inferd/plugins"));
    }
    dirs.push(PathBuf::from("/usr/lib/inferd/plugins"));
    dirs.dedup();
    dirs
}

/// Where compiled GPU kernels are kept: the system service's cache directory
/// (`$CACHE_DIRECTORY`, systemd's `CacheDirectory=inferd`: /var/cache/inferd), else the user's
/// `$XDG_CACHE_HOME/inferd` (`~/.cache/inferd`), else /var/cache/inferd.
pub fn cache_dir() -> PathBuf {
    cache_dir_in(&|k| std::env::var_os(k))
}

/// [`cache_dir`] for the environment `env`.
fn cache_dir_in(env: &dyn Fn(&str) -> Option<std::ffi::OsString>) -> PathBuf {
    service_dir_in(env, ("CACHE_DIRECTORY", "XDG_CACHE_HOME", ".cache", "/var/cache/inferd"))
}

/// Where the daemon keeps what must outlive it (the plugin quarantine and crash record): the
/// system service's state directory (`$STATE_DIRECTORY`, systemd's `StateDirectory=inferd`:
/// /var/lib/inferd), else the user's `$XDG_STATE_HOME/inferd` (`~/.local/state/inferd`), else
/// /var/lib/inferd.
pub fn state_dir() -> PathBuf {
    service_dir_in(&|k| std::env::var_os(k), ("STATE_DIRECTORY", "XDG_STATE_HOME", ".local/state", "/var/lib/inferd"))
}

/// The service's directory (`unit` variable), else the user's (`xdg` variable, or `home_sub`
/// under $HOME) with `inferd` under it, else `fallback`.
fn service_dir_in(
    env: &dyn Fn(&str) -> Option<std::ffi::OsString>,
    (unit, xdg, home_sub, fallback): (&str, &str, &str, &str),
) -> PathBuf {
    if let Some(d) = env(unit).filter(|d| !d.is_empty()) {
        // systemd may list several, colon-separated; the unit names one.
        return std::env::split_paths(&d).next().unwrap_or_default();
    }
    env(xdg)
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .or_else(|| env("HOME").map(|h| PathBuf::from(h).join(home_sub)))
        .map(|d| d.join("inferd"))
        .unwrap_or_else(|| PathBuf::from(fallback))
}

#[cfg(test)]
mod tests {
    use super::cache_dir_in;
    use std::path::PathBuf;

    #[test]
    fn the_kernel_cache_is_the_services_then_the_users() {
        fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<std::ffi::OsString> + 'a {
            move |k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.into())
        }
        let service = [("CACHE_DIRECTORY", "/var/cache/inferd:/x"), ("HOME", "/home/a")];
        assert_eq!(cache_dir_in(&env(&service)), PathBuf::from("/var/cache/inferd"));
        let user = [("XDG_CACHE_HOME", "/c"), ("HOME", "/home/a")];
        assert_eq!(cache_dir_in(&env(&user)), PathBuf::from("/c/inferd"));
        assert_eq!(cache_dir_in(&env(&[("HOME", "/home/a")])), PathBuf::from("/home/a/.cache/inferd"));
        assert_eq!(cache_dir_in(&env(&[])), PathBuf::from("/var/cache/inferd"));
    }
}
