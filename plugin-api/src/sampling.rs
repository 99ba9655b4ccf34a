//! The sampling transforms shared by the sampling strategies, so every strategy (and later the
//! verification step of speculative decoding) applies a request's parameters the same way.
//!
//! The chain, in order:
//! 1. logit bias: `logit[j] += bias[j]` (OpenAI `logit_bias`, -100..100);
//! 2. penalties: llama.cpp's repetition penalty over the last `repeat_last_n` tokens of the
//!    context (prompt and generated), `logit[j] /= repeat_penalty` where positive and
//!    `*= repeat_penalty` where not; then OpenAI's formula over the tokens this choice
//!    generated so far: `logit[j] -= count[j] * frequency_penalty + (count[j] > 0) * presence_penalty`;
//! 3. temperature: `logit / T`; `T = 0` is greedy (the argmax of the edited logits);
//! 4. softmax;
//! 5. top-k: the k most probable tokens stay;
//! 6. top-p: the smallest set of most probable tokens whose probability reaches `p` of what is
//!    left stays;
//! 7. min-p: tokens with `p >= min_p * p_max` stay (Nguyen et al. 2024);
//! 8. the survivors are renormalized and one is drawn by inverse CDF, in token-id order, with a
//!    uniform number from the host's counter-based generator.
//!
//! Bias and penalties edit logits, so they come first, where the model's scores are. Temperature
//! comes before truncation by default, as in HF transformers, vLLM and the OpenAI API: top-k/top-p
//! then see the distribution that is actually sampled. With [`Sampling::temperature_last`] (the
//! min-p strategy: llama.cpp's default order, and what the min-p paper recommends) steps 5-7 run
//! on the untempered distribution and the temperature reshapes only the survivors, so a high
//! temperature cannot let the long tail back in.

use crate::params::Params;
use std::collections::HashMap;

#[derive(Clone, Debug, PartialEq)]
pub struct Sampling {
    pub temperature: f32,
    /// 0: off.
    pub top_k: u32,
    /// 1: off.
    pub top_p: f32,
    /// 0: off.
    pub min_p: f32,
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
    /// 1: off.
    pub repeat_penalty: f32,
    /// The repetition penalty's window, in tokens (0: off).
    pub repeat_last_n: u32,
    /// The prompt's last `repeat_last_n` tokens: where the window starts ([`Sampling::with_prompt`]).
    pub context: Vec<u32>,
    pub logit_bias: Vec<(u32, f32)>,
    pub temperature_last: bool,
}

impl Default for Sampling {
    fn default() -> Self {
        Sampling {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            context: Vec::new(),
            logit_bias: Vec::new(),
            temperature_last: false,
        }
    }
}

/// Which truncations a strategy accepts as parameters.
#[derive(Clone, Copy, Debug)]
pub struct Accept {
    pub top_k: bool,
    pub top_p: bool,
    pub min_p: bool,
}

/// Index of the largest value, the first one on ties.
pub fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best as u32
}

/// `ln softmax(x)[i]`.
pub fn log_softmax_at(x: &[f32], i: usize) -> f32 {
    LogSoftmax::of(x).at(i)
}

/// `ln softmax(row)`, its normalizer computed once (f64 accumulation) and read per token: the
/// log-probabilities a strategy reports (`logprobs`, `top_logprobs`) are of the row itself,
/// before the strategy's temperature, penalties and truncation.
pub struct LogSoftmax<'a> {
    row: &'a [f32],
    max: f32,
    /// `ln sum exp(row - max)`.
    ln_sum: f64,
}

impl<'a> LogSoftmax<'a> {
    pub fn of(row: &'a [f32]) -> Self {
        let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let s: f64 = row.iter().map(|&v| f64::from(v - m).exp()).sum();
        LogSoftmax { row, max: m, ln_sum: s.ln() }
    }

    /// The log-probability of token `i`.
    pub fn at(&self, i: usize) -> f32 {
        self.at_f64(i) as f32
    }

    /// [`at`](Self::at) in full precision, for sums of many (a beam's total).
    pub fn at_f64(&self, i: usize) -> f64 {
        f64::from(self.row[i] - self.max) - self.ln_sum
    }

    /// The `k` most probable tokens with their log-probabilities, most probable first (ties:
    /// lower id first); tokens of probability zero (a response format's mask) are left out.
    pub fn top(&self, k: usize) -> Vec<(u32, f32)> {
        if k == 0 {
            return Vec::new();
        }
        let by = |a: &u32, b: &u32| self.row[*b as usize].total_cmp(&self.row[*a as usize]).then(a.cmp(b));
        let mut ids: Vec<u32> =
            (0..self.row.len() as u32).filter(|&i| self.row[i as usize] > f32::NEG_INFINITY).collect();
        if k < ids.len() {
            ids.select_nth_unstable_by(k - 1, by);
            ids.truncate(k);
        }
        ids.sort_unstable_by(by);
        ids.into_iter().map(|i| (i, self.at(i as usize))).collect()
    }
}

impl Sampling {
    /// Reads `temperature`, `frequency_penalty`, `presence_penalty`, `repeat_penalty`,
    /// `repeat_last_n`, `logit_bias` and the accepted truncations from `p`, with OpenAI's
    /// ranges (llama.cpp's defaults for the repetition penalty: off, over 64 tokens).
    pub fn from_params(p: &mut Params, vocab: u32, accept: Accept) -> Result<Sampling, String> {
        let mut s = Sampling { temperature: p.f64("temperature", 0.0..=2.0, 1.0)? as f32, ..Sampling::default() };
        s.frequency_penalty = p.f64("frequency_penalty", -2.0..=2.0, 0.0)? as f32;
        s.presence_penalty = p.f64("presence_penalty", -2.0..=2.0, 0.0)? as f32;
        s.repeat_penalty = p.f64("repeat_penalty", 0.0..=10.0, 1.0)? as f32;
        if s.repeat_penalty <= 0.0 {
            return Err("repeat_penalty must be above 0 (1 is off)".into());
        }
        s.repeat_last_n = p.u64("repeat_last_n", 0..=u64::from(u32::MAX), 64)? as u32;
        if accept.top_k {
            s.top_k = p.u64("top_k", 0..=u64::from(vocab), 0)? as u32;
        }
        if accept.top_p {
            s.top_p = p.f64("top_p", 0.0..=1.0, 1.0)? as f32;
        }
        if accept.min_p {
            s.min_p = p.f64("min_p", 0.0..=1.0, 0.0)? as f32;
        }
        if let Some(v) = p.get("logit_bias") {
            let obj = v.as_object().ok_or("logit_bias must be an object of token id -> bias")?;
            for (k, b) in obj {
                let id: u32 = k.parse().map_err(|_| format!("logit_bias key {k:?} is not a token id"))?;
                if id >= vocab {
                    return Err(format!("logit_bias token {id} is outside the vocabulary of {vocab}"));
                }
                let b = b
                    .as_f64()
                    .filter(|b| (-100.0..=100.0).contains(b))
                    .ok_or_else(|| format!("logit_bias for {id} must be a number between -100 and 100"))?;
                s.logit_bias.push((id, b as f32));
            }
            s.logit_bias.sort_by_key(|&(id, _)| id);
        }
        Ok(s)
    }

    /// Keeps the end of the prompt the repetition penalty's window starts in (nothing while
    /// the penalty is off).
    pub fn with_prompt(&mut self, prompt: &[u32]) {
        let n = if self.repeat_penalty == 1.0 { 0 } else { self.repeat_last_n as usize };
        self.context = prompt[prompt.len().saturating_sub(n)..].to_vec();
    }

    /// Steps 1 and 2: bias, then penalties over `history` (and the prompt's end before it).
    pub fn edit_logits(&self, logits: &mut [f32], history: &[u32]) {
        for &(id, b) in &self.logit_bias {
            if let Some(l) = logits.get_mut(id as usize) {
                *l += b;
            }
        }
        if self.repeat_penalty != 1.0 && self.repeat_last_n > 0 {
            let n = self.repeat_last_n as usize;
            let from_history = &history[history.len().saturating_sub(n)..];
            let from_context = &self.context[self.context.len().saturating_sub(n - from_history.len())..];
            let window: std::collections::HashSet<u32> = from_context.iter().chain(from_history).copied().collect();
            for t in window {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l = if *l <= 0.0 { *l * self.repeat_penalty } else { *l / self.repeat_penalty };
                }
            }
        }
        if self.frequency_penalty != 0.0 || self.presence_penalty != 0.0 {
            let mut count: HashMap<u32, u32> = HashMap::new();
            for &t in history {
                *count.entry(t).or_default() += 1;
            }
            for (t, c) in count {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l -= c as f32 * self.frequency_penalty + self.presence_penalty;
                }
            }
        }
    }

    /// The distribution a token is drawn from: the survivors of the chain with their
    /// renormalized probabilities, in token-id order.
    pub fn distribution(&self, logits: &[f32], history: &[u32]) -> Vec<(u32, f32)> {
        let mut l = logits.to_vec();
        self.edit_logits(&mut l, history);
        if l.is_empty() {
            return Vec::new();
        }
        if self.temperature <= 0.0 {
            return vec![(argmax(&l), 1.0)];
        }
        let t = if self.temperature_last { 1.0 } else { self.temperature };
        let probs = softmax(&l, t);
        let by_prob = |a: &u32, b: &u32| probs[*b as usize].total_cmp(&probs[*a as usize]).then(a.cmp(b));
        let mut keep: Vec<u32> = (0..l.len() as u32).collect();
        if self.top_k > 0 && (self.top_k as usize) < keep.len() {
            keep.select_nth_unstable_by(self.top_k as usize - 1, by_prob);
            keep.truncate(self.top_k as usize);
        }
        if self.top_p < 1.0 {
            let target = f64::from(self.top_p) * keep.iter().map(|&i| f64::from(probs[i as usize])).sum::<f64>();
            // Sort only as much of the head as the nucleus needs: 64, 512, 4096... tokens.
            let mut m = 64;
            loop {
                if m >= keep.len() {
                    keep.sort_unstable_by(by_prob);
                    break;
                }
                keep.select_nth_unstable_by(m - 1, by_prob);
                keep[..m].sort_unstable_by(by_prob);
                if keep[..m].iter().map(|&i| f64::from(probs[i as usize])).sum::<f64>() >= target {
                    keep.truncate(m);
                    break;
                }
                m *= 8;
            }
            let mut cum = 0.0;
            let mut n = keep.len();
            for (j, &i) in keep.iter().enumerate() {
                cum += f64::from(probs[i as usize]);
                if cum >= target {
                    n = j + 1;
                    break;
                }
            }
            keep.truncate(n.max(1));
        }
        if self.min_p > 0.0 {
            let pmax = keep.iter().map(|&i| probs[i as usize]).fold(0.0f32, f32::max);
            keep.retain(|&i| probs[i as usize] >= self.min_p * pmax);
        }
        keep.sort_unstable();
        let weights: Vec<f64> = if self.temperature_last && self.temperature != 1.0 {
            let m = keep.iter().map(|&i| l[i as usize]).fold(f32::NEG_INFINITY, f32::max);
            keep.iter().map(|&i| (f64::from(l[i as usize] - m) / f64::from(self.temperature)).exp()).collect()
        } else {
            keep.iter().map(|&i| f64::from(probs[i as usize])).collect()
        };
        let total: f64 = weights.iter().sum();
        keep.into_iter().zip(weights).map(|(i, w)| (i, (w / total) as f32)).collect()
    }

    /// Draws from `logits`: the token and the log of its probability under the distribution it
    /// was drawn from.
    pub fn sample(&self, logits: &[f32], history: &[u32], u: f64) -> Option<(u32, f32)> {
        draw(&self.distribution(logits, history), u).map(|(t, p)| (t, p.ln()))
    }
}

/// `softmax(x / t)` in f64 accumulation.
fn softmax(x: &[f32], t: f32) -> Vec<f32> {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f64> = x.iter().map(|&v| (f64::from(v - m) / f64::from(t)).exp()).collect();
    let s: f64 = e.iter().sum();
    e.into_iter().map(|v| (v / s) as f32).collect()
}

/// Inverse CDF: the first token whose cumulative probability exceeds `u` (in [0, 1)).
pub fn draw(dist: &[(u32, f32)], u: f64) -> Option<(u32, f32)> {
    let mut cum = 0.0;
    for &(t, p) in dist {
        cum += f64::from(p);
        if u < cum {
            return Some((t, p));
        }
    }
    dist.last().copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f32, b: f32) -> bool {
        (a - b).abs() < 1e-5
    }

    const L: [f32; 5] = [2.0, 1.0, 0.5, 0.0, -1.0];

    fn softmax_ref(x: &[f32]) -> Vec<f32> {
        let s: f32 = x.iter().map(|v| v.exp()).sum();
        x.iter().map(|v| v.exp() / s).collect()
    }

    #[test]
    fn the_repetition_penalty_scales_the_window_of_prompt_and_answer_as_llama_cpp_does() {
        let s = Sampling { repeat_penalty: 2.0, repeat_last_n: 3, ..Sampling::default() };
        let mut s2 = s.clone();
        // The window: the prompt's last token (2) and the answer's two (0 and 4); token 1 fell out.
        s2.with_prompt(&[1, 1, 2]);
        assert_eq!(s2.context, [1, 1, 2]);
        let mut l = L;
        s2.edit_logits(&mut l, &[0, 4]);
        assert_eq!(l, [1.0, 1.0, 0.25, 0.0, -2.0], "positive logits divided, others multiplied");
        // Without a prompt, the answer alone; off at 1 or over 0 tokens.
        let mut l = L;
        s.edit_logits(&mut l, &[1, 1, 1, 1]);
        assert_eq!(l, [2.0, 0.5, 0.5, 0.0, -1.0]);
        for off in [Sampling { repeat_last_n: 0, ..s.clone() }, Sampling { repeat_penalty: 1.0, ..s.clone() }] {
            let mut l = L;
            off.edit_logits(&mut l, &[0, 1, 2]);
            assert_eq!(l, L);
        }
        let mut off = Sampling::default();
        off.with_prompt(&[1, 2, 3]);
        assert!(off.context.is_empty(), "nothing kept while the penalty is off");
    }

    #[test]
    fn top_log_softmax_is_sorted_consistent_and_skips_masked_tokens() {
        let row = [1.0, 3.0, f32::NEG_INFINITY, 3.0, -2.0, 0.5];
        let ls = LogSoftmax::of(&row);
        let total: f64 = (0..row.len()).map(|i| f64::from(ls.at(i)).exp()).sum();
        assert!((total - 1.0).abs() < 1e-6, "{total}");
        let top = ls.top(3);
        assert_eq!(top.iter().map(|e| e.0).collect::<Vec<_>>(), vec![1, 3, 0], "ties: lower id first");
        for &(t, lp) in &top {
            assert_eq!(lp, ls.at(t as usize));
            assert_eq!(lp, log_softmax_at(&row, t as usize));
        }
        assert_eq!(ls.top(20).len(), 5, "the masked token is no alternative");
        assert!(ls.top(0).is_empty());
    }

    #[test]
    fn defaults_leave_the_model_distribution_alone() {
        let d = Sampling::default().distribution(&L, &[]);
        let want = softmax_ref(&L);
        assert_eq!(d.len(), 5);
        for (i, &(t, p)) in d.iter().enumerate() {
            assert_eq!(t, i as u32);
            assert!(close(p, want[i]));
        }
    }

    #[test]
    fn logit_bias_alone() {
        let s = Sampling { logit_bias: vec![(4, 10.0)], temperature: 0.0, ..Sampling::default() };
        assert_eq!(s.distribution(&L, &[]), vec![(4, 1.0)]);
    }

    #[test]
    fn penalties_follow_the_openai_formula() {
        let s = Sampling { frequency_penalty: 0.5, presence_penalty: 0.25, ..Sampling::default() };
        let mut l = L.to_vec();
        s.edit_logits(&mut l, &[0, 0, 2]);
        assert_eq!(l, vec![2.0 - 2.0 * 0.5 - 0.25, 1.0, 0.5 - 0.5 - 0.25, 0.0, -1.0]);
        // Negative penalties encourage repetition.
        let s = Sampling { presence_penalty: -2.0, temperature: 0.0, ..Sampling::default() };
        assert_eq!(s.distribution(&L, &[1]), vec![(1, 1.0)]);
    }

    #[test]
    fn temperature_alone() {
        let s = Sampling { temperature: 0.5, ..Sampling::default() };
        let d = s.distribution(&L, &[]);
        let want = softmax_ref(&L.map(|v| v / 0.5));
        assert!(d.iter().zip(&want).all(|(&(_, p), &w)| close(p, w)));
        let greedy = Sampling { temperature: 0.0, ..Sampling::default() };
        assert_eq!(greedy.distribution(&L, &[]), vec![(0, 1.0)]);
    }

    #[test]
    fn top_k_alone() {
        let s = Sampling { top_k: 2, ..Sampling::default() };
        let d = s.distribution(&L, &[]);
        let w = softmax_ref(&L[..2]);
        assert_eq!(d.iter().map(|x| x.0).collect::<Vec<_>>(), vec![0, 1]);
        assert!(close(d[0].1, w[0]) && close(d[1].1, w[1]));
    }

    #[test]
    fn top_p_keeps_the_smallest_set_reaching_p() {
        let p = softmax_ref(&L);
        // p[0] alone is below 0.6, p[0] + p[1] is above.
        assert!(p[0] < 0.6 && p[0] + p[1] > 0.6);
        let d = Sampling { top_p: 0.6, ..Sampling::default() }.distribution(&L, &[]);
        assert_eq!(d.iter().map(|x| x.0).collect::<Vec<_>>(), vec![0, 1]);
        // Exactly reaching the mass keeps no more.
        let d = Sampling { top_p: p[0] - 1e-6, ..Sampling::default() }.distribution(&L, &[]);
        assert_eq!(d.len(), 1);
        // p = 0 still keeps the most probable token.
        assert_eq!(Sampling { top_p: 0.0, ..Sampling::default() }.distribution(&L, &[]), vec![(0, 1.0)]);
        // A vocabulary larger than the partial-sort window.
        let big: Vec<f32> = (0..5000).map(|i| -(i as f32) / 500.0).collect();
        let d = Sampling { top_p: 0.9, ..Sampling::default() }.distribution(&big, &[]);
        let pb = softmax_ref(&big);
        let n = d.len();
        let mass: f32 = pb[..n].iter().sum();
        assert!(mass >= 0.9 - 1e-4 && mass - pb[n - 1] < 0.9, "{n} tokens, mass {mass}");
    }

    #[test]
    fn min_p_alone() {
        let p = softmax_ref(&L);
        let s = Sampling { min_p: 0.3, ..Sampling::default() };
        let d = s.distribution(&L, &[]);
        let kept: Vec<u32> = (0..5).filter(|&i| p[i as usize] >= 0.3 * p[0]).collect();
        assert_eq!(d.iter().map(|x| x.0).collect::<Vec<_>>(), kept);
        assert_eq!(kept, vec![0, 1]);
    }

    #[test]
    fn chains_apply_in_the_documented_order() {
        // Bias moves token 4 to the top, then top-k 2 keeps 4 and 0.
        let s = Sampling { logit_bias: vec![(4, 5.0)], top_k: 2, ..Sampling::default() };
        assert_eq!(s.distribution(&L, &[]).iter().map(|x| x.0).collect::<Vec<_>>(), vec![0, 4]);
        // top-p applies to what top-k left (renormalized).
        let s = Sampling { top_k: 2, top_p: 0.7, ..Sampling::default() };
        let p = softmax_ref(&L[..2]);
        assert!(p[0] > 0.7);
        assert_eq!(s.distribution(&L, &[]), vec![(0, 1.0)]);
        // Temperature first: a hot distribution lets more tokens past min-p...
        let hot_first = Sampling { temperature: 2.0, min_p: 0.35, ..Sampling::default() };
        // ...temperature last: min-p decides on the untempered distribution, then T reshapes.
        let hot_last = Sampling { temperature_last: true, ..hot_first.clone() };
        let first = hot_first.distribution(&L, &[]);
        let last = hot_last.distribution(&L, &[]);
        assert_eq!(first.iter().map(|x| x.0).collect::<Vec<_>>(), vec![0, 1, 2, 3]);
        assert_eq!(last.iter().map(|x| x.0).collect::<Vec<_>>(), vec![0, 1]);
        let w = softmax_ref(&[L[0] / 2.0, L[1] / 2.0]);
        assert!(close(last[0].1, w[0]) && close(last[1].1, w[1]));
        // Penalties before temperature: a repeated token loses its lead.
        let s = Sampling { frequency_penalty: 2.0, temperature: 0.0, ..Sampling::default() };
        assert_eq!(s.distribution(&L, &[0]), vec![(1, 1.0)]);
    }

    #[test]
    fn draw_is_the_inverse_cdf() {
        let d = [(3, 0.25), (7, 0.5), (9, 0.25)];
        assert_eq!(draw(&d, 0.0), Some((3, 0.25)));
        assert_eq!(draw(&d, 0.2499), Some((3, 0.25)));
        assert_eq!(draw(&d, 0.25), Some((7, 0.5)));
        assert_eq!(draw(&d, 0.9999), Some((9, 0.25)));
        assert_eq!(draw(&[], 0.5), None);
    }

    #[test]
    fn parameters_are_range_checked() {
        let all = Accept { top_k: true, top_p: true, min_p: true };
        let parse = |j: &str, a: Accept| {
            let mut p = Params::parse(j).unwrap();
            let s = Sampling::from_params(&mut p, 10, a)?;
            p.finish().map(|_| s)
        };
        assert!(parse(r#"{"temperature": 2.5}"#, all).is_err());
        assert!(parse(r#"{"top_k": 11}"#, all).is_err());
        assert!(parse(r#"{"logit_bias": {"10": 1}}"#, all).unwrap_err().contains("outside the vocabulary"));
        assert!(parse(r#"{"logit_bias": {"3": 101}}"#, all).is_err());
        assert!(parse(r#"{"min_p": 0.1}"#, Accept { min_p: false, ..all })
            .unwrap_err()
            .contains("unknown parameter min_p"));
        let s =
            parse(r#"{"temperature": 0.5, "top_k": 3, "top_p": 0.9, "min_p": 0.05, "logit_bias": {"2": -100}}"#, all)
                .unwrap();
        assert_eq!((s.temperature, s.top_k, s.top_p, s.min_p, s.logit_bias), (0.5, 3, 0.9, 0.05, vec![(2, -100.0)]));
    }
}
