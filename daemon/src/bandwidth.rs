//! The machine's memory read bandwidth, for `inferd bench`: what batch-1 decode (which reads
//! every weight once per token) is measured against.
//!
//! `threads` threads each sum their share of a 1 GiB buffer, far larger than any cache; the
//! best of three passes is reported, in GB/s (10⁹ bytes).

use std::time::Instant;

/// Bytes streamed per pass.
const BYTES: usize = 1 << 30;

/// Read bandwidth with `threads` threads, GB/s.
pub fn read_gb_s(threads: usize) -> f64 {
    let threads = threads.max(1);
    // Written once, so every page is really there (not the shared zero page).
    let buf: Vec<u64> = (0..BYTES / 8).map(|i| i as u64).collect();
    let share = buf.len().div_ceil(threads);
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let t = Instant::now();
        let sums: Vec<u64> = std::thread::scope(|s| {
            let handles: Vec<_> =
                buf.chunks(share).map(|c| s.spawn(move || c.iter().fold(0u64, |a, &x| a.wrapping_add(x)))).collect();
            handles.into_iter().map(|h| h.join().unwrap_or(0)).collect()
        });
        std::hint::black_box(sums);
        best = best.min(t.elapsed().as_secs_f64());
    }
    BYTES as f64 / best / 1e9
}

/// Weight bytes one decode step reads at batch 1: every layer matrix and the output
/// projection (the embedding table is read one row per token, so not counted); of a mixture
/// of experts, the router and the experts a token uses (`used` of each stack's `experts`).
pub fn weight_bytes_per_token(model: &inferd_engine::model::Model) -> usize {
    let w = &model.weights;
    let (used, experts) = model.arch.moe.map_or((1, 1), |m| (m.used, m.experts));
    let layers: usize = w
        .layers
        .iter()
        .map(|l| {
            let dense: usize = l.mixer_matrices().iter().map(|t| t.bytes().len()).sum();
            let ffn: usize = [&l.w_gate, &l.w_up, &l.w_down].iter().map(|t| t.bytes().len() / experts * used).sum();
            dense + ffn + l.router.as_ref().map_or(0, |r| r.bytes().len())
        })
        .sum();
    layers + w.output.bytes().len()
}

#[cfg(test)]
mod tests {
    #[test]
    fn bandwidth_is_a_plausible_figure() {
        // Between a slow laptop's 1 GB/s and any server's 1 TB/s: catches a unit error or a
        // loop the compiler removed.
        let gbs = super::read_gb_s(1);
        assert!((1.0..1000.0).contains(&gbs), "{gbs} GB/s");
    }
}
