//! Text <-> token ids, with the `tokenizers` crate doing the splitting and merging.
//!
//! A [`Tokenizer`] is built from a Hugging Face `tokenizer.json` or from the vocabulary stored in a
//! GGUF file ([`gguf_vocab`]). Besides encode/decode it keeps the exact byte string of every token
//! ([`Tokenizer::token_bytes`]), which [`stream::StreamDecoder`] uses to stream text without ever
//! emitting a broken UTF-8 sequence.

pub mod fim;
pub mod gguf_vocab;
pub mod literal;
pub mod stream;

use std::collections::HashSet;
use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("unsupported tokenizer: {0}")]
    Unsupported(String),
    #[error("invalid tokenizer data: {0}")]
    Invalid(String),
    #[error("tokenizing failed: {0}")]
    Encode(String),
    #[error("token id {0} is outside the vocabulary")]
    BadId(u32),
}

/// How a vocabulary spells bytes in its token strings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ByteEncoding {
    /// GPT-2 byte-level BPE: every byte is mapped to a printable character.
    ByteLevel,
    /// SentencePiece: `▁` is a space, `<0xNN>` tokens are raw bytes.
    SentencePiece,
}

/// A model's tokenizer.
pub struct Tokenizer {
    /// Splits special-token text (`<|im_start|>`) into its special ids.
    special: tokenizers::Tokenizer,
    /// Treats special-token text as plain text.
    plain: tokenizers::Tokenizer,
    bos: Option<u32>,
    add_bos: bool,
    /// An end token follows every encoded text (an embedding model's `add_eos_token`).
    add_eos: bool,
    eos: Vec<u32>,
    specials: HashSet<u32>,
    /// The special tokens' text, to find in what a user wrote ([`literal`]).
    special_text: literal::SpecialText,
    bytes: Vec<Vec<u8>>,
    /// The fill-in-the-middle tokens the vocabulary has.
    fim: fim::FimTokens,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab", &self.bytes.len())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .finish_non_exhaustive()
    }
}

/// GPT-2's reversible byte -> printable character map.
pub fn byte_to_char() -> [char; 256] {
    let mut map = ['\0'; 256];
    let mut extra = 0u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        map[b as usize] = if printable {
            char::from(b)
        } else {
            extra += 1;
            char::from_u32(255 + extra).unwrap_or('\0')
        };
    }
    map
}

/// The byte string a vocabulary entry stands for.
fn token_to_bytes(token: &str, enc: ByteEncoding, inverse: &std::collections::HashMap<char, u8>) -> Vec<u8> {
    match enc {
        ByteEncoding::ByteLevel => {
            let mapped: Option<Vec<u8>> = token.chars().map(|c| inverse.get(&c).copied()).collect();
            mapped.unwrap_or_else(|| token.as_bytes().to_vec())
        }
        ByteEncoding::SentencePiece => {
            if let Some(hex) = token.strip_prefix("<0x").and_then(|s| s.strip_suffix('>')) {
                if let Ok(b) = u8::from_str_radix(hex, 16) {
                    return vec![b];
                }
            }
            token.replace('\u{2581}', " ").into_bytes()
        }
    }
}

/// The largest `tokenizer.json` read (Gemma 3's is 33 MB).
pub const MAX_TOKENIZER_JSON: u64 = 128 << 20;

/// A `tokenizer.json`'s text, once its size and every token's length are within bounds (the
/// tokenizers library's build time grows with a special token's length: a 64 KiB one kept it
/// busy for minutes).
fn read_bounded_json(path: &Path) -> Result<String, TokenizerError> {
    let bad = |why: String| TokenizerError::Invalid(format!("{}: {why}", path.display()));
    let len = std::fs::metadata(path).map_err(|e| bad(e.to_string()))?.len();
    if len > MAX_TOKENIZER_JSON {
        return Err(bad(format!("{len} bytes (at most {MAX_TOKENIZER_JSON})")));
    }
    let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
    let added = v.get("added_tokens").and_then(|a| a.as_array()).into_iter().flatten();
    let added = added.filter_map(|t| t.get("content").and_then(|c| c.as_str()));
    let vocab = v.pointer("/model/vocab");
    let keys = vocab.and_then(|m| m.as_object()).into_iter().flat_map(|m| m.keys().map(String::as_str));
    // SentencePiece-style models list `[piece, score]` pairs.
    let pieces = vocab.and_then(|a| a.as_array()).into_iter().flatten();
    let pieces = pieces.filter_map(|p| p.get(0).and_then(|s| s.as_str()));
    if let Some(t) = added.chain(keys).chain(pieces).find(|t| t.len() > gguf_vocab::MAX_TOKEN_BYTES) {
        return Err(bad(format!("a token of {} bytes (at most {})", t.len(), gguf_vocab::MAX_TOKEN_BYTES)));
    }
    check_merges(&v).map_err(bad)?;
    Ok(text)
}

/// A BPE model's merges against its `continuing_subword_prefix`: the `tokenizers` crate slices
/// each merge's second part past the prefix and panics where it cannot (fuzzing found it), so
/// such a file is refused here, by name.
fn check_merges(v: &serde_json::Value) -> Result<(), String> {
    let prefix = v.pointer("/model/continuing_subword_prefix").and_then(|p| p.as_str()).unwrap_or_default();
    if prefix.is_empty() {
        return Ok(());
    }
    let merges = v.pointer("/model/merges").and_then(|m| m.as_array()).into_iter().flatten();
    for (i, m) in merges.enumerate() {
        // A merge is "a b", or ["a", "b"].
        let second = match m {
            serde_json::Value::String(s) => s.split_once(' ').map(|p| p.1),
            serde_json::Value::Array(a) => a.get(1).and_then(|b| b.as_str()),
            _ => None,
        };
        if second.is_some_and(|b| b.get(prefix.len()..).is_none()) {
            return Err(format!("merge {i} is shorter than the continuing_subword_prefix {prefix:?}"));
        }
    }
    Ok(())
}

impl Tokenizer {
    /// Wraps a built `tokenizers` pipeline. `vocab` lists every token string by id.
    pub(crate) fn assemble(
        mut special: tokenizers::Tokenizer,
        vocab: &[String],
        enc: ByteEncoding,
        bos: Option<u32>,
        add_bos: bool,
        eos: Vec<u32>,
    ) -> Result<Tokenizer, TokenizerError> {
        special.set_encode_special_tokens(false);
        let mut plain = special.clone();
        plain.set_encode_special_tokens(true);
        let inverse: std::collections::HashMap<char, u8> =
            byte_to_char().iter().enumerate().map(|(b, c)| (*c, b as u8)).collect();
        let added = special.get_added_tokens_decoder();
        let specials: HashSet<u32> = added.iter().filter(|(_, t)| t.special).map(|(id, _)| *id).collect();
        let special_text = literal::SpecialText::new(added.values().filter(|t| t.special).map(|t| t.content.clone()));
        let bytes =
            vocab
                .iter()
                .enumerate()
                .map(|(id, t)| {
                    if specials.contains(&(id as u32)) {
                        t.as_bytes().to_vec()
                    } else {
                        token_to_bytes(t, enc, &inverse)
                    }
                })
                .collect();
        let n = vocab.len() as u32;
        if bos.is_some_and(|b| b >= n) || eos.iter().any(|&e| e >= n) {
            return Err(TokenizerError::Invalid(format!("BOS/EOS ids {bos:?}/{eos:?} outside a vocabulary of {n}")));
        }
        // Without metadata (a `tokenizer.json`), the families' FIM tokens are known by text.
        let fim = fim::FimTokens::find(|_| None, vocab);
        Ok(Tokenizer { special, plain, bos, add_bos, add_eos: false, eos, specials, special_text, bytes, fim })
    }

    /// Writes the tokenizer as a Hugging Face `tokenizer.json` (with its special tokens).
    pub fn save_hf(&self, path: &Path) -> Result<(), TokenizerError> {
        self.special.save(path, false).map_err(|e| TokenizerError::Invalid(format!("writing {}: {e}", path.display())))
    }

    /// Whether encoding with special tokens starts with BOS.
    pub fn adds_bos(&self) -> bool {
        self.add_bos
    }

    /// Whether encoding with special tokens ends with EOS ([`Tokenizer::with_eos_appended`]).
    pub fn adds_eos(&self) -> bool {
        self.add_eos
    }

    /// Ends every encoded text with the first end-of-sequence token, as llama.cpp does for a
    /// vocabulary with `tokenizer.ggml.add_eos_token` (embedding models that pool the last
    /// token).
    pub fn with_eos_appended(mut self, add: bool) -> Tokenizer {
        self.add_eos = add && !self.eos.is_empty();
        self
    }

    /// The vocabulary's fill-in-the-middle tokens.
    pub fn fim(&self) -> &fim::FimTokens {
        &self.fim
    }

    /// Sets the fill-in-the-middle tokens (from a GGUF file's metadata).
    pub(crate) fn with_fim(mut self, fim: fim::FimTokens) -> Tokenizer {
        self.fim = fim;
        self
    }

    /// Loads a Hugging Face `tokenizer.json`.
    pub fn from_hf_file(
        path: &Path,
        bos: Option<u32>,
        eos: Vec<u32>,
        add_bos: bool,
    ) -> Result<Tokenizer, TokenizerError> {
        let text = read_bounded_json(path)?;
        // The `tokenizers` crate panics on some malformed files (an `expect` in its decoder
        // deserializer, found by fuzzing): a bad file is an error, not the daemon's end.
        let read = std::panic::catch_unwind(|| text.parse::<tokenizers::Tokenizer>()).map_err(|_| {
            TokenizerError::Invalid(format!("{}: malformed (the tokenizers library gave up on it)", path.display()))
        })?;
        let tk = read.map_err(|e| TokenizerError::Invalid(format!("{}: {e}", path.display())))?;
        let size = tk.get_vocab_size(true);
        let mut vocab = vec![String::new(); size];
        for (t, id) in tk.get_vocab(true) {
            if let Some(slot) = vocab.get_mut(id as usize) {
                *slot = t;
            }
        }
        let enc = match tk.get_decoder() {
            Some(tokenizers::DecoderWrapper::ByteLevel(_)) => ByteEncoding::ByteLevel,
            _ => ByteEncoding::SentencePiece,
        };
        Tokenizer::assemble(tk, &vocab, enc, bos, add_bos, eos)
    }

    /// Token ids for `text`. With `parse_special`, special-token text becomes the special ids;
    /// without, it is tokenized as ordinary text. The BOS token is prepended (and EOS appended)
    /// when the model wants it.
    pub fn encode(&self, text: &str, parse_special: bool) -> Result<Vec<u32>, TokenizerError> {
        let tk = if parse_special { &self.special } else { &self.plain };
        let enc = tk.encode_fast(text, false).map_err(|e| TokenizerError::Encode(e.to_string()))?;
        let mut ids = Vec::with_capacity(enc.get_ids().len() + 1);
        if self.add_bos {
            ids.extend(self.bos);
        }
        ids.extend_from_slice(enc.get_ids());
        if self.add_eos {
            ids.extend(self.eos.first());
        }
        Ok(ids)
    }

    /// Token ids for `text` alone: no BOS or EOS added, whatever the model wants at the start of
    /// a sequence (for prompts assembled from parts, such as fill-in-the-middle).
    pub fn encode_bare(&self, text: &str, parse_special: bool) -> Result<Vec<u32>, TokenizerError> {
        let tk = if parse_special { &self.special } else { &self.plain };
        let enc = tk.encode_fast(text, false).map_err(|e| TokenizerError::Encode(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Token ids for `pieces` in order, as [`Tokenizer::encode`] gives for one text: each piece
    /// with special-token parsing or without. The pieces are tokenized apart, so they should be
    /// cut where the tokenizer cuts anyway (at special tokens).
    pub fn encode_pieces(&self, pieces: &[(&str, bool)]) -> Result<Vec<u32>, TokenizerError> {
        let mut ids = Vec::new();
        if self.add_bos {
            ids.extend(self.bos);
        }
        ids.extend(self.encode_pieces_bare(pieces)?);
        if self.add_eos {
            ids.extend(self.eos.first());
        }
        Ok(ids)
    }

    /// [`Tokenizer::encode_pieces`] without BOS or EOS.
    pub fn encode_pieces_bare(&self, pieces: &[(&str, bool)]) -> Result<Vec<u32>, TokenizerError> {
        let mut ids = Vec::new();
        for &(text, parse_special) in pieces.iter().filter(|p| !p.0.is_empty()) {
            let tk = if parse_special { &self.special } else { &self.plain };
            let enc = tk.encode_fast(text, false).map_err(|e| TokenizerError::Encode(e.to_string()))?;
            ids.extend_from_slice(enc.get_ids());
        }
        Ok(ids)
    }

    /// The text of `ids`; special tokens are dropped when `skip_special`.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizerError> {
        let mut out = Vec::new();
        for &id in ids {
            if skip_special && self.specials.contains(&id) {
                continue;
            }
            out.extend_from_slice(self.token_bytes(id)?);
        }
        Ok(String::from_utf8_lossy(&out).into_owned())
    }

    /// The exact bytes token `id` stands for.
    pub fn token_bytes(&self, id: u32) -> Result<&[u8], TokenizerError> {
        self.bytes.get(id as usize).map(Vec::as_slice).ok_or(TokenizerError::BadId(id))
    }

    pub fn vocab_size(&self) -> usize {
        self.bytes.len()
    }

    pub fn is_special(&self, id: u32) -> bool {
        self.specials.contains(&id)
    }

    /// Tokens that end generation (EOS and end-of-turn).
    pub fn eos(&self) -> &[u32] {
        &self.eos
    }

    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    /// Text of a special token such as BOS/EOS, for chat templates.
    pub fn token_text(&self, id: u32) -> String {
        self.bytes.get(id as usize).map(|b| String::from_utf8_lossy(b).into_owned()).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merges_shorter_than_the_subword_prefix_are_refused() {
        let tk = |merges: serde_json::Value| serde_json::json!({"model": {"type": "BPE", "continuing_subword_prefix": "##", "merges": merges}});
        assert!(check_merges(&tk(serde_json::json!(["a ##b", ["a", "##c"]]))).is_ok());
        for bad in [serde_json::json!(["a ##b", "a b"]), serde_json::json!([["a", "#"]]), serde_json::json!(["x #é"])]
        {
            let e = check_merges(&tk(bad.clone())).unwrap_err();
            assert!(e.contains("continuing_subword_prefix"), "{bad}: {e}");
        }
        // (The `tokenizers` crate panics on such a file; without a prefix nothing is sliced.)
        assert!(check_merges(&serde_json::json!({"model": {"merges": ["a b"]}})).is_ok());
    }

    #[test]
    fn byte_map_is_a_bijection_onto_printables() {
        let m = byte_to_char();
        let set: HashSet<char> = m.iter().copied().collect();
        assert_eq!(set.len(), 256);
        assert_eq!(m[b' ' as usize], '\u{120}'); // 'Ġ'
        assert_eq!(m[b'\n' as usize], '\u{10a}'); // 'Ċ'
        assert_eq!(m[b'A' as usize], 'A');
    }
}
