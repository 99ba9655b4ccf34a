//! Structured output: a response format compiled against the model's vocabulary into a grammar
//! whose token mask the host applies to every logits row of a constrained request, before any
//! strategy sees them.
//!
//! The grammar engine is `llguidance` (what llama.cpp and mistral.rs use): it compiles JSON
//! schemas and Lark grammars and computes, for a parser state, the set of tokens that keep the
//! output a prefix of a sentence of the grammar (tens of microseconds for a 50k vocabulary).
//! This module gives it the vocabulary ([`Vocabulary`]: each token's exact bytes, special tokens
//! marked so that no grammar can spell them as text) and compiles a [`ResponseFormat`] into a
//! [`Grammar`]; `mask.rs` ([`mask::Masker`]) follows each sequence of a session through it.
//!
//! Masking the logits is what lets the constraint compose with every strategy, third-party ones
//! included: a forbidden token has probability zero under greedy, nucleus, min-p and beam
//! search alike, and speculative decoding rejects a draft token the mask forbids because the
//! target gives it probability zero. The host also checks every emitted token against the
//! grammar, so a strategy that ignores its logits fails its request instead of breaking the
//! format.

pub mod limits;
pub mod mask;

use crate::tokenizer::Tokenizer;
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
use llguidance::{ParserFactory, TokenParser};
use std::sync::{Arc, OnceLock};

#[derive(Debug, thiserror::Error)]
pub enum ConstraintError {
    #[error("the response format cannot be enforced: {0}")]
    Compile(String),
    #[error("the model's vocabulary cannot be used for constrained output: {0}")]
    Vocabulary(String),
}

/// What the output must be.
#[derive(Clone, Debug, PartialEq)]
pub enum ResponseFormat {
    /// Any JSON object (OpenAI's `json_object`, Ollama's `format: "json"`).
    JsonObject,
    /// JSON that validates under `schema` (OpenAI's `json_schema`, Ollama's `format` object).
    JsonSchema(serde_json::Value),
    /// A grammar in llguidance's Lark dialect (tool calls are built as one).
    Lark(String),
}

/// JSON is written on one line with a space after `:` and `,`: readable, and it leaves a model
/// no run of whitespace to lose itself in (flexible whitespace lets a small model emit newlines
/// until `max_tokens`).
fn json_layout() -> serde_json::Value {
    serde_json::json!({ "whitespace_flexible": false, "key_separator": ": ", "item_separator": ", " })
}

impl ResponseFormat {
    fn grammar(&self) -> TopLevelGrammar {
        match self {
            ResponseFormat::JsonObject => {
                TopLevelGrammar::from_json_schema(serde_json::json!({ "type": "object", "x-guidance": json_layout() }))
            }
            ResponseFormat::JsonSchema(schema) => {
                let mut s = schema.clone();
                if let Some(o) = s.as_object_mut() {
                    o.entry("x-guidance").or_insert_with(json_layout);
                }
                TopLevelGrammar::from_json_schema(s)
            }
            ResponseFormat::Lark(src) => TopLevelGrammar::from_lark(src.clone()),
        }
    }
}

/// The grammar compiler's stack: address space reserved per compilation, committed only as
/// deep as the compiler recurses (under 4 MiB for the 5,000-property schema the limits admit).
pub const COMPILE_STACK: usize = 256 << 20;

/// A model's vocabulary as the grammar engine and the plugins see it: every token's bytes, and
/// the compiler of response formats over them. Built once per model; the compiler's token
/// trie and slices (a tenth of a second for a 150k vocabulary) on the first response format.
pub struct Vocabulary {
    env: TokEnv,
    factory: OnceLock<Result<ParserFactory, String>>,
    /// Tokens the tokenizer knows (a model's logits rows may be longer: padded embeddings).
    size: usize,
    bytes: Vec<Vec<u8>>,
}

impl std::fmt::Debug for Vocabulary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vocabulary").field("size", &self.size).finish_non_exhaustive()
    }
}

impl Vocabulary {
    /// The vocabulary of `tok`, whose end-of-sequence tokens end constrained output.
    pub fn new(tok: &Tokenizer) -> Result<Vocabulary, ConstraintError> {
        let tokens = (0..tok.vocab_size() as u32)
            .map(|id| Ok((tok.token_bytes(id)?.to_vec(), tok.is_special(id))))
            .collect::<Result<Vec<_>, crate::tokenizer::TokenizerError>>()
            .map_err(|e| ConstraintError::Vocabulary(e.to_string()))?;
        Vocabulary::from_tokens(tokens, tok.eos())
    }

    /// A vocabulary of `(bytes, special)` by token id, ended by the tokens `eos`.
    pub fn from_tokens(tokens: Vec<(Vec<u8>, bool)>, eos: &[u32]) -> Result<Vocabulary, ConstraintError> {
        let size = tokens.len();
        let mut bytes = Vec::with_capacity(size);
        let mut words = Vec::with_capacity(size);
        for (b, special) in tokens {
            // Special tokens are spelled with the marker byte first (0xFF never occurs in
            // UTF-8), so a grammar's text can never produce them.
            words.push(if special {
                let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                w.extend_from_slice(&b);
                w
            } else {
                b.clone()
            });
            bytes.push(b);
        }
        if let Some(&bad) = eos.iter().find(|&&e| e as usize >= size) {
            return Err(ConstraintError::Vocabulary(format!("end-of-sequence token {bad} is outside the vocabulary")));
        }
        let Some(&first) = eos.first() else {
            return Err(ConstraintError::Vocabulary("the model declares no end-of-sequence token".into()));
        };
        let info = TokRxInfo::new(size as u32, first);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(eos);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        Ok(Vocabulary { env, factory: OnceLock::new(), size, bytes })
    }

    /// Tokens the tokenizer knows.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The exact bytes token `id` stands for (a special token's text), or `None` outside the
    /// vocabulary.
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        self.bytes.get(id as usize).map(Vec::as_slice)
    }

    /// The special token whose text is `text` (`[TOOL_CALLS]`, `<|python_tag|>`), if any.
    pub fn special_token(&self, text: &str) -> Option<u32> {
        self.env.tok_trie().get_special_token(text)
    }

    /// `format` compiled for this vocabulary: a schema or grammar the engine cannot enforce, or
    /// one past [`limits`], is refused here, at admission, with the reason.
    ///
    /// The compiler recurses in proportion to a schema's size, so it runs on a thread of its own
    /// with a [`COMPILE_STACK`] stack (reserved, touched only as deep as it goes), whatever
    /// thread calls this: the largest schema the limits admit uses a fraction of it.
    pub fn compile(&self, format: &ResponseFormat) -> Result<Grammar, ConstraintError> {
        match format {
            ResponseFormat::JsonObject => {}
            ResponseFormat::JsonSchema(s) => limits::SchemaBudget::default().check(s)?,
            ResponseFormat::Lark(src) => limits::check_lark(src)?,
        }
        let factory = self.factory.get_or_init(|| {
            let mut f = ParserFactory::new_simple(&self.env).map_err(|e| e.to_string())?;
            f.quiet();
            Ok(f)
        });
        let factory = factory.as_ref().map_err(|e| ConstraintError::Vocabulary(e.clone()))?;
        let grammar = format.grammar();
        let parser = std::thread::scope(|s| {
            std::thread::Builder::new()
                .name("inferd-grammar".into())
                .stack_size(COMPILE_STACK)
                .spawn_scoped(s, || factory.create_parser(grammar).map_err(|e| e.to_string()))
                .map_err(|e| ConstraintError::Compile(format!("no thread to compile it on: {e}")))?
                .join()
                .map_err(|_| ConstraintError::Compile("the grammar compiler failed".into()))?
                .map_err(ConstraintError::Compile)
        })?;
        Ok(Grammar { parser: Box::new(parser), vocab: self.size })
    }
}

/// A compiled response format at its start state; each constrained request runs a copy.
#[derive(Clone)]
pub struct Grammar {
    /// (Boxed: a parser is over a kilobyte, and requests travel by value.)
    parser: Box<TokenParser>,
    vocab: usize,
}

impl std::fmt::Debug for Grammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammar").field("vocab", &self.vocab).finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests;
