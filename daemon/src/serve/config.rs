//! The daemon's configuration: `inferd.toml` (TOML through `serde` + `toml`), its defaults and
//! the two modes. `--system` reads `/etc/inferd/inferd.toml` and serves `/run/inferd/inferd.sock`
//! on the system bus; `--user` (the default when not root) reads
//! `$XDG_CONFIG_HOME/inferd/inferd.toml` and serves `$XDG_RUNTIME_DIR/inferd/inferd.sock` on the
//! session bus. A missing file means the defaults; an unknown key is an error that names the key
//! and the file. Command-line flags override the file. The commented default is
//! `packaging/inferd.toml`; a test keeps it parsing to exactly [`Config::default`].

use inferd_engine::backend::BackendKind;
use serde::Deserialize;
use std::path::{Path, PathBuf};

/// Which daemon this is: the system's (root, system bus) or one user's (session bus).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    System,
    User,
}

impl Mode {
    /// `--system` / `--user`, else system for root and user for everyone else.
    pub fn resolve(system: bool, user: bool) -> Mode {
        match (system, user) {
            (true, _) => Mode::System,
            (_, true) => Mode::User,
            _ if effective_uid() == Some(0) => Mode::System,
            _ => Mode::User,
        }
    }

    /// The config file read when `--config` is not given.
    pub fn config_path(self) -> PathBuf {
        match self {
            Mode::System => PathBuf::from("/etc/inferd/inferd.toml"),
            Mode::User => {
                let base = std::env::var_os("XDG_CONFIG_HOME")
                    .map(PathBuf::from)
                    .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".config")));
                base.unwrap_or_else(|| PathBuf::from(".config")).join("inferd/inferd.toml")
            }
        }
    }

    /// The socket served when neither the config nor `--socket` names one.
    pub fn default_socket(self) -> PathBuf {
        match self {
            Mode::System => PathBuf::from("/run/inferd/inferd.sock"),
            Mode::User => inferctl::client::user_socket(),
        }
    }
}

/// The effective uid of this process (the owner of its `/proc/self` entry).
pub fn effective_uid() -> Option<u32> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self").ok().map(|m| m.uid())
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub server: Server,
    pub scheduler: Scheduler,
    pub limits: Limits,
    /// Plugin directories searched for decoding strategies (empty: the built-in search path).
    pub plugin_dirs: Vec<PathBuf>,
    pub plugins: Plugins,
    /// The models to load, one engine thread each; empty means the default model.
    #[serde(rename = "model")]
    pub models: Vec<ModelConfig>,
    /// The `[[model]]` entries served by an upstream server (`upstream = "..."`), taken out of
    /// `models` when the file is read.
    #[serde(skip)]
    pub remotes: Vec<RemoteConfig>,
}

/// A model served by an OpenAI-compatible server elsewhere.
#[derive(Clone, Debug, PartialEq)]
pub struct RemoteConfig {
    /// The name requests use.
    pub name: String,
    /// The server's OpenAI base URL ("https://host:port/v1").
    pub upstream: String,
    /// A file holding the upstream's API key (sent as a bearer token).
    pub key_file: Option<PathBuf>,
    /// The model's name at the upstream (default: `name`).
    pub upstream_model: String,
    /// A local model that answers instead while the upstream is unreachable or failing.
    pub fallback: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Server {
    /// The Unix socket (empty: the mode's default).
    pub socket: Option<PathBuf>,
    /// The socket file's permissions, as an octal string ("0660").
    pub socket_mode: String,
    /// The group owning the socket file (empty: the daemon's own group).
    pub socket_group: Option<String>,
    /// An additional HTTP listener on a loopback address ("127.0.0.1:8080"); off by default.
    /// It has no peer credentials: its requests count under the owner of the client's socket
    /// (from /proc/net/tcp), or as `nobody` when it is not listed; they carry no rights.
    pub tcp: Option<String>,
    /// Host names, besides the loopback ones, that requests to the TCP listener may name in
    /// `Host` (a name the machine's own DNS maps to 127.0.0.1, say).
    pub tcp_hosts: Vec<String>,
    /// Web origins ("http://localhost:3000") whose pages may call the TCP listener from a
    /// browser (CORS); any other `Origin` is refused.
    pub cors_origins: Vec<String>,
    /// A file holding a key that TCP requests must present as `Authorization: Bearer KEY`
    /// (empty: none asked).
    pub tcp_key_file: Option<PathBuf>,
    /// Serve `org.inferd.Inference1` on the mode's bus.
    pub dbus: bool,
    /// Compute threads per model; 0 means one per core.
    pub threads: usize,
    /// Seconds in-flight requests get to finish after SIGTERM before they are cancelled.
    pub shutdown_grace_secs: u64,
    /// How long a model no request uses stays loaded (Ollama's `keep_alive`: "5m", "1h", "0",
    /// "-1" for as long as the daemon runs).
    pub keep_alive: String,
    /// The model store: every GGUF file and Hugging Face directory in it is served, loaded on
    /// first use (empty: `$XDG_DATA_HOME/inferd/models` for a user's daemon,
    /// `/var/lib/inferd/models` for the system's).
    pub model_store: Option<PathBuf>,
    /// Memory for the loaded models' weights and KV caches together, in MiB, per device
    /// (0: no limit). Loading a model that would not fit unloads the least recently used idle
    /// ones first.
    pub memory_budget_mib: u64,
    /// Under socket activation, how long the daemon stays with no model loaded, no request and
    /// no connection before it exits (the socket starts it again on the next connection); "0"
    /// never.
    pub idle_exit: String,
    /// Who may install, replace, remove and unload models, and set how long they stay loaded:
    /// user names and `@group` names. Root and the daemon's own user always may; the other
    /// users of the socket may only use the models.
    pub manage: Vec<String>,
    /// The model a request that names none gets (empty: the first `[[model]]` entry, else the
    /// store's model when it holds exactly one).
    pub default_model: Option<String>,
    /// The largest model file the daemon installs into its store, in GiB.
    pub max_model_gib: u64,
    /// Where `/infill` puts the text typed at the cursor: "llama-server" (its prompt, token
    /// for token) or "typed-after-middle" (after the middle token, where the prefix cache
    /// keeps everything before it while a line is typed).
    pub infill_layout: super::fim::Layout,
    /// Fetch `http(s)` image URLs in requests (off: only `data:` URLs and inline images are
    /// taken, since the daemon would fetch for whoever can reach its socket).
    pub fetch_images: bool,
}

impl Default for Server {
    fn default() -> Self {
        Server {
            socket: None,
            socket_mode: "0660".into(),
            socket_group: None,
            tcp: None,
            tcp_hosts: Vec::new(),
            cors_origins: Vec::new(),
            tcp_key_file: None,
            dbus: true,
            threads: 0,
            shutdown_grace_secs: 10,
            keep_alive: "5m".into(),
            model_store: None,
            memory_budget_mib: 0,
            idle_exit: "10m".into(),
            manage: vec!["@inferd-admin".into()],
            default_model: None,
            max_model_gib: 256,
            infill_layout: super::fim::Layout::LlamaServer,
            fetch_images: false,
        }
    }
}

/// Which decoding-strategy libraries run in a sandboxed helper process.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum IsolateSetting {
    /// Every library but inferd's own five.
    #[default]
    ThirdParty,
    All,
    None,
}

#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Plugins {
    /// Which libraries run in a helper process: "third-party", "all" or "none".
    pub isolate: IsolateSetting,
    /// How long one call into an isolated library may run, in milliseconds; past it the
    /// helper is killed, its requests fail and the library is quarantined.
    pub call_timeout_ms: u64,
    /// An isolated library's address-space limit, in MiB.
    pub memory_limit_mib: u64,
}

impl Default for Plugins {
    fn default() -> Self {
        Plugins { isolate: IsolateSetting::ThirdParty, call_timeout_ms: 1000, memory_limit_mib: 1024 }
    }
}

impl Plugins {
    pub fn isolate(&self) -> inferd_engine::plugin::Isolate {
        use inferd_engine::plugin::Isolate;
        match self.isolate {
            IsolateSetting::ThirdParty => Isolate::ThirdParty,
            IsolateSetting::All => Isolate::All,
            IsolateSetting::None => Isolate::None,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Scheduler {
    /// Tokens per engine step, decode tokens and prompt chunks together.
    pub token_budget: usize,
    /// Requests running at once per model.
    pub max_running: usize,
    /// Seconds a model's engine stays idle before the memory of its free KV blocks goes back
    /// to the system (their cached prefixes are forgotten); 0 never.
    pub kv_release_secs: u64,
}

impl Default for Scheduler {
    fn default() -> Self {
        Scheduler { token_budget: 512, max_running: 64, kv_release_secs: 60 }
    }
}

#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// Requests one user (peer uid) may have in flight at once; more get 429.
    pub max_requests_per_user: usize,
    /// Most new tokens one request may ask for (also capped by the context length).
    pub max_tokens: u32,
    /// Connections one user (peer uid; on loopback TCP the client socket's owner) may hold
    /// open at once; the next gets a 503 and is closed.
    pub max_connections_per_user: usize,
    /// Seconds a client has to send a request's headers, and again its body; also how long an
    /// idle keep-alive connection stays open.
    pub request_timeout_secs: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { max_requests_per_user: 16, max_tokens: 4096, max_connections_per_user: 64, request_timeout_secs: 30 }
    }
}

#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// A GGUF file or a Hugging Face directory (none for a remote model).
    #[serde(default)]
    pub path: PathBuf,
    /// An OpenAI-compatible server that serves this model instead ("http://host:port/v1").
    pub upstream: Option<String>,
    /// A file holding the upstream's API key, readable only by the daemon's user.
    pub upstream_key_file: Option<PathBuf>,
    /// The model's name at the upstream (default: `name`).
    pub upstream_model: Option<String>,
    /// For a remote model: a local model that answers while the upstream is down.
    pub fallback: Option<String>,
    /// The name requests use (default: the model's own name).
    pub name: Option<String>,
    /// Memory for this model's KV cache, in MiB.
    #[serde(default = "default_kv_mib")]
    pub kv_cache_mib: usize,
    /// Caps the model's context length (0: the model's own); see `Model::limit_context`.
    #[serde(default)]
    pub context_len: usize,
    /// A draft model (same vocabulary) bound to this one for speculative decoding.
    pub draft: Option<PathBuf>,
    /// A vision projector (`mmproj-*.gguf`) paired with this model: requests may then hold
    /// images.
    pub mmproj: Option<PathBuf>,
    /// Where the model runs: "auto", "cpu" or "cuda".
    #[serde(default = "default_backend")]
    pub backend: String,
    /// Where its draft model runs (default: as `backend`).
    pub draft_backend: Option<String>,
    /// A Jinja chat template file used instead of the model's own (llama-server's
    /// `--chat-template-file`, Ollama's `TEMPLATE`).
    pub chat_template: Option<PathBuf>,
    /// This model's `keep_alive` (default: `server.keep_alive`).
    pub keep_alive: Option<String>,
    /// Whether requests of different users reuse each other's cached prompt prefixes
    /// (default: yes for a user's daemon, no for the system's, where one user could time
    /// another's prompts).
    pub share_prefix_cache: Option<bool>,
}

fn default_kv_mib() -> usize {
    512
}

fn default_backend() -> String {
    "auto".into()
}

impl ModelConfig {
    /// `path` with every other key at its default (`--model`, or no model configured).
    pub fn for_path(path: PathBuf) -> ModelConfig {
        ModelConfig {
            path,
            upstream: None,
            upstream_key_file: None,
            upstream_model: None,
            fallback: None,
            name: None,
            kv_cache_mib: default_kv_mib(),
            context_len: 0,
            draft: None,
            mmproj: None,
            backend: default_backend(),
            draft_backend: None,
            chat_template: None,
            keep_alive: None,
            share_prefix_cache: None,
        }
    }

    /// The backend this model asks for (checked when the config is read).
    pub fn backend_kind(&self) -> BackendKind {
        BackendKind::parse(&self.backend).unwrap_or_default()
    }

    /// The backend its draft model asks for (checked when the config is read).
    pub fn draft_backend_kind(&self) -> BackendKind {
        self.draft_backend.as_deref().and_then(BackendKind::parse).unwrap_or_else(|| self.backend_kind())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("{path}: {message}")]
    Invalid { path: PathBuf, message: String },
}

impl Config {
    /// Reads `path`; a missing file gives the defaults when `required` is false.
    pub fn load(path: &Path, required: bool) -> Result<Config, ConfigError> {
        match std::fs::read_to_string(path) {
            Ok(text) => Config::parse(&text, path),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && !required => Ok(Config::default()),
            Err(source) => Err(ConfigError::Read { path: path.to_owned(), source }),
        }
    }

    /// Parses the text of `path` (named in errors) and checks the values.
    pub fn parse(text: &str, path: &Path) -> Result<Config, ConfigError> {
        // toml's message names the unknown key and shows the line it is on.
        let mut cfg: Config = toml::from_str(text)
            .map_err(|e| ConfigError::Parse { path: path.to_owned(), message: e.to_string().trim_end().to_owned() })?;
        let invalid = |message: String| ConfigError::Invalid { path: path.to_owned(), message };
        let (remote, local): (Vec<ModelConfig>, Vec<ModelConfig>) =
            std::mem::take(&mut cfg.models).into_iter().partition(|m| m.upstream.is_some());
        cfg.models = local;
        for m in remote {
            let (Some(upstream), Some(name)) = (m.upstream.clone(), m.name.clone()) else {
                return Err(invalid("a model with an upstream needs a name".into()));
            };
            if !m.path.as_os_str().is_empty() {
                return Err(invalid(format!("model {name}: a path and an upstream; give one")));
            }
            if !(upstream.starts_with("http://") || upstream.starts_with("https://")) {
                return Err(invalid(format!(
                    "model {name}: upstream must be an http:// or https:// URL, not {upstream:?}"
                )));
            }
            cfg.remotes.push(RemoteConfig {
                upstream_model: m.upstream_model.clone().unwrap_or_else(|| name.clone()),
                upstream: upstream.trim_end_matches('/').to_owned(),
                key_file: m.upstream_key_file.clone(),
                fallback: m.fallback.clone(),
                name,
            });
        }
        if let Some(m) = cfg.models.iter().find(|m| m.path.as_os_str().is_empty()) {
            return Err(invalid(format!(
                "model {}: a path or an upstream is needed",
                m.name.as_deref().unwrap_or("?")
            )));
        }
        cfg.socket_mode().map_err(invalid)?;
        if cfg.scheduler.token_budget == 0 || cfg.scheduler.max_running == 0 {
            return Err(invalid("scheduler.token_budget and scheduler.max_running must be at least 1".into()));
        }
        if cfg.limits.max_requests_per_user == 0 || cfg.limits.max_tokens == 0 {
            return Err(invalid("limits.max_requests_per_user and limits.max_tokens must be at least 1".into()));
        }
        if let Some(m) = cfg.models.iter().find(|m| m.kv_cache_mib == 0) {
            return Err(invalid(format!("model {}: kv_cache_mib must be at least 1", m.path.display())));
        }
        for m in &cfg.models {
            for (key, value) in [("backend", Some(&m.backend)), ("draft_backend", m.draft_backend.as_ref())] {
                if let Some(v) = value.filter(|v| BackendKind::parse(v).is_none()) {
                    return Err(invalid(format!(
                        "model {}: {key} must be \"auto\", \"cpu\" or \"cuda\", not {v:?}",
                        m.path.display()
                    )));
                }
            }
        }
        Ok(cfg)
    }

    /// `server.socket_mode` as permission bits.
    pub fn socket_mode(&self) -> Result<u32, String> {
        let s = self.server.socket_mode.trim_start_matches("0o");
        u32::from_str_radix(s, 8).ok().filter(|m| *m <= 0o777).ok_or_else(|| {
            format!(
                "server.socket_mode must be octal permission bits such as \"0660\", not {:?}",
                self.server.socket_mode
            )
        })
    }
}

/// The gid of group `name` from `/etc/group`.
pub fn group_id(name: &str) -> Option<u32> {
    let text = std::fs::read_to_string("/etc/group").ok()?;
    text.lines().find_map(|l| {
        let mut f = l.split(':');
        (f.next()? == name).then_some(())?;
        f.next()?;
        f.next()?.parse().ok()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_packaged_default_config_is_the_default() {
        let path = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../packaging/inferd.toml"));
        let text = std::fs::read_to_string(path).expect("packaging/inferd.toml");
        let cfg = Config::parse(&text, path).expect("parses");
        assert_eq!(cfg, Config { models: cfg.models.clone(), ..Config::default() });
        assert_eq!(cfg.socket_mode(), Ok(0o660));
    }

    #[test]
    fn the_man_page_documents_every_key_of_the_default_config() {
        let root = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));
        let default = std::fs::read_to_string(root.join("packaging/inferd.toml")).expect("packaging/inferd.toml");
        let man =
            std::fs::read_to_string(root.join("packaging/man/inferd.toml.5")).expect("packaging/man/inferd.toml.5");
        let keys: Vec<&str> = default
            .lines()
            .map(|l| l.trim_start_matches("# ").trim())
            .filter_map(|l| l.split_once(" = ").map(|(k, _)| k))
            .filter(|k| !k.contains(' '))
            .collect();
        assert!(keys.len() >= 14, "{keys:?}");
        for k in keys {
            assert!(man.contains(&format!(".B {k}\n")), "inferd.toml(5) does not document {k}");
        }
    }

    #[test]
    fn unknown_keys_name_the_key_and_the_file() {
        let p = Path::new("/etc/inferd/inferd.toml");
        let e = Config::parse("[server]\nsockett = \"/tmp/x\"\n", p).expect_err("unknown key");
        let msg = e.to_string();
        assert!(msg.contains("/etc/inferd/inferd.toml") && msg.contains("sockett"), "{msg}");
        let e = Config::parse("colour = 1\n", p).expect_err("unknown top-level key").to_string();
        assert!(e.contains("colour"), "{e}");
        let e =
            Config::parse("[[model]]\npath = \"a.gguf\"\nkv_mib = 3\n", p).expect_err("unknown model key").to_string();
        assert!(e.contains("kv_mib"), "{e}");
    }

    #[test]
    fn values_are_checked() {
        let p = Path::new("x.toml");
        assert!(Config::parse("[server]\nsocket_mode = \"0999\"\n", p).is_err());
        assert!(Config::parse("[server]\nsocket_mode = 660\n", p).is_err(), "a number is not the octal string");
        assert!(Config::parse("[scheduler]\ntoken_budget = 0\n", p).is_err());
        assert!(Config::parse("[limits]\nmax_requests_per_user = 0\n", p).is_err());
        let cfg = Config::parse("[server]\nsocket_mode = \"0600\"\n[[model]]\npath = \"/m/a.gguf\"\nname = \"a\"\ndraft = \"/m/b.gguf\"\n[[model]]\npath = \"/m/c\"\n", p).expect("valid");
        assert_eq!(cfg.socket_mode(), Ok(0o600));
        assert_eq!(cfg.models.len(), 2);
        assert_eq!(cfg.models[0].draft.as_deref(), Some(Path::new("/m/b.gguf")));
        assert_eq!(cfg.models[1].kv_cache_mib, 512);
        assert!(Config::load(Path::new("/nonexistent/inferd.toml"), false).is_ok());
        assert!(Config::load(Path::new("/nonexistent/inferd.toml"), true).is_err());
    }

    #[test]
    fn group_ids_come_from_etc_group() {
        assert_eq!(group_id("root"), Some(0));
        assert_eq!(group_id("no-such-group-here"), None);
    }

    #[test]
    fn a_model_with_an_upstream_is_remote_and_needs_a_name_and_no_path() {
        let p = Path::new("inferd.toml");
        let cfg = Config::parse(
            "[[model]]\nname = \"big\"\nupstream = \"https://gpu:8000/v1/\"\n\n[[model]]\npath = \"/m.gguf\"\n",
            p,
        )
        .unwrap();
        assert_eq!(cfg.models.len(), 1);
        assert_eq!(
            cfg.remotes,
            [RemoteConfig {
                name: "big".into(),
                upstream: "https://gpu:8000/v1".into(),
                key_file: None,
                upstream_model: "big".into(),
                fallback: None,
            }]
        );
        for (text, why) in [
            ("[[model]]\nupstream = \"http://h/v1\"\n", "needs a name"),
            ("[[model]]\nname = \"x\"\npath = \"/m\"\nupstream = \"http://h/v1\"\n", "a path and an upstream"),
            ("[[model]]\nname = \"x\"\nupstream = \"ftp://h\"\n", "http:// or https://"),
            ("[[model]]\nname = \"x\"\n", "a path or an upstream is needed"),
        ] {
            let e = Config::parse(text, p).unwrap_err().to_string();
            assert!(e.contains(why), "{text}: {e}");
        }
    }
}
