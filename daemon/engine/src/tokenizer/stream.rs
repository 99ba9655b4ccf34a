//! Incremental detokenization for streaming: bytes accumulate until they form whole UTF-8
//! characters, so a multi-token emoji is emitted once, complete, never as replacement characters.

use super::{Tokenizer, TokenizerError};

/// Turns a stream of token ids into a stream of valid UTF-8 text pieces.
#[derive(Debug, Default)]
pub struct StreamDecoder {
    pending: Vec<u8>,
    skip_special: bool,
    /// Special tokens written even while skipping the others.
    keep: Vec<u32>,
}

impl StreamDecoder {
    pub fn new(skip_special: bool) -> Self {
        StreamDecoder { pending: Vec::new(), skip_special, keep: Vec::new() }
    }

    /// Skips special tokens except `keep` (a tool-call syntax's markers, which a parser reads).
    pub fn keeping(keep: Vec<u32>) -> Self {
        StreamDecoder { pending: Vec::new(), skip_special: true, keep }
    }

    /// The special tokens written even while skipping the others.
    pub fn kept(&self) -> &[u32] {
        &self.keep
    }

    /// Adds one token; returns the text that became complete (possibly empty).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String, TokenizerError> {
        if !(self.skip_special && tok.is_special(id) && !self.keep.contains(&id)) {
            self.pending.extend_from_slice(tok.token_bytes(id)?);
        }
        Ok(self.take_complete())
    }

    fn take_complete(&mut self) -> String {
        let valid = match std::str::from_utf8(&self.pending) {
            Ok(s) => s.len(),
            // An invalid sequence in the middle can never become valid: emit it as U+FFFD and go on;
            // an incomplete one at the end waits for the next token.
            Err(e) => match e.error_len() {
                Some(bad) => e.valid_up_to() + bad,
                None => e.valid_up_to(),
            },
        };
        let rest = self.pending.split_off(valid);
        let done = std::mem::replace(&mut self.pending, rest);
        String::from_utf8_lossy(&done).into_owned()
    }

    /// Flushes whatever is left at the end of generation (a dangling partial character becomes U+FFFD).
    pub fn finish(&mut self) -> String {
        let rest = std::mem::take(&mut self.pending);
        String::from_utf8_lossy(&rest).into_owned()
    }
}
