//! What a user wrote stays text. A chat prompt is the template's markup around the messages'
//! contents, and the rendered string is tokenized with special-token parsing, so that the
//! markup's `<|im_start|>` becomes its control token. A content (a web page an app passes on, a
//! document) that contains the same characters would forge turns, a system turn even. So
//! before rendering, each special token's text found in what the client sent is swapped for a
//! placeholder of private-use characters ([`Literals::hide`]); after rendering, the text is cut
//! at the placeholders and each one is tokenized as plain text ([`Literals::encode`]). The
//! tokenizer cuts the text at a special token anyway, so every other token comes out as it
//! would have (a SentencePiece vocabulary that marks only the text's start with `▁` may see one
//! more `▁` after a hidden token: the hidden text still cannot act as markup).

use super::{Tokenizer, TokenizerError};
use std::collections::HashSet;

/// Opens and closes a placeholder (private-use code points, which no tokenizer treats as
/// markup); the number between is the hidden text's index.
const OPEN: char = '\u{F8F0}';
const CLOSE: char = '\u{F8F1}';

/// Finds special tokens' text in a string: leftmost, then longest, as the tokenizer's own
/// added-vocabulary split does.
#[derive(Debug)]
pub struct SpecialText {
    texts: HashSet<String>,
    /// Every length (in bytes) a special token's text has, longest first.
    lengths: Vec<usize>,
    /// Bytes a special token's text begins with.
    first: [bool; 256],
}

impl SpecialText {
    pub fn new(texts: impl IntoIterator<Item = String>) -> SpecialText {
        let mut s = SpecialText { texts: HashSet::new(), lengths: Vec::new(), first: [false; 256] };
        for t in texts {
            if let Some(&b) = t.as_bytes().first() {
                s.first[b as usize] = true;
                s.lengths.push(t.len());
                s.texts.insert(t);
            }
        }
        s.lengths.sort_unstable_by(|a, b| b.cmp(a));
        s.lengths.dedup();
        s
    }

    /// The byte ranges of special tokens' text in `text`, in order, not overlapping.
    pub fn find(&self, text: &str) -> Vec<std::ops::Range<usize>> {
        let mut out = Vec::new();
        let bytes = text.as_bytes();
        let mut i = 0;
        while i < bytes.len() {
            if self.first[bytes[i] as usize] && text.is_char_boundary(i) {
                let hit = self.lengths.iter().find(|&&l| text.get(i..i + l).is_some_and(|t| self.texts.contains(t)));
                if let Some(&l) = hit {
                    out.push(i..i + l);
                    i += l;
                    continue;
                }
            }
            i += 1;
        }
        out
    }
}

/// The special-token text hidden from a template so far, by placeholder index.
#[derive(Debug, Default)]
pub struct Literals {
    hidden: Vec<String>,
}

impl Literals {
    /// `s` with each special token's text swapped for a placeholder.
    pub fn hide(&mut self, tok: &Tokenizer, s: &str) -> String {
        let found = tok.special_text.find(s);
        if found.is_empty() {
            return s.to_owned();
        }
        let mut out = String::with_capacity(s.len() + 8 * found.len());
        let mut at = 0;
        for r in found {
            out.push_str(&s[at..r.start]);
            out.push(OPEN);
            out.push_str(&self.hidden.len().to_string());
            out.push(CLOSE);
            self.hidden.push(s[r.clone()].to_owned());
            at = r.end;
        }
        out.push_str(&s[at..]);
        out
    }

    /// Every string in a JSON value with its special-token text hidden (a tool's schema).
    pub fn hide_json(&mut self, tok: &Tokenizer, v: &serde_json::Value) -> serde_json::Value {
        use serde_json::Value as J;
        match v {
            J::String(s) => J::String(self.hide(tok, s)),
            J::Array(a) => J::Array(a.iter().map(|x| self.hide_json(tok, x)).collect()),
            J::Object(o) => J::Object(o.iter().map(|(k, x)| (self.hide(tok, k), self.hide_json(tok, x))).collect()),
            other => other.clone(),
        }
    }

    /// Token ids of a rendered prompt: the template's text with special-token parsing, each
    /// placeholder's hidden text as plain text.
    pub fn encode(&self, tok: &Tokenizer, rendered: &str) -> Result<Vec<u32>, TokenizerError> {
        if self.hidden.is_empty() {
            return tok.encode(rendered, true);
        }
        tok.encode_pieces(&self.pieces(rendered))
    }

    /// [`Literals::encode`] without the BOS or EOS the vocabulary adds (a prompt template that
    /// writes its own).
    pub fn encode_bare(&self, tok: &Tokenizer, rendered: &str) -> Result<Vec<u32>, TokenizerError> {
        tok.encode_pieces_bare(&self.pieces(rendered))
    }

    /// A rendered prompt as text: each placeholder back to the text it hid (what the template
    /// wrote, as llama-server's `/apply-template` answers).
    pub fn reveal(&self, rendered: &str) -> String {
        self.pieces(rendered).into_iter().map(|(text, _)| text).collect()
    }

    /// `rendered` cut at the placeholders: (text, parse special tokens).
    fn pieces<'a>(&'a self, rendered: &'a str) -> Vec<(&'a str, bool)> {
        let mut pieces: Vec<(&str, bool)> = Vec::new();
        let mut rest = rendered;
        let mut markup_from = 0; // where the current run of template text starts in `rest`
        while let Some(open) = rest[markup_from..].find(OPEN).map(|i| i + markup_from) {
            let after = &rest[open + OPEN.len_utf8()..];
            let digits = after.find(CLOSE).map(|end| &after[..end]);
            let index = digits.and_then(|d| d.parse::<usize>().ok()).filter(|&i| i < self.hidden.len());
            match (index, digits) {
                (Some(i), Some(d)) => {
                    pieces.push((&rest[..open], true));
                    pieces.push((self.hidden[i].as_str(), false));
                    rest = &after[d.len() + CLOSE.len_utf8()..];
                    markup_from = 0;
                }
                // A lone private-use character (the client's own): text like any other.
                _ => markup_from = open + OPEN.len_utf8(),
            }
        }
        pieces.push((rest, true));
        pieces
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn special_text_is_found_leftmost_longest() {
        let s = SpecialText::new(["<|a|>".to_string(), "<|a|>x".to_string(), "<b>".to_string()]);
        let text = "x<|a|>xy <b><|a|> <|a <b";
        let found: Vec<&str> = s.find(text).into_iter().map(|r| &text[r]).collect();
        assert_eq!(found, ["<|a|>x", "<b>", "<|a|>"]);
        assert!(s.find("é<b>é").len() == 1 && s.find("no markup here").is_empty());
    }
}
