//! The `inferd` command line: `run` (one-shot generation), `tokenize`, `bench`.
//! The daemon (`serve`) and plugin commands arrive with their issues.

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use inferd::chat::{ChatMessage, ChatTemplate};
use inferd::engine::{Engine, EngineOptions};
use inferd::model::Model;
use inferd::tokenizer::stream::StreamDecoder;
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
        prompt: String,
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
    /// Measure prefill and decode speed, TTFT and peak memory; print a JSON report.
    Bench(inferd::bench::BenchArgs),
}

fn model_path(p: Option<PathBuf>) -> Result<PathBuf> {
    match p.or_else(inferd::paths::default_model) {
        Some(p) => Ok(p),
        None => bail!(
            "no --model given and the default model is not installed in any of {:?}; run packaging/fetch-model",
            inferd::paths::model_dirs()
        ),
    }
}

pub(crate) fn load(p: Option<PathBuf>) -> Result<Model> {
    let path = model_path(p)?;
    Model::load(&path).with_context(|| format!("loading {}", path.display()))
}

fn run(model: Option<PathBuf>, max_tokens: usize, chat: bool, threads: usize, prompt: &str) -> Result<()> {
    let model = load(model)?;
    let tok = &model.tokenizer;
    let ids = if chat {
        let bos = tok.bos().map(|b| tok.token_text(b)).unwrap_or_default();
        let eos = tok.eos().first().map(|&e| tok.token_text(e)).unwrap_or_default();
        let tmpl = ChatTemplate::new(model.chat_template.as_deref(), bos, eos)?;
        let text = tmpl.render(&[ChatMessage::new("user", prompt)], true)?;
        tok.encode(&text, true)?
    } else {
        tok.encode(prompt, false)?
    };
    let opts = EngineOptions { threads, ..EngineOptions::default() };
    let mut engine = Engine::cpu(&model, &opts);
    let mut dec = StreamDecoder::new(true);
    let mut out = std::io::stdout().lock();
    let mut write_err = None;
    engine.generate_greedy(&[&ids], max_tokens, tok.eos(), &mut |_, id| {
        if let Ok(piece) = dec.push(tok, id) {
            if let Err(e) = out.write_all(piece.as_bytes()).and_then(|()| out.flush()) {
                write_err.get_or_insert(e);
            }
        }
    })?;
    writeln!(out, "{}", dec.finish())?;
    if let Some(e) = write_err {
        return Err(e.into());
    }
    Ok(())
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Run { model, max_tokens, chat, threads, prompt } => run(model, max_tokens, chat, threads, &prompt),
        Cmd::Tokenize { model, special, text } => {
            let model = load(model)?;
            let ids = model.tokenizer.encode(&text, special)?;
            println!("{}", serde_json::to_string(&ids)?);
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
