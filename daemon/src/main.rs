//! The `inferd` command line: `run` (one-shot generation through a decoder plugin), `tokenize`,
//! `bench`, `plugin check` and `plugin probe`. The daemon (`serve`) arrives with its issue.

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use inferd_engine::chat::{ChatMessage, ChatTemplate};
use inferd_engine::decode::store::{EngineStore, MockStore};
use inferd_engine::decode::{generate, generate_with_stats};
use inferd_engine::engine::{Engine, EngineOptions};
use inferd_engine::model::Model;
use inferd_engine::plugin::{Registry, Session, SessionRequest, TrustPolicy};
use inferd_engine::tokenizer::stream::StreamDecoder;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;

#[derive(Parser)]
#[command(name = "inferd", version, about = "Local LLM inference service")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Generate text from a prompt in-process (no daemon), streaming it to stdout.
    Run {
        /// GGUF file or Hugging Face directory (default: the installed default model).
        #[arg(long)]
        model: Option<PathBuf>,
        /// Most tokens to generate.
        #[arg(long, default_value_t = 128)]
        max_tokens: usize,
        /// Wrap the prompt as a user message in the model's chat template.
        #[arg(long)]
        chat: bool,
        /// Compute threads (default: all cores).
        #[arg(long, default_value_t = 0)]
        threads: usize,
        /// Decoding strategy (a loaded plugin's strategy name).
        #[arg(long, default_value = "greedy")]
        decoder: String,
        /// The strategy's parameters as a JSON object.
        #[arg(long, default_value = "{}")]
        params: String,
        /// Seed of the random draws (default: a random one).
        #[arg(long)]
        seed: Option<u64>,
        /// A draft model (same vocabulary) for `--decoder speculative --params '{"drafter": "model"}'`.
        #[arg(long)]
        draft_model: Option<PathBuf>,
        #[command(flatten)]
        plugins: PluginDirs,
        prompt: String,
    },
    /// Serve the model to local applications on a Unix socket (OpenAI-compatible HTTP).
    Serve {
        /// The configuration file (default: /etc/inferd/inferd.toml with --system,
        /// $XDG_CONFIG_HOME/inferd/inferd.toml with --user; missing means the defaults).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Serve this model alone (no model store, no configured models).
        #[arg(long)]
        model: Option<PathBuf>,
        /// Socket path (default: $XDG_RUNTIME_DIR/inferd/inferd.sock with --user,
        /// /run/inferd/inferd.sock with --system).
        #[arg(long)]
        socket: Option<PathBuf>,
        /// Compute threads per model (default: the config's, else one per core).
        #[arg(long)]
        threads: Option<usize>,
        /// The system daemon: system config, /run/inferd socket, system bus, root-owned plugins.
        #[arg(long, conflicts_with = "user")]
        system: bool,
        /// A user's daemon (the default when not root): user config, $XDG_RUNTIME_DIR, session bus.
        #[arg(long)]
        user: bool,
        #[command(flatten)]
        plugins: PluginDirs,
    },
    /// Install a model into the model store: hf:ORG/REPO[:QUANT] (a GGUF file of a Hugging
    /// Face repository, checked against the hub's size and SHA-256; $HF_ENDPOINT, $HF_TOKEN) or
    /// an https:// URL. An interrupted pull resumes where it stopped. The daemon lists the model
    /// at its next look at the store and loads it on first use. This writes the directory
    /// itself (as root, or a user into their own store); `inferctl pull` installs through the
    /// running daemon. A repository's vision projector (mmproj, F16 preferred) comes along as
    /// NAME.mmproj.gguf, which the store pairs with NAME.gguf.
    Pull {
        reference: String,
        /// The file's SHA-256 in hex, checked before it is installed (a hub's is checked anyway).
        #[arg(long)]
        sha256: Option<String>,
        /// The store (default: the config's server.model_store, else /var/lib/inferd/models
        /// with --system, $XDG_DATA_HOME/inferd/models with --user).
        #[arg(long)]
        store: Option<PathBuf>,
        /// The configuration file whose model store to use.
        #[arg(long)]
        config: Option<PathBuf>,
        /// The system daemon's store.
        #[arg(long, conflicts_with = "user")]
        system: bool,
        /// The user's store (the default when not root).
        #[arg(long)]
        user: bool,
    },
    /// Write a model as a Hugging Face directory (config.json, model.safetensors,
    /// tokenizer.json), dequantized to --dtype.
    Export {
        #[arg(long)]
        model: Option<PathBuf>,
        /// f32, f16 or bf16.
        #[arg(long, default_value = "f16")]
        dtype: String,
        out: PathBuf,
    },
    /// Write the man pages generated from the command-line definitions, inferd(8) and
    /// inferctl(1), into DIR (packaging/man holds them; a test keeps them current).
    #[command(hide = true)]
    Man { dir: PathBuf },
    /// The helper process of an isolated plugin library, started by the daemon with its
    /// socket and logits memory as standard input and output; not for people.
    #[command(hide = true, name = "plugin-host")]
    PluginHost {
        file: PathBuf,
        #[arg(long)]
        memory_mib: u64,
        #[arg(long)]
        parent: u32,
    },
    /// The helper process that renders chat templates for the daemon, started with its socket
    /// as standard input; not for people.
    #[command(hide = true, name = "template-host")]
    TemplateHost {
        #[arg(long)]
        memory_mib: u64,
        #[arg(long)]
        parent: u32,
    },
    /// Decoder plugins: check a file, probe a strategy.
    Plugin {
        #[command(subcommand)]
        cmd: PluginCmd,
    },
    /// Print the token ids of TEXT as a JSON array.
    Tokenize {
        #[arg(long)]
        model: Option<PathBuf>,
        /// Parse special-token text such as <|im_start|> as the special tokens.
        #[arg(long)]
        special: bool,
        text: String,
    },
    /// Measure prefill and decode speed, TTFT, peak memory and where a decode step goes; print a JSON report.
    Bench(inferd::bench::BenchArgs),
}

#[derive(clap::Args)]
struct PluginDirs {
    /// Directory to load decoder plugins from (repeatable; default: $INFERD_PLUGIN_DIR, the
    /// executable's directory, $XDG_DATA_HOME/inferd/plugins, /usr/lib/inferd/plugins).
    #[arg(long = "plugin-dir")]
    dirs: Vec<PathBuf>,
}

impl PluginDirs {
    fn registry(&self) -> Result<Registry> {
        let dirs = inferd_engine::paths::plugin_dirs(&self.dirs);
        let (reg, refused) = Registry::load_dirs(&dirs, TrustPolicy::User);
        for r in refused {
            eprintln!("inferd: {r}");
        }
        if reg.names().is_empty() {
            bail!("no decoding strategies found in {dirs:?} (build them with `cargo build --release`, or pass --plugin-dir)");
        }
        Ok(reg)
    }
}

#[derive(Subcommand)]
enum PluginCmd {
    /// Load FILE the way the daemon does and print what it declares, or why it is refused.
    Check {
        file: PathBuf,
        /// Apply the system daemon's rules (root-owned, not group- or world-writable).
        #[arg(long)]
        system: bool,
    },
    /// Run one step of strategy NAME against fixed logits DRAWS times and print the empirical
    /// distribution of the drawn token ids as JSON.
    Probe {
        name: String,
        /// The logits, a JSON array of numbers (the vocabulary is its length).
        #[arg(long)]
        logits: String,
        /// Tokens generated so far (for penalties), a JSON array of ids.
        #[arg(long, default_value = "[]")]
        history: String,
        #[arg(long, default_value = "{}")]
        params: String,
        #[arg(long, default_value_t = 10000)]
        draws: u64,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        #[command(flatten)]
        plugins: PluginDirs,
    },
}

fn model_path(p: Option<PathBuf>) -> Result<PathBuf> {
    match p.or_else(inferd_engine::paths::default_model) {
        Some(p) => Ok(p),
        None => bail!(
            "no --model given and the default model is not installed in any of {:?}; run packaging/fetch-model",
            inferd_engine::paths::model_dirs()
        ),
    }
}

pub(crate) fn load(p: Option<PathBuf>) -> Result<Model> {
    let path = model_path(p)?;
    Model::load(&path).with_context(|| format!("loading {}", path.display()))
}

struct RunArgs {
    draft_model: Option<PathBuf>,
    max_tokens: usize,
    chat: bool,
    threads: usize,
    decoder: String,
    params: String,
    seed: Option<u64>,
}

fn run(model: Option<PathBuf>, a: RunArgs, plugins: &PluginDirs, prompt: &str) -> Result<()> {
    let reg = plugins.registry()?;
    let strategy = reg.get(&a.decoder)?;
    let model = load(model)?;
    let tok = &model.tokenizer;
    let ids = if a.chat {
        let bos = tok.bos().map(|b| tok.token_text(b)).unwrap_or_default();
        let eos = tok.eos().first().map(|&e| tok.token_text(e)).unwrap_or_default();
        let tmpl = ChatTemplate::new(model.chat_template.as_deref(), bos, eos)?;
        let text = tmpl.render(&[ChatMessage::new("user", prompt)], true)?;
        tok.encode(&text, true)?
    } else {
        tok.encode(prompt, false)?
    };
    if ids.is_empty() {
        bail!("the prompt is empty");
    }
    let req = SessionRequest {
        logprobs: None,
        prompt: &ids,
        generated: &[],
        params: &a.params,
        max_tokens: u32::try_from(a.max_tokens).unwrap_or(u32::MAX),
        n: 1,
        seed: a.seed.unwrap_or_else(random_seed),
        eos: tok.eos(),
        vocabulary: None,
        grammar: None,
    };
    let mut draft = a.draft_model.map(|p| load(Some(p))).transpose()?;
    if let Some(d) = &mut draft {
        // As the daemon runs a draft: its logits from a cheaper copy, on the target's threads.
        d.cheapen_output_for_drafting(EngineOptions { threads: a.threads, ..EngineOptions::default() }.threads());
        if d.config.vocab != model.config.vocab {
            bail!(
                "the draft model's vocabulary ({}) differs from the model's ({})",
                d.config.vocab,
                model.config.vocab
            );
        }
    }
    // Reject bad parameters before loading anything heavy into the KV cache.
    let roles =
        1 << inferd_plugin_api::abi::ROLE_TARGET | u32::from(draft.is_some()) << inferd_plugin_api::abi::ROLE_DRAFT;
    Session::validate(&strategy, model.config.vocab as u32, roles, &req)?;
    let opts = EngineOptions { threads: a.threads, ..EngineOptions::default() };
    let mut engine = Engine::cpu(&model, &opts)?;
    let draft_opts = EngineOptions { pool: engine.backend.cpu_pool(), ..opts };
    let mut draft_engine = draft.as_ref().map(|d| Engine::cpu(d, &draft_opts)).transpose()?;
    let mut store = match draft_engine.as_mut() {
        Some(d) => EngineStore::with_draft(&mut engine, d),
        None => EngineStore::new(&mut engine),
    };
    let mut dec = StreamDecoder::new(true);
    let mut out = std::io::stdout().lock();
    let mut write_err = None;
    let done = generate_with_stats(&strategy, &mut store, &req, &mut |_, id| {
        if let Ok(piece) = dec.push(tok, id) {
            if let Err(e) = out.write_all(piece.as_bytes()).and_then(|()| out.flush()) {
                write_err.get_or_insert(e);
            }
        }
    })?;
    writeln!(out, "{}", dec.finish())?;
    // What the strategy reported (speculative acceptance, ...), on stderr.
    if !done.stats.is_empty() {
        let s: Vec<String> = done.stats.iter().map(|(k, v)| format!("{k}={v}")).collect();
        eprintln!("inferd: {} {}", strategy.name(), s.join(" "));
    }
    if let Some(e) = write_err {
        return Err(e.into());
    }
    Ok(())
}

/// A seed for a request that did not give one.
fn random_seed() -> u64 {
    let t =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
    t ^ (u64::from(std::process::id()) << 32)
}

fn plugin_check(file: &std::path::Path, system: bool) -> Result<()> {
    let path = std::path::absolute(file)?;
    let mut reg = Registry::default();
    let policy = if system { TrustPolicy::System } else { TrustPolicy::User };
    let decl = reg.load_file(&path, policy)?;
    let strategies: Vec<serde_json::Value> = decl
        .strategies
        .iter()
        .map(|s| {
            serde_json::json!({
                "name": s.name,
                "description": s.description,
                "needs_draft": s.flags & inferd_plugin_api::abi::STRATEGY_NEEDS_DRAFT != 0,
                "params": serde_json::from_str::<serde_json::Value>(&s.params_doc).unwrap_or_default(),
            })
        })
        .collect();
    let report = serde_json::json!({
        "file": path,
        "plugin": decl.name,
        "version": decl.version,
        "abi": format!("{}.{}", inferd_plugin_api::ABI_MAJOR, decl.abi_minor),
        "strategies": strategies,
    });
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}

struct ProbeArgs {
    logits: String,
    history: String,
    params: String,
    draws: u64,
    seed: u64,
}

fn plugin_probe(name: &str, a: ProbeArgs, plugins: &PluginDirs) -> Result<()> {
    let logits: Vec<f32> = serde_json::from_str(&a.logits).context("--logits must be a JSON array of numbers")?;
    let history: Vec<u32> = serde_json::from_str(&a.history).context("--history must be a JSON array of token ids")?;
    if logits.is_empty() {
        bail!("--logits is empty");
    }
    if let Some(t) = history.iter().find(|&&t| t as usize >= logits.len()) {
        bail!("history token {t} is outside the vocabulary of {}", logits.len());
    }
    if a.draws == 0 {
        bail!("--draws must be at least 1");
    }
    let reg = plugins.registry()?;
    let strategy = reg.get(name)?;
    let vocab = logits.len();
    let fixed = logits.clone();
    let mut store = MockStore::new(vocab, Box::new(move |_| fixed.clone()));
    let mut counts: BTreeMap<u32, u64> = BTreeMap::new();
    for i in 0..a.draws {
        // The mock model ignores the prompt; one placeholder token gives the first step a
        // position to return logits for.
        let req = SessionRequest {
            logprobs: None,
            prompt: &[0],
            generated: &history,
            params: &a.params,
            max_tokens: 1,
            n: 1,
            seed: a.seed.wrapping_add(i),
            eos: &[],
            vocabulary: None,
            grammar: None,
        };
        let choices = generate(&strategy, &mut store, &req, &mut |_, _| {})?;
        if let Some(&t) = choices.first().and_then(|c| c.tokens.first()) {
            *counts.entry(t).or_default() += 1;
        }
    }
    let dist: serde_json::Map<String, serde_json::Value> =
        counts.into_iter().map(|(t, c)| (t.to_string(), serde_json::json!(c as f64 / a.draws as f64))).collect();
    println!("{}", serde_json::Value::Object(dist));
    Ok(())
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Run { model, max_tokens, chat, threads, decoder, params, seed, draft_model, plugins, prompt } => {
            run(model, RunArgs { draft_model, max_tokens, chat, threads, decoder, params, seed }, &plugins, &prompt)
        }
        Cmd::Serve { config, model, socket, threads, system, user, plugins } => {
            let mode = inferd::serve::config::Mode::resolve(system, user);
            inferd::serve::run(&inferd::serve::ServeArgs {
                mode,
                config,
                model,
                socket,
                plugin_dirs: plugins.dirs,
                threads,
            })
        }
        Cmd::Pull { reference, sha256, store, config, system, user } => {
            let mode = inferd::serve::config::Mode::resolve(system, user);
            let store = match store {
                Some(s) => s,
                None => {
                    let args = inferd::serve::ServeArgs {
                        mode,
                        config,
                        model: None,
                        socket: None,
                        plugin_dirs: Vec::new(),
                        threads: None,
                    };
                    let cfg = args.config()?;
                    cfg.server.model_store.unwrap_or_else(|| inferd::serve::store::default_dir(mode))
                }
            };
            let mut bar = inferctl::pull::Progress::new(&reference);
            let target = inferctl::pull::Target::Dir(&store);
            // The file is read as a model before it is one.
            let checks = inferctl::pull::Checks { verify: Some(&inferd::serve::store::readable), ..Default::default() };
            // The model, then the vision projector its repository holds (paired by name).
            let pulled = inferctl::pull::locate(&reference, sha256.as_deref()).and_then(|src| {
                inferctl::pull::fetch_with_projector(&src, target, &checks, &mut |d, t| bar.update(d, t))
            });
            bar.finish();
            pulled?.report().iter().for_each(|line| println!("{line}"));
            Ok(())
        }
        Cmd::Export { model, dtype, out } => {
            use inferd_engine::model::export::{export_hf, ExportDtype};
            let dtype = match dtype.as_str() {
                "f32" => ExportDtype::F32,
                "f16" => ExportDtype::F16,
                "bf16" => ExportDtype::BF16,
                other => bail!("--dtype must be f32, f16 or bf16, not {other:?}"),
            };
            let model = load(model)?;
            export_hf(&model, &out, dtype).with_context(|| format!("exporting to {}", out.display()))?;
            println!("{}", out.display());
            Ok(())
        }
        Cmd::Man { dir } => {
            use clap::CommandFactory;
            std::fs::create_dir_all(&dir)?;
            write_man_pages(&dir, Cli::command(), "8")?;
            write_man_pages(&dir, inferctl::Cli::command(), "1")
        }
        Cmd::PluginHost { file, memory_mib, parent } => {
            std::process::exit(inferd_engine::plugin::helper::main(&file, memory_mib, parent))
        }
        Cmd::TemplateHost { memory_mib, parent } => {
            std::process::exit(inferd_engine::template_host::main(memory_mib, parent))
        }
        Cmd::Plugin { cmd: PluginCmd::Check { file, system } } => plugin_check(&file, system),
        Cmd::Plugin { cmd: PluginCmd::Probe { name, logits, history, params, draws, seed, plugins } } => {
            plugin_probe(&name, ProbeArgs { logits, history, params, draws, seed }, &plugins)
        }
        Cmd::Tokenize { model, special, text } => {
            let model = load(model)?;
            let ids = model.tokenizer.encode(&text, special)?;
            println!("{}", serde_json::to_string(&ids)?);
            Ok(())
        }
        Cmd::Bench(args) if args.serving => {
            let model = load(args.model.clone())?;
            let reg = PluginDirs { dirs: args.plugin_dirs.clone() }.registry()?;
            let batching = inferd::serve::bench::run(&model, &reg, args.threads, 8)?;
            let clients =
                inferd::serve::bench_clients::run(&model_path(args.model.clone())?, &model, &reg, args.threads)?;
            let report = serde_json::json!({ "batching": batching, "socket": clients });
            println!("{}", serde_json::to_string_pretty(&report)?);
            Ok(())
        }
        Cmd::Bench(args) if args.kl_divergence.is_some() => {
            let model = load(args.model.clone())?;
            let base = args.kl_divergence.as_deref().context("--kl-divergence names the reference file")?;
            let report = inferd::bench_kl::run(&model, base, args.versus.as_deref(), args.threads, args.chunks)?;
            println!("{}", serde_json::to_string_pretty(&report)?);
            Ok(())
        }
        Cmd::Bench(args) if args.editor => {
            let model = load(args.model.clone())?;
            let draft = args.draft_model.clone().map(|p| load(Some(p))).transpose()?;
            let reg = PluginDirs { dirs: args.plugin_dirs.clone() }.registry()?;
            let report = inferd::bench_editor::run(&model, draft.as_ref(), &reg, args.threads)?;
            println!("{}", serde_json::to_string_pretty(&report)?);
            Ok(())
        }
        Cmd::Bench(args) if args.speculative => {
            let model = load(args.model.clone())?;
            let draft = args.draft_model.clone().map(|p| load(Some(p))).transpose()?;
            let reg = PluginDirs { dirs: args.plugin_dirs.clone() }.registry()?;
            let report = inferd::bench_speculative::run(&model, draft.as_ref(), &reg, args.threads, args.repeat)?;
            println!("{}", serde_json::to_string_pretty(&report)?);
            Ok(())
        }
        Cmd::Bench(args) if args.decoders => {
            let model = load(args.model.clone())?;
            let draft = args.draft_model.clone().map(|p| load(Some(p))).transpose()?;
            let reg = PluginDirs { dirs: args.plugin_dirs.clone() }.registry()?;
            let report = inferd::bench_decoders::run(&model, draft.as_ref(), &reg, args.threads, args.repeat)?;
            println!("{}", serde_json::to_string_pretty(&report)?);
            Ok(())
        }
        Cmd::Bench(args) => {
            let model = load(args.model.clone())?;
            let report = inferd::bench::run(&model, &args)?;
            println!("{}", serde_json::to_string_pretty(&report)?);
            Ok(())
        }
    }
}

/// A man page for `cmd` and one per visible subcommand, git-style (`inferd-serve.8`), into `dir`.
fn write_man_pages(dir: &std::path::Path, cmd: clap::Command, section: &str) -> Result<()> {
    fn walk(dir: &std::path::Path, mut cmd: clap::Command, name: String, section: &str) -> Result<()> {
        cmd = cmd.display_name(name.clone()).bin_name(name.replace('-', " "));
        let subs: Vec<clap::Command> = cmd.get_subcommands().filter(|c| !c.is_hide_set()).cloned().collect();
        let mut out = Vec::new();
        clap_mangen::Man::new(cmd.clone())
            .section(section)
            .manual("inferd")
            .source(concat!("inferd ", env!("CARGO_PKG_VERSION")))
            .render(&mut out)?;
        std::fs::write(dir.join(format!("{name}.{section}")), out)?;
        for sub in subs {
            let sub_name = format!("{name}-{}", sub.get_name());
            walk(dir, sub, sub_name, section)?;
        }
        Ok(())
    }
    let name = cmd.get_name().to_owned();
    walk(dir, cmd, name, section)
}
