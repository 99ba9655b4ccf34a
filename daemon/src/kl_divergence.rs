//! Accuracy against full precision: the KL divergence of a model's next-token distributions
//! from a reference's, token by token, summarized as `llama-perplexity --kl-divergence` does.
//!
//! The reference is the file `llama-perplexity --kl-divergence-base FILE` writes (llama.cpp's
//! format, read here so both programs are measured on the same tokens against the same
//! numbers): the magic `_logits_`; `n_ctx`, `n_vocab` and `n_chunk` as little-endian i32; the
//! evaluated tokens, `n_chunk * n_ctx` i32; then, chunk by chunk, one record per scored
//! position `n_ctx / 2 .. n_ctx - 1` (each predicts the token after it): two f32, `scale` and
//! `min`, then `n_vocab` u16 values `q` padded to an even count, standing for the
//! log-probability `scale * q + min`. The range is the top 16 nats: anything lower is stored
//! as `min`. A chunk is evaluated from an empty cache; a model that adds BOS sees BOS in place
//! of the chunk's first token.
//!
//! The per-token quantities are llama-perplexity's: KL(base ‖ model) summed over the tokens
//! whose base log-probability is above -16, the negative log-likelihood of the actual next
//! token under each, the difference of its probabilities (Δp), and whether the most likely
//! tokens agree.

use std::fs::File;
use std::io::{BufReader, Read};
use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum KldError {
    #[error("{path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("{0}: not a log-probability file of llama-perplexity --kl-divergence-base (no _logits_ magic)")]
    NotLogProbs(String),
    #[error("{path}: bad header (n_ctx {n_ctx}, n_vocab {n_vocab}, n_chunk {n_chunk})")]
    BadHeader { path: String, n_ctx: i32, n_vocab: i32, n_chunk: i32 },
    #[error("{path}: ends inside chunk {chunk} of {n_chunk}")]
    Truncated { path: String, chunk: usize, n_chunk: usize },
    #[error("{path}: evaluated token {token} is outside the vocabulary of {vocab}")]
    BadToken { path: String, token: i32, vocab: usize },
}

/// The log-probabilities below the top's by more than this many nats are not stored (and are
/// left out of the KL sum), as llama-perplexity does.
pub const RANGE_NATS: f32 = 16.0;

/// A reference log-probability file, read chunk by chunk.
pub struct LogProbFile {
    path: String,
    reader: BufReader<File>,
    pub n_ctx: usize,
    pub n_vocab: usize,
    pub n_chunk: usize,
    /// Every chunk's tokens, `n_chunk * n_ctx`.
    pub tokens: Vec<u32>,
    /// Chunks read so far.
    read: usize,
    raw: Vec<u8>,
}

impl LogProbFile {
    pub fn open(path: &Path) -> Result<Self, KldError> {
        let name = path.display().to_string();
        let io = |source| KldError::Io { path: name.clone(), source };
        let mut reader = BufReader::with_capacity(1 << 20, File::open(path).map_err(io)?);
        let mut head = [0u8; 20];
        reader.read_exact(&mut head).map_err(|_| KldError::NotLogProbs(name.clone()))?;
        if &head[..8] != b"_logits_" {
            return Err(KldError::NotLogProbs(name));
        }
        let int = |at: usize| i32::from_le_bytes([head[at], head[at + 1], head[at + 2], head[at + 3]]);
        let (n_ctx, n_vocab, n_chunk) = (int(8), int(12), int(16));
        if n_ctx < 4 || n_vocab < 2 || n_chunk < 1 {
            return Err(KldError::BadHeader { path: name, n_ctx, n_vocab, n_chunk });
        }
        let (n_ctx, n_vocab, n_chunk) = (n_ctx as usize, n_vocab as usize, n_chunk as usize);
        let mut raw = vec![0u8; 4 * n_ctx * n_chunk];
        reader.read_exact(&mut raw).map_err(|_| KldError::Truncated { path: name.clone(), chunk: 0, n_chunk })?;
        let mut tokens = Vec::with_capacity(n_ctx * n_chunk);
        for b in raw.chunks_exact(4) {
            let t = i32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            if t < 0 || t as usize >= n_vocab {
                return Err(KldError::BadToken { path: name, token: t, vocab: n_vocab });
            }
            tokens.push(t as u32);
        }
        Ok(LogProbFile { path: name, reader, n_ctx, n_vocab, n_chunk, tokens, read: 0, raw: Vec::new() })
    }

    /// The first scored position of a chunk.
    pub fn first(&self) -> usize {
        self.n_ctx / 2
    }

    /// Scored positions per chunk.
    pub fn scored(&self) -> usize {
        self.n_ctx - 1 - self.first()
    }

    /// u16 values per record: the two floats, then the vocabulary padded to an even count.
    pub fn record_len(&self) -> usize {
        2 * self.n_vocab.div_ceil(2) + 4
    }

    /// The tokens of chunk `c`.
    pub fn chunk_tokens(&self, c: usize) -> &[u32] {
        &self.tokens[c * self.n_ctx..(c + 1) * self.n_ctx]
    }

    /// The next chunk's records into `out` (`scored() * record_len()` values).
    pub fn next_chunk(&mut self, out: &mut Vec<u16>) -> Result<(), KldError> {
        let n = self.scored() * self.record_len();
        self.raw.resize(2 * n, 0);
        let truncated = KldError::Truncated { path: self.path.clone(), chunk: self.read, n_chunk: self.n_chunk };
        if self.read >= self.n_chunk {
            return Err(truncated);
        }
        self.reader.read_exact(&mut self.raw).map_err(|_| truncated)?;
        out.clear();
        out.extend(self.raw.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])));
        self.read += 1;
        Ok(())
    }
}

/// One position's reference distribution: `log p[i] = scale * q[i] + min`.
#[derive(Clone, Copy)]
pub struct Record<'a> {
    pub scale: f32,
    pub min: f32,
    pub q: &'a [u16],
}

impl<'a> Record<'a> {
    /// Record `r` of a chunk's values (`record_len` values each, `n_vocab` of them tokens).
    pub fn at(values: &'a [u16], r: usize, record_len: usize, n_vocab: usize) -> Self {
        let v = &values[r * record_len..(r + 1) * record_len];
        let f = |i: usize| f32::from_bits(u32::from(v[i]) | (u32::from(v[i + 1]) << 16));
        Record { scale: f(0), min: f(2), q: &v[4..4 + n_vocab] }
    }

    pub fn log_prob(&self, i: usize) -> f32 {
        self.scale * f32::from(self.q[i]) + self.min
    }

    /// The most likely token (the first on ties).
    pub fn argmax(&self) -> usize {
        first_max(self.q.iter().map(|&q| f32::from(q)))
    }
}

fn first_max(it: impl Iterator<Item = f32>) -> usize {
    let (mut best, mut at) = (f32::NEG_INFINITY, 0);
    for (i, v) in it.enumerate() {
        if v > best {
            (best, at) = (v, i);
        }
    }
    at
}

/// `logits` as log-probabilities, in place; returns the most likely token (the first on ties).
pub fn log_softmax(logits: &mut [f32]) -> usize {
    let top = first_max(logits.iter().copied());
    let max = logits[top];
    let sum: f64 = logits.iter().map(|&l| f64::from((l - max).exp())).sum();
    let shift = max + sum.ln() as f32;
    logits.iter_mut().for_each(|l| *l -= shift);
    top
}

/// One scored position compared with the reference.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TokenStats {
    /// KL(base ‖ model) in nats.
    pub kld: f64,
    /// -log p(next token), the model's and the base's.
    pub nll: f64,
    pub nll_base: f64,
    /// p(next token), the model's minus the base's.
    pub p_diff: f64,
    /// Whether the model's and the base's most likely tokens agree.
    pub same_top: bool,
}

/// The model's log-probabilities `lp` (with its most likely token `top`) against `base`, for
/// the actual next token `next`.
pub fn compare(lp: &[f32], top: usize, base: &Record<'_>, next: usize) -> TokenStats {
    let mut kld = 0.0f64;
    for (i, &l) in lp.iter().enumerate().take(base.q.len()) {
        let b = base.log_prob(i);
        if b > -RANGE_NATS {
            kld += f64::from(b.exp()) * f64::from(b - l);
        }
    }
    let nll = -f64::from(lp[next]);
    let nll_base = -f64::from(base.log_prob(next));
    let p_diff = (-nll).exp() - (-nll_base).exp();
    TokenStats { kld, nll, nll_base, p_diff, same_top: top == base.argmax() }
}

/// The figures llama-perplexity prints after `--kl-divergence`, over every scored token.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Summary {
    pub tokens: usize,
    pub ppl: f64,
    pub ppl_base: f64,
    /// ln(PPL / PPL(base)).
    pub ln_ppl_ratio: f64,
    pub kld_mean: f64,
    /// The standard error of the mean.
    pub kld_mean_err: f64,
    pub kld_median: f64,
    pub kld_p90: f64,
    pub kld_p95: f64,
    pub kld_p99: f64,
    pub kld_p999: f64,
    pub kld_max: f64,
    /// RMS of Δp, in percent.
    pub rms_dp_percent: f64,
    /// How often the most likely tokens agree, in percent.
    pub same_top_percent: f64,
}

/// The mean of `values` and its standard error (llama-perplexity's estimate).
fn mean_err(values: impl Iterator<Item = f64> + Clone) -> (f64, f64) {
    let n = values.clone().count() as f64;
    if n < 1.0 {
        return (0.0, 0.0);
    }
    let (sum, sum2) = values.fold((0.0, 0.0), |(s, s2), v| (s + v, s2 + v * v));
    let mean = sum / n;
    let var = sum2 / n - mean * mean;
    (mean, if var > 0.0 && n > 10.0 { (var / (n - 1.0)).sqrt() } else { 0.0 })
}

/// The `fraction` quantile of sorted `values`, interpolated as llama-perplexity does.
pub fn percentile(sorted: &[f64], fraction: f64) -> f64 {
    let Some(&last) = sorted.last() else { return 0.0 };
    if fraction <= 0.0 {
        return sorted[0];
    }
    if fraction >= 1.0 {
        return last;
    }
    let p = fraction * (sorted.len() - 1) as f64;
    let i = p as usize;
    let f = p - i as f64;
    (1.0 - f) * sorted[i] + f * sorted[(i + 1).min(sorted.len() - 1)]
}

impl Summary {
    pub fn of(stats: &[TokenStats]) -> Summary {
        if stats.is_empty() {
            return Summary::default();
        }
        let mut kld: Vec<f64> = stats.iter().map(|s| s.kld).collect();
        kld.sort_by(f64::total_cmp);
        let (kld_mean, kld_mean_err) = mean_err(stats.iter().map(|s| s.kld));
        let (ln_ppl, _) = mean_err(stats.iter().map(|s| s.nll));
        let (ln_ppl_base, _) = mean_err(stats.iter().map(|s| s.nll_base));
        let (dp2, _) = mean_err(stats.iter().map(|s| s.p_diff * s.p_diff));
        let same = stats.iter().filter(|s| s.same_top).count();
        let n = kld.len();
        let median = if n.is_multiple_of(2) { 0.5 * (kld[n / 2] + kld[n / 2 - 1]) } else { kld[n / 2] };
        Summary {
            tokens: n,
            ppl: ln_ppl.exp(),
            ppl_base: ln_ppl_base.exp(),
            ln_ppl_ratio: ln_ppl - ln_ppl_base,
            kld_mean,
            kld_mean_err,
            kld_median: median,
            kld_p90: percentile(&kld, 0.90),
            kld_p95: percentile(&kld, 0.95),
            kld_p99: percentile(&kld, 0.99),
            kld_p999: percentile(&kld, 0.999),
            kld_max: kld[n - 1],
            rms_dp_percent: 100.0 * dp2.sqrt(),
            same_top_percent: 100.0 * same as f64 / n as f64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// A record as llama-perplexity writes one (its `log_softmax` with a `uint16` output).
    fn record(logits: &[f32]) -> Vec<u16> {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let min = logits.iter().copied().fold(f32::INFINITY, f32::min).max(max - RANGE_NATS);
        let sum: f64 = logits.iter().map(|&l| f64::from((l - max).exp())).sum();
        let min_lp = min - max - sum.ln() as f32;
        let scale = (max - min) / 65535.0;
        let mut out = Vec::new();
        for f in [scale, min_lp] {
            let b = f.to_bits();
            out.extend([b as u16, (b >> 16) as u16]);
        }
        out.extend(logits.iter().map(|&l| if l > min { ((l - min) / scale).round() as u16 } else { 0 }));
        out.resize(2 * logits.len().div_ceil(2) + 4, 0);
        out
    }

    fn write_file(path: &Path, n_ctx: i32, tokens: &[i32], chunks: &[Vec<Vec<f32>>]) {
        let vocab = chunks[0][0].len() as i32;
        let mut f = File::create(path).unwrap();
        f.write_all(b"_logits_").unwrap();
        for v in [n_ctx, vocab, chunks.len() as i32] {
            f.write_all(&v.to_le_bytes()).unwrap();
        }
        tokens.iter().for_each(|t| f.write_all(&t.to_le_bytes()).unwrap());
        for rec in chunks.iter().flatten() {
            record(rec).iter().for_each(|q| f.write_all(&q.to_le_bytes()).unwrap());
        }
    }

    #[test]
    fn a_file_reads_back_and_identical_distributions_diverge_by_nothing() {
        let path = inferd_e2e::temp_dir("kld-read-back").join("base.kld");
        // n_ctx 6: positions 3 and 4 are scored; vocabulary of 5 (odd: padded).
        let logits = |c: usize, r: usize| -> Vec<f32> { (0..5).map(|i| ((i * 7 + c * 3 + r) % 5) as f32).collect() };
        let chunks: Vec<Vec<Vec<f32>>> = (0..2).map(|c| (0..2).map(|r| logits(c, r)).collect()).collect();
        let tokens: Vec<i32> = (0..12).map(|i| i % 5).collect();
        write_file(&path, 6, &tokens, &chunks);
        let mut file = LogProbFile::open(&path).unwrap();
        assert_eq!((file.n_ctx, file.n_vocab, file.n_chunk, file.scored(), file.record_len()), (6, 5, 2, 2, 10));
        assert_eq!(file.chunk_tokens(1), &[1, 2, 3, 4, 0, 1]);
        let mut values = Vec::new();
        let mut stats = Vec::new();
        for c in 0..2 {
            file.next_chunk(&mut values).unwrap();
            for r in 0..2 {
                let base = Record::at(&values, r, file.record_len(), 5);
                let mut lp = logits(c, r);
                let top = log_softmax(&mut lp);
                assert_eq!(top, base.argmax());
                for (i, &l) in lp.iter().enumerate() {
                    assert!((base.log_prob(i) - l).abs() < 1e-3, "{} against {l}", base.log_prob(i));
                }
                stats.push(compare(&lp, top, &base, file.chunk_tokens(c)[file.first() + r + 1] as usize));
            }
        }
        assert!(file.next_chunk(&mut values).is_err(), "a third chunk is past the end");
        let s = Summary::of(&stats);
        assert_eq!((s.tokens, s.same_top_percent), (4, 100.0));
        assert!(s.kld_mean.abs() < 1e-4 && s.kld_max.abs() < 1e-4, "{s:?}");
        assert!((s.ppl / s.ppl_base - 1.0).abs() < 1e-3);
    }

    #[test]
    fn the_divergence_of_a_known_pair_is_its_closed_form() {
        // base: p = (0.5, 0.25, 0.25); model: q = (0.25, 0.5, 0.25).
        let base_logits = [0.5f32.ln(), 0.25f32.ln(), 0.25f32.ln()];
        let values = record(&base_logits);
        let base = Record::at(&values, 0, values.len(), 3);
        let mut lp = [0.25f32.ln(), 0.5f32.ln(), 0.25f32.ln()];
        let top = log_softmax(&mut lp);
        let s = compare(&lp, top, &base, 1);
        let exact = 0.5 * (0.5f64 / 0.25).ln() + 0.25 * (0.25f64 / 0.5).ln();
        assert!((s.kld - exact).abs() < 1e-4, "{} against {exact}", s.kld);
        assert!(!s.same_top);
        assert!((s.nll - 0.5f64.ln().abs()).abs() < 1e-5 && (s.nll_base - 0.25f64.ln().abs()).abs() < 1e-3);
        assert!((s.p_diff - 0.25).abs() < 1e-3);
    }

    #[test]
    fn percentiles_interpolate_between_neighbours() {
        let v: Vec<f64> = (0..11).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.5), 5.0);
        assert!((percentile(&v, 0.99) - 9.9).abs() < 1e-12);
        assert_eq!((percentile(&v, 0.0), percentile(&v, 1.0)), (0.0, 10.0));
    }

    #[test]
    fn a_file_of_something_else_is_refused_by_name() {
        let path = inferd_e2e::temp_dir("kld-refused").join("x");
        std::fs::write(&path, b"GGUF and then some more bytes").unwrap();
        assert!(matches!(LogProbFile::open(&path), Err(KldError::NotLogProbs(_))));
        let mut head = b"_logits_".to_vec();
        for v in [512i32, 10, 2] {
            head.extend(v.to_le_bytes());
        }
        std::fs::write(&path, &head).unwrap();
        assert!(matches!(LogProbFile::open(&path), Err(KldError::Truncated { .. })));
    }
}
