//! Fill-in-the-middle prompts, built from the model's FIM tokens
//! ([`FimTokens`](inferd_engine::tokenizer::fim::FimTokens)):
//! - [`gap`]: `PRE prefix SUF suffix MID`, what OpenAI's and Ollama's `suffix` mean (Ollama's
//!   code-model templates write exactly this);
//! - [`infill`]: llama-server's `/infill` layout, the repository-level form with the editor's
//!   other files first, each part cut to llama-server's shares so an editor plugin written for
//!   it gets the same prompt here; or ([`Layout::TypedAfterMiddle`], `server.infill_layout`)
//!   the same parts with the text typed at the cursor after the middle token, so that while a
//!   line is typed every request starts with the last one's prompt and the prefix cache holds
//!   all of it but the newly typed characters.
//!
//! The code around the gap is tokenized as text: special-token spellings in a user's file stay
//! text. A model without the tokens is refused by name.

use super::api::ApiError;
use inferd_engine::tokenizer::fim::Fim;
use inferd_engine::tokenizer::Tokenizer;
use serde_json::Value;

/// llama-server's default batch size, which its `/infill` shares the prompt by: the prefix keeps
/// its last three quarters' worth of tokens, the suffix (with the prompt) the last quarter.
pub const INFILL_BATCH: usize = 2048;

/// The model's FIM tokens, or a 400 naming what it lacks (`param`: the field that asked).
pub fn tokens(tok: &Tokenizer, model: &str, param: &'static str) -> Result<Fim, ApiError> {
    tok.fim().fim().map_err(|why| ApiError::bad(format!("model {model} cannot fill in the middle: {why}"), param))
}

fn text(tok: &Tokenizer, s: &str, param: &'static str) -> Result<Vec<u32>, ApiError> {
    tok.encode_bare(s, false).map_err(|e| ApiError::bad(e.to_string(), param))
}

/// The prompt for the gap between `prefix` and `suffix`.
pub fn gap(tok: &Tokenizer, fim: Fim, prefix: &str, suffix: &str) -> Result<Vec<u32>, ApiError> {
    let mut ids: Vec<u32> = if tok.adds_bos() { tok.bos().into_iter().collect() } else { Vec::new() };
    ids.push(fim.prefix);
    ids.extend(text(tok, prefix, "prompt")?);
    ids.push(fim.suffix);
    ids.extend(text(tok, suffix, "suffix")?);
    ids.push(fim.middle);
    Ok(ids)
}

/// Where `/infill` puts the text typed at the cursor (`prompt`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Layout {
    /// llama-server's: `PRE prefix prompt SUF suffix MID`. Each keystroke changes the tokens
    /// before the suffix, so the suffix is read again at every request.
    #[default]
    LlamaServer,
    /// `PRE prefix SUF suffix MID prompt`: the model sees the typed text as the start of the
    /// middle it writes (as it was trained to continue a middle), and a request typed one
    /// character further shares all but its last tokens with the one before.
    TypedAfterMiddle,
}

impl Layout {
    /// Its name in `inferd.toml`.
    pub fn name(self) -> &'static str {
        match self {
            Layout::LlamaServer => "llama-server",
            Layout::TypedAfterMiddle => "typed-after-middle",
        }
    }
}

/// What `/infill` was given, tokenized.
#[derive(Clone, Debug, Default)]
pub struct Infill {
    /// The code before the cursor.
    pub prefix: Vec<u32>,
    /// The code after it.
    pub suffix: Vec<u32>,
    /// Other files as (name, text), most relevant last.
    pub extra: Vec<(String, String)>,
    /// Text the answer starts with (already typed at the cursor).
    pub prompt: Vec<u32>,
}

/// Text given as llama-server takes it: a string, or an array of strings and token ids.
pub fn mixed(tok: &Tokenizer, v: &Value, param: &'static str) -> Result<Vec<u32>, ApiError> {
    let vocab = tok.vocab_size() as u64;
    let bad = || ApiError::bad(format!("{param} must be a string or an array of strings and token ids"), param);
    match v {
        Value::String(s) => text(tok, s, param),
        Value::Array(parts) => {
            let mut ids = Vec::new();
            for p in parts {
                match p {
                    Value::String(s) => ids.extend(text(tok, s, param)?),
                    Value::Number(n) => match n.as_u64().filter(|&t| t < vocab) {
                        Some(t) => ids.push(t as u32),
                        None => {
                            return Err(ApiError::bad(
                                format!("{param} holds {n}, not a token id below {vocab}"),
                                param,
                            ))
                        }
                    },
                    _ => return Err(bad()),
                }
            }
            Ok(ids)
        }
        _ => Err(bad()),
    }
}

/// llama-server's `/infill` prompt: `[REPO]myproject\n` and `[FILE_SEP]name\ntext` per extra
/// file (a `--- snippet ---` line where the vocabulary has no file separator), then
/// `[FILE_SEP]filename\n`, then `[BOS] PRE prefix prompt SUF suffix MID`. The prefix keeps at
/// most its last 1,536 tokens, the suffix its first 510 less the prompt's; the extra files keep
/// their last tokens that fit in `ctx` less a batch and twice `max_tokens`. With
/// [`Layout::TypedAfterMiddle`] the prompt goes after `MID` and the suffix keeps its first 510
/// whatever the prompt's length, so the tokens before the prompt stay the same as it grows.
pub fn infill(
    tok: &Tokenizer,
    fim: Fim,
    i: &Infill,
    layout: Layout,
    ctx: usize,
    max_tokens: usize,
) -> Result<Vec<u32>, ApiError> {
    let extras = |s: &str| text(tok, s, "input_extra");
    let ends = tok.fim();
    let mut extra = Vec::new();
    if let Some(repo) = ends.repo {
        extra.push(repo);
        extra.extend(extras("myproject\n")?);
    }
    for (name, body) in &i.extra {
        match ends.file_sep {
            Some(sep) => {
                extra.push(sep);
                extra.extend(extras(&format!("{name}\n"))?);
            }
            None => extra.extend(extras("\n\n--- snippet ---\n\n")?),
        }
        extra.extend(extras(body)?);
    }
    if let Some(sep) = ends.file_sep {
        extra.push(sep);
        extra.extend(extras("filename\n")?);
    }
    // The typed text goes before `SUF` (taking from the suffix's share) or after `MID`.
    let (before_suffix, after_middle): (&[u32], &[u32]) = match layout {
        Layout::LlamaServer => (&i.prompt, &[]),
        Layout::TypedAfterMiddle => (&[], &i.prompt),
    };
    let prefix_take = i.prefix.len().min(3 * (INFILL_BATCH / 4));
    let suffix_take = i.suffix.len().min((INFILL_BATCH / 4).saturating_sub(2 + before_suffix.len()));
    let extra_take = ctx.saturating_sub(INFILL_BATCH + 2 * max_tokens).min(extra.len());
    let mut ids: Vec<u32> = extra[extra.len() - extra_take..].to_vec();
    if tok.adds_bos() {
        ids.extend(tok.bos());
    }
    ids.push(fim.prefix);
    ids.extend_from_slice(&i.prefix[i.prefix.len() - prefix_take..]);
    ids.extend_from_slice(before_suffix);
    ids.push(fim.suffix);
    ids.extend_from_slice(&i.suffix[..suffix_take]);
    ids.push(fim.middle);
    ids.extend_from_slice(after_middle);
    Ok(ids)
}
