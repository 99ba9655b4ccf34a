//! Fill-in-the-middle: the special tokens a code model was trained to complete a gap with.
//!
//! A FIM prompt is `PRE prefix SUF suffix MID`, and the model writes what goes between; the
//! repository-level form (Qwen2.5-Coder) puts other files first, each after `FILE_SEP name`,
//! the whole after `REPO name`. A vocabulary names its tokens in GGUF metadata
//! (`tokenizer.ggml.fim_{pre,suf,mid,pad,rep,sep}_token_id`, or the older
//! `tokenizer.ggml.{prefix,suffix,middle}_token_id`); converters often leave them out, so
//! the families' own spellings are looked up by text, the same list llama.cpp searches.

/// The FIM tokens a vocabulary has.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FimTokens {
    pub prefix: Option<u32>,
    pub suffix: Option<u32>,
    pub middle: Option<u32>,
    pub pad: Option<u32>,
    /// Starts the repository-level form, before the project's name.
    pub repo: Option<u32>,
    /// Starts a file of the repository-level form, before its name.
    pub file_sep: Option<u32>,
}

/// The three tokens a FIM prompt needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fim {
    pub prefix: u32,
    pub suffix: u32,
    pub middle: u32,
}

/// Per role: the metadata keys (current, then deprecated) and the token texts of the families
/// that leave the keys out.
const ROLES: [(&[&str], &[&str]); 6] = [
    (
        &["fim_pre", "prefix"],
        &[
            "<|fim_prefix|>",
            "<fim-prefix>",
            "<fim_prefix>",
            "<｜fim▁begin｜>",
            "<PRE>",
            "▁<PRE>",
            "<|code_prefix|>",
            "<|prefix|>",
        ],
    ),
    (
        &["fim_suf", "suffix"],
        &[
            "<|fim_suffix|>",
            "<fim-suffix>",
            "<fim_suffix>",
            "<｜fim▁hole｜>",
            "<SUF>",
            "▁<SUF>",
            "<|code_suffix|>",
            "<|suffix|>",
        ],
    ),
    (
        &["fim_mid", "middle"],
        &[
            "<|fim_middle|>",
            "<fim-middle>",
            "<fim_middle>",
            "<｜fim▁end｜>",
            "<MID>",
            "▁<MID>",
            "<|code_middle|>",
            "<|middle|>",
        ],
    ),
    (&["fim_pad"], &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"]),
    (&["fim_rep"], &["<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"]),
    (&["fim_sep"], &["<|file_sep|>"]),
];

impl FimTokens {
    /// The tokens of a vocabulary: `meta(key)` reads `tokenizer.ggml.<key>_token_id`, `tokens`
    /// lists every token's text by id. An id outside the vocabulary counts as absent.
    pub fn find(meta: impl Fn(&str) -> Option<u32>, tokens: &[String]) -> FimTokens {
        let n = tokens.len() as u32;
        let role = |(keys, texts): (&[&str], &[&str])| {
            keys.iter()
                .find_map(|k| meta(k))
                .filter(|&id| id < n)
                .or_else(|| texts.iter().find_map(|t| tokens.iter().position(|x| x == t)).map(|i| i as u32))
        };
        let [prefix, suffix, middle, pad, repo, file_sep] = ROLES.map(role);
        FimTokens { prefix, suffix, middle, pad, repo, file_sep }
    }

    /// The three tokens of a FIM prompt, or the names of those the vocabulary lacks.
    pub fn fim(&self) -> Result<Fim, String> {
        match (self.prefix, self.suffix, self.middle) {
            (Some(prefix), Some(suffix), Some(middle)) => Ok(Fim { prefix, suffix, middle }),
            _ => {
                let missing: Vec<&str> = [(self.prefix, "prefix"), (self.suffix, "suffix"), (self.middle, "middle")]
                    .iter()
                    .filter(|(t, _)| t.is_none())
                    .map(|(_, name)| *name)
                    .collect();
                Err(format!("the model has no fill-in-the-middle {} token", missing.join(", ")))
            }
        }
    }

    /// Tokens that end a FIM answer besides the end-of-sequence ones: after writing the middle,
    /// a model trained on repositories goes on with padding or the next file.
    pub fn ends(&self) -> impl Iterator<Item = u32> {
        [self.pad, self.repo, self.file_sep].into_iter().flatten()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vocab(texts: &[&str]) -> Vec<String> {
        texts.iter().map(|t| t.to_string()).collect()
    }

    #[test]
    fn metadata_wins_and_known_texts_fill_the_rest() {
        let tokens = vocab(&["a", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|file_sep|>", "b"]);
        let f = FimTokens::find(|k| (k == "fim_pre").then_some(5), &tokens);
        assert_eq!(f.prefix, Some(5), "the metadata's id");
        assert_eq!((f.suffix, f.middle, f.file_sep, f.repo), (Some(2), Some(3), Some(4), None));
        assert_eq!(f.fim(), Ok(Fim { prefix: 5, suffix: 2, middle: 3 }));
        assert_eq!(f.ends().collect::<Vec<_>>(), vec![4]);
        // The deprecated key, and an id past the vocabulary ignored.
        let f = FimTokens::find(|k| (k == "middle").then_some(0).or((k == "fim_suf").then_some(99)), &tokens);
        assert_eq!((f.middle, f.suffix), (Some(0), Some(2)));
    }

    #[test]
    fn a_vocabulary_without_them_is_refused_by_name() {
        let f = FimTokens::find(|_| None, &vocab(&["<PRE>", "x"]));
        assert_eq!(f.fim().unwrap_err(), "the model has no fill-in-the-middle suffix, middle token");
    }
}
