//! Builds a [`Tokenizer`] from the vocabulary a GGUF file carries (`tokenizer.ggml.*`).
//!
//! - `gpt2` models: byte-level BPE from the token list and merges, with the pre-tokenizer named
//!   by `tokenizer.ggml.pre` (the same regex cascade the model was trained with).
//! - `llama` models (SentencePiece): BPE whose merges are derived from the token scores, byte
//!   fallback through the `<0xNN>` tokens, `▁` for spaces.
//! - `gemma4` models: BPE over raw UTF-8 from the token list and merges, spaces written `▁`,
//!   the text split at line breaks only (a run of them a token whole where the vocabulary has
//!   it), byte fallback through the `<0xNN>` tokens, a BOS token always (as llama.cpp reads
//!   Gemma 4's files).
//!
//! Control tokens become special added tokens, parsed only when asked; user-defined ones are
//! always matched in the raw text (as llama.cpp does).

use super::fim::FimTokens;
use super::{ByteEncoding, Tokenizer, TokenizerError};
use crate::model::gguf::{Gguf, Value};
use std::collections::HashMap;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::metaspace::{Metaspace, PrependScheme};
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, DecoderWrapper, PreTokenizerWrapper, SplitDelimiterBehavior};

/// The Llama 3 / cl100k pre-tokenizer pattern.
const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// GPT-2's pattern.
const GPT2_PATTERN: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// The o200k (`gpt-4o`: Phi-4-mini, Llama 4) pattern: words split before capitals, each taking
/// its contraction, digits in threes, punctuation taking a following slash or line breaks.
const GPT4O_PATTERN: &str = concat!(
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
);

/// The longest token text a vocabulary may hold. Real ones stay far below (SmolLM2's longest
/// is 162 bytes, Gemma 3's 48); the tokenizer library's build time grows with a special token's
/// length (a 64 KiB one kept it busy for minutes, an 8 KiB one made it panic).
pub const MAX_TOKEN_BYTES: usize = 1024;

fn strings(g: &Gguf, key: &str) -> Result<Vec<String>, TokenizerError> {
    let arr = g.get(key).and_then(Value::as_array).ok_or_else(|| TokenizerError::Invalid(format!("missing {key}")))?;
    arr.iter()
        .map(|v| {
            v.as_str().map(str::to_string).ok_or_else(|| TokenizerError::Invalid(format!("{key} holds a non-string")))
        })
        .collect()
}

fn id(g: &Gguf, key: &str) -> Option<u32> {
    g.get(key).and_then(Value::as_u64).and_then(|v| u32::try_from(v).ok())
}

/// Token texts that end generation wherever a vocabulary has them, as llama.cpp reads them:
/// converters name one end token, but a model also stops with the others it was trained on
/// (Qwen's `<|endoftext|>` ends a completion, `<|im_end|>` a chat turn).
const END_TEXTS: [&str; 14] = [
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<|return|>",
    "<|call|>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
];

/// The tokens that end generation: the metadata's end-of-sequence, end-of-turn and
/// end-of-message tokens first (the first is the template's `eos_token`), then the known end
/// texts and the FIM tokens a model writes after the middle.
fn end_tokens(g: &Gguf, tokens: &[String], fim: &FimTokens) -> Vec<u32> {
    let mut eos: Vec<u32> =
        ["eos", "eot", "eom"].iter().filter_map(|k| id(g, &format!("tokenizer.ggml.{k}_token_id"))).collect();
    let by_text = tokens.iter().enumerate().filter(|(_, t)| END_TEXTS.contains(&t.as_str())).map(|(i, _)| i as u32);
    for t in by_text.chain(fim.ends()) {
        if !eos.contains(&t) {
            eos.push(t);
        }
    }
    // gpt-oss's harmony ends a turn with `<|return|>` or `<|call|>`; its `<|end|>` closes a
    // message inside the turn (the reasoning before the answer), so it must not end
    // generation (llama.cpp reads the vocabulary so too).
    let text = |id: u32| tokens.get(id as usize).map(String::as_str);
    let has = |t: &str| eos.iter().any(|&id| text(id) == Some(t));
    if has("<|return|>") && has("<|call|>") {
        eos.retain(|&id| text(id) != Some("<|end|>"));
    }
    eos
}

fn pre_tokenizer(pre: &str) -> Result<PreTokenizerWrapper, TokenizerError> {
    let byte_level = |regex| PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, false, regex));
    Ok(match pre {
        "gpt2" => byte_level(true),
        // llama.cpp's fallback for a tokenizer its converter did not recognize: runs of
        // punctuation apart, then GPT-2's pattern, digit runs, and digits in threes.
        "default" => {
            let mut steps = Vec::new();
            for pattern in [r"[\p{P}\$\+<=>\^~\|]+", GPT2_PATTERN, r"\p{N}+", "[0-9][0-9][0-9]"] {
                let split = Split::new(SplitPattern::Regex(pattern.into()), SplitDelimiterBehavior::Isolated, false)
                    .map_err(|e| TokenizerError::Invalid(e.to_string()))?;
                steps.push(PreTokenizerWrapper::Split(split));
            }
            steps.push(byte_level(false));
            PreTokenizerWrapper::Sequence(Sequence::new(steps))
        }
        "smollm" => PreTokenizerWrapper::Sequence(Sequence::new(vec![
            PreTokenizerWrapper::Digits(Digits::new(true)),
            byte_level(true),
        ])),
        "llama-bpe" | "llama3" | "llama-v3" | "qwen2" | "gpt-4o" | "tekken" => {
            let pattern = match pre {
                // Qwen 2 splits as Llama 3 does, but every digit alone.
                "qwen2" => LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}"),
                "gpt-4o" => GPT4O_PATTERN.into(),
                // Mistral's Tekken (Mistral Nemo, Small 3): o200k's words without the
                // contractions, and every digit alone.
                "tekken" => {
                    GPT4O_PATTERN.replace(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?", "").replace(r"\p{N}{1,3}", r"\p{N}")
                }
                _ => LLAMA3_PATTERN.into(),
            };
            let split = Split::new(SplitPattern::Regex(pattern), SplitDelimiterBehavior::Isolated, false)
                .map_err(|e| TokenizerError::Invalid(e.to_string()))?;
            PreTokenizerWrapper::Sequence(Sequence::new(vec![PreTokenizerWrapper::Split(split), byte_level(false)]))
        }
        other => {
            return Err(TokenizerError::Unsupported(format!(
                "GGUF pre-tokenizer '{other}' (supported: default, gpt2, smollm, llama-bpe, qwen2, gpt-4o, tekken)"
            )))
        }
    })
}

/// Merges for a SentencePiece vocabulary: every split of a token into two known tokens, ranked by
/// the merged token's score (higher first), as SentencePiece's BPE applies them.
fn spm_merges(tokens: &[String], scores: &[f32], normal: &dyn Fn(usize) -> bool) -> Vec<(String, String)> {
    let index: HashMap<&str, usize> = tokens.iter().enumerate().map(|(i, t)| (t.as_str(), i)).collect();
    let mut merges: Vec<(f32, usize, usize, String, String)> = Vec::new();
    for (i, t) in tokens.iter().enumerate() {
        if !normal(i) || t.chars().count() < 2 {
            continue;
        }
        for (cut, _) in t.char_indices().skip(1) {
            let (l, r) = t.split_at(cut);
            if let (Some(&li), Some(&ri)) = (index.get(l), index.get(r)) {
                merges.push((scores.get(i).copied().unwrap_or(0.0), li, ri, l.to_string(), r.to_string()));
            }
        }
    }
    merges.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    merges.into_iter().map(|m| (m.3, m.4)).collect()
}

/// `tokenizer.ggml.merges`, each pair written `a b`.
fn merges(g: &Gguf) -> Result<Vec<(String, String)>, TokenizerError> {
    strings(g, "tokenizer.ggml.merges")?
        .into_iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| TokenizerError::Invalid(format!("merge '{m}' has no space")))
        })
        .collect()
}

impl Tokenizer {
    /// Builds the tokenizer described by a GGUF file's `tokenizer.ggml.*` metadata.
    pub fn from_gguf(g: &Gguf) -> Result<Tokenizer, TokenizerError> {
        let model = g.get("tokenizer.ggml.model").and_then(Value::as_str).unwrap_or("");
        let tokens = strings(g, "tokenizer.ggml.tokens")?;
        if let Some((i, t)) = tokens.iter().enumerate().find(|(_, t)| t.len() > MAX_TOKEN_BYTES) {
            return Err(TokenizerError::Invalid(format!(
                "token {i} is {} bytes long (at most {MAX_TOKEN_BYTES})",
                t.len()
            )));
        }
        let types: Vec<i64> = match g.get("tokenizer.ggml.token_type").and_then(Value::as_array) {
            Some(a) => {
                a.iter().map(|v| if let Value::I64(x) = v { *x } else { v.as_u64().unwrap_or(1) as i64 }).collect()
            }
            None => vec![1; tokens.len()],
        };
        let ty = |i: usize| types.get(i).copied().unwrap_or(1);
        let vocab: tokenizers::models::bpe::Vocab =
            tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
        let mut normalizer = None;
        let (bpe, pre, decoder, enc) = match model {
            "gpt2" => {
                let merges = merges(g)?;
                let pre_name = g.get("tokenizer.ggml.pre").and_then(Value::as_str).unwrap_or("default");
                // As llama.cpp: these take a word that is a token whole, whatever the merges say.
                let ignore_merges = matches!(pre_name, "llama-bpe" | "llama3" | "llama-v3" | "tekken");
                let bpe = BPE::builder().vocab_and_merges(vocab, merges).ignore_merges(ignore_merges).build();
                (
                    bpe,
                    pre_tokenizer(pre_name)?,
                    DecoderWrapper::ByteLevel(ByteLevel::default()),
                    ByteEncoding::ByteLevel,
                )
            }
            "llama" => {
                let scores: Vec<f32> = match g.get("tokenizer.ggml.scores").and_then(Value::as_array) {
                    Some(a) => a.iter().map(|v| v.as_f64().unwrap_or(0.0) as f32).collect(),
                    None => vec![0.0; tokens.len()],
                };
                let merges = spm_merges(&tokens, &scores, &|i| ty(i) == 1);
                let unk = id(g, "tokenizer.ggml.unknown_token_id")
                    .and_then(|i| tokens.get(i as usize))
                    .cloned()
                    .unwrap_or_else(|| "<unk>".into());
                let bpe = BPE::builder().vocab_and_merges(vocab, merges).byte_fallback(true).unk_token(unk).build();
                // SentencePiece's dummy prefix: Llama's models add "▁" before the text, Gemma's not.
                let prefix = g.get("tokenizer.ggml.add_space_prefix").and_then(Value::as_bool).unwrap_or(true);
                let scheme = if prefix { PrependScheme::First } else { PrependScheme::Never };
                let meta = Metaspace::new('\u{2581}', scheme, false);
                (
                    bpe,
                    PreTokenizerWrapper::Metaspace(meta.clone()),
                    DecoderWrapper::Metaspace(meta),
                    ByteEncoding::SentencePiece,
                )
            }
            "gemma4" => {
                // A word that is a token whole is that token (llama.cpp does so for runs of
                // line breaks alone; a word here is a whole line, which the merges spell anyway).
                let bpe = BPE::builder().vocab_and_merges(vocab, merges(g)?).byte_fallback(true).ignore_merges(true);
                let bpe = match id(g, "tokenizer.ggml.unknown_token_id").and_then(|i| tokens.get(i as usize)) {
                    Some(unk) => bpe.unk_token(unk.clone()),
                    None => bpe,
                };
                let lines =
                    Split::new(SplitPattern::Regex("[^\n]+|[\n]+".into()), SplitDelimiterBehavior::Isolated, false)
                        .map_err(|e| TokenizerError::Invalid(e.to_string()))?;
                let space = |from: &str, to: &str| {
                    tokenizers::normalizers::replace::Replace::new(from, to)
                        .map_err(|e| TokenizerError::Invalid(e.to_string()))
                };
                normalizer = Some(tokenizers::NormalizerWrapper::Replace(space(" ", "\u{2581}")?));
                let decoder = tokenizers::decoders::sequence::Sequence::new(vec![
                    DecoderWrapper::Replace(space("\u{2581}", " ")?),
                    DecoderWrapper::ByteFallback(tokenizers::decoders::byte_fallback::ByteFallback::new()),
                    DecoderWrapper::Fuse(tokenizers::decoders::fuse::Fuse::new()),
                ]);
                (
                    bpe.build(),
                    PreTokenizerWrapper::Split(lines),
                    DecoderWrapper::Sequence(decoder),
                    ByteEncoding::SentencePiece,
                )
            }
            other => {
                return Err(TokenizerError::Unsupported(format!(
                    "GGUF tokenizer model '{other}' (supported: gpt2, llama, gemma4)"
                )))
            }
        };
        let bpe = bpe.map_err(|e| TokenizerError::Invalid(e.to_string()))?;
        let mut tk = tokenizers::Tokenizer::new(bpe);
        tk.with_normalizer(normalizer);
        tk.with_pre_tokenizer(Some(pre));
        tk.with_decoder(Some(decoder));
        // Control tokens (3) are special: matched whole, and only when special tokens are
        // parsed. User-defined tokens (4: Gemma's runs of spaces and newlines, HTML tags) are
        // matched in the raw text always, before the model splits it, as llama.cpp does.
        let added = |kind: i64, special: bool| -> Vec<AddedToken> {
            tokens
                .iter()
                .enumerate()
                .filter(|(i, _)| ty(*i) == kind)
                .map(|(_, t)| AddedToken::from(t.clone(), special).normalized(false))
                .collect()
        };
        tk.add_special_tokens(&added(3, true));
        tk.add_tokens(&added(4, false));
        let bos = id(g, "tokenizer.ggml.bos_token_id");
        // llama.cpp adds Gemma 4's BOS whatever the file says.
        let add_bos = model == "gemma4"
            || g.get("tokenizer.ggml.add_bos_token").and_then(Value::as_bool).unwrap_or(model == "llama");
        let fim = FimTokens::find(|k| id(g, &format!("tokenizer.ggml.{k}_token_id")), &tokens);
        let eos = end_tokens(g, &tokens, &fim);
        let add_eos = g.get("tokenizer.ggml.add_eos_token").and_then(Value::as_bool).unwrap_or(false);
        Ok(Tokenizer::assemble(tk, &tokens, enc, bos, add_bos, eos)?.with_eos_appended(add_eos).with_fim(fim))
    }
}
