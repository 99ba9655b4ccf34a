//! A reranker's head: what llama.cpp calls rank pooling (`{arch}.pooling_type` 4). The model
//! reads a query and one document in one prompt; the final hidden state of its last token
//! (after the output norm: the attention is causal, so the last token has seen both) goes
//! through the classification matrix `cls.output.weight`, one row per label of
//! `{arch}.classifier.output_labels`, and a softmax over the labels. The relevance score is
//! the first label's probability: Qwen3-Reranker's converter writes the language-model rows of
//! "yes" and "no" there, so the score is P(yes). These are the Qwen3 rerankers llama.cpp runs
//! among causal models; other families' rank pooling is refused by name
//! ([`crate::model::arch`]).
//!
//! The prompt is the GGUF's `tokenizer.chat_template.rerank` with `{query}` and `{document}`
//! put in, tokenized with special tokens and without BOS or EOS, as llama-server builds it;
//! unlike there, special-token text inside the query or a document stays text
//! ([`Literals`]). Without that template: BOS (where the vocabulary adds it), the query, EOS
//! (where it adds EOS), the document, EOS.

use super::gguf::Gguf;
use super::weights::Tensor;
use super::ModelError;
use crate::tokenizer::literal::Literals;
use crate::tokenizer::{Tokenizer, TokenizerError};

/// The head and prompt of a reranker.
#[derive(Debug)]
pub struct RankHead {
    /// `cls.output.weight`: a row of `hidden` floats per label.
    out: Vec<f32>,
    hidden: usize,
    /// `tokenizer.chat_template.rerank`.
    template: Option<String>,
}

impl RankHead {
    /// The head of a rank-pooled GGUF file of `arch`, whose tensors come from `get` (which
    /// counts them as read).
    pub fn from_gguf(
        g: &Gguf,
        arch: &str,
        hidden: usize,
        get: &dyn Fn(&str) -> Option<Tensor>,
    ) -> Result<RankHead, ModelError> {
        let labels_key = format!("{arch}.classifier.output_labels");
        let labels = match g.get(&labels_key) {
            None => 1, // llama.cpp's default: one output
            Some(v) => v
                .as_array()
                .filter(|a| !a.is_empty() && a.iter().all(|l| l.as_str().is_some()))
                .map(<[_]>::len)
                .ok_or_else(|| ModelError::Config(format!("{labels_key} is not a list of label names")))?,
        };
        let t = get("cls.output.weight").ok_or_else(|| ModelError::MissingTensor("cls.output.weight".into()))?;
        if t.cols != hidden || t.rows != labels {
            return Err(ModelError::Shape(format!(
                "cls.output.weight is {}x{}, not {labels} labels x {hidden}",
                t.rows, t.cols
            )));
        }
        let out = t.to_f32();
        if out.iter().any(|x| !x.is_finite()) {
            return Err(ModelError::Config("cls.output.weight holds a value that is not finite".into()));
        }
        let template = g.get("tokenizer.chat_template.rerank").and_then(|v| v.as_str()).map(str::to_string);
        Ok(RankHead { out, hidden, template })
    }

    /// The labels' probabilities for the last token's final hidden state `h`: the first is the
    /// relevance score.
    pub fn classify(&self, h: &[f32]) -> Vec<f32> {
        let logits: Vec<f64> = self
            .out
            .chunks_exact(self.hidden)
            .map(|row| row.iter().zip(h).map(|(&w, &x)| f64::from(w) * f64::from(x)).sum())
            .collect();
        let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let exp: Vec<f64> = logits.iter().map(|l| (l - max).exp()).collect();
        let sum: f64 = exp.iter().sum();
        exp.iter().map(|e| (e / sum) as f32).collect()
    }

    /// The token ids of the prompt that scores `document` against `query`.
    pub fn prompt(&self, tok: &Tokenizer, query: &str, document: &str) -> Result<Vec<u32>, TokenizerError> {
        if let Some(t) = &self.template {
            let mut lit = Literals::default();
            let (q, d) = (lit.hide(tok, query), lit.hide(tok, document));
            return lit.encode_bare(tok, &fill(t, &q, &d));
        }
        let mut ids = Vec::new();
        if tok.adds_bos() {
            ids.extend(tok.bos());
        }
        let eos = tok.adds_eos().then(|| tok.eos().first().copied()).flatten();
        ids.extend(tok.encode_bare(query, false)?);
        ids.extend(eos);
        ids.extend(tok.encode_bare(document, false)?);
        ids.extend(eos);
        Ok(ids)
    }
}

/// `template` with each `{query}` and `{document}` replaced in one pass (a query that holds
/// the text `{document}` stays as written).
fn fill(template: &str, query: &str, document: &str) -> String {
    let mut out = String::with_capacity(template.len() + query.len() + document.len());
    let mut rest = template;
    loop {
        let next = [("{query}", query), ("{document}", document)]
            .into_iter()
            .filter_map(|(k, v)| rest.find(k).map(|i| (i, k, v)))
            .min_by_key(|&(i, ..)| i);
        let Some((i, k, v)) = next else { break };
        out.push_str(&rest[..i]);
        out.push_str(v);
        rest = &rest[i + k.len()..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_template_is_filled_in_one_pass() {
        assert_eq!(fill("Q: {query}\nD: {document}.", "a {document}", "b {query}"), "Q: a {document}\nD: b {query}.");
        assert_eq!(fill("{document}{document}", "q", "d"), "dd");
    }

    #[test]
    fn the_score_is_the_first_labels_probability() {
        let head = RankHead { out: vec![1.0, 0.0, 0.0, 1.0], hidden: 2, template: None };
        let p = head.classify(&[2.0, 1.0]);
        assert!((p[0] - 1.0 / (1.0 + (-1.0f32).exp())).abs() < 1e-6, "{p:?}");
        assert!((p[0] + p[1] - 1.0).abs() < 1e-6);
        // Large logits stay finite.
        let p = head.classify(&[1000.0, -1000.0]);
        assert_eq!(p, [1.0, 0.0]);
    }
}
