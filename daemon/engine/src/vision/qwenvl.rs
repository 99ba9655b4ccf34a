//! Qwen2.5-VL's and Qwen3-VL's vision transformer and patch merger, over one image's patches at
//! once, on the language model's kernels and thread pool.
//!
//! The input is any size in whole merged patches (`patch * merge` pixels each way, see
//! [`ClipConfig::input_size`]). Its patches are embedded by one product (the temporal pair of
//! kernels summed: a still image is both frames) and put in the merger's order: each 2 x 2
//! group of patches together, the groups by window (`WINDOW` pixels a side, the groups of a
//! window in raster order, windows in raster order). Then pre-norm layers: RMS norm, Q, K and
//! V with biases, a 2-D rotation (a quarter of each head's pairs turned by the patch's row, a
//! quarter by its column, over each half of the head), attention within each window (every
//! `window_pattern`-th layer: over the whole image), RMS norm, a SiLU-gated feed-forward.
//! A last RMS norm; the merger takes each group of 4 patches as one row through `mm.0`, GELU,
//! `mm.2`; the rows go back to raster order over the merged grid, one image token each.
//!
//! Qwen2-VL's differs in its layer norms, its plain quick-GELU feed-forward and having no
//! windows. Qwen3-VL's differs: the patch embedding has a bias, learned positions (a square grid,
//! resized bilinearly with corners aligned to the image's grid) are added to it, its norms are
//! layer norms, its feed-forward a plain GELU one, no layer has windows; and each deepstack
//! layer's output is merged by a merger of its own (the group's row layer-normed, then
//! `fc1`, GELU, `fc2`), its rows appended to the main merger's: an image token of
//! `out_width` is `[main | deepstack 0 | deepstack 1 | ...]`.

use super::clip::{ClipConfig, ClipWeights, Deepstack, LayerNorm, Linear, Projector};
use super::siglip::{attention, gelu, layer_norm, linear, patch_rows, products};
use inferd_kernels::pool::ThreadPool;
use inferd_kernels::Kernels;

/// The side of an attention window, in pixels (Qwen2.5-VL's `window_size`).
pub const WINDOW: usize = 112;

/// The RoPE base of the encoder's 2-D rotation.
const ROPE_BASE: f32 = 10000.0;

/// The order the encoder runs an image's patches in, for a grid of `mw x mh` merged patches.
#[derive(Debug, PartialEq)]
pub struct Order {
    /// Merged patches (raster indices over the merged grid) in the order they run.
    pub merged: Vec<usize>,
    /// Where each window starts and ends among them (one span over all without windows).
    pub windows: Vec<std::ops::Range<usize>>,
}

/// The running order of a `mw x mh` grid of merged patches in windows of `side` of them
/// (`None`: one window over everything, in raster order).
pub fn order(mw: usize, mh: usize, side: Option<usize>) -> Order {
    let Some(side) = side.filter(|&s| s > 0) else {
        return Order { merged: (0..mw * mh).collect(), windows: std::iter::once(0..mw * mh).collect() };
    };
    let (mut merged, mut windows) = (Vec::with_capacity(mw * mh), Vec::new());
    for y in (0..mh).step_by(side) {
        for x in (0..mw).step_by(side) {
            let start = merged.len();
            for dy in 0..side.min(mh - y) {
                merged.extend((x..(x + side).min(mw)).map(|xx| (y + dy) * mw + xx));
            }
            windows.push(start..merged.len());
        }
    }
    Order { merged, windows }
}

/// The image tokens of `planes` (the normalized input, three planes of `width x height`, each
/// a multiple of `patch * merge`): `(width / (patch * merge)) * (height / (patch * merge))`
/// rows of `cfg.out_width` floats, in raster order. `(up, down, deepstack)` is the merger
/// ([`super::clip::Head::Merger`]). `None` where `stop` said so before a layer.
pub fn encode(
    pool: &ThreadPool,
    k: &Kernels,
    cfg: &ClipConfig,
    w: &ClipWeights,
    (up, down, deepstack): (&Linear, &Linear, &[Deepstack]),
    (planes, (width, height)): (&[f32], (usize, usize)),
    stop: &dyn Fn() -> bool,
) -> Option<Vec<f32>> {
    let (p, e, m) = (cfg.patch, cfg.hidden, cfg.merge);
    let (mw, mh) = (width / (p * m), height / (p * m));
    let (n, g) = (mw * mh * m * m, m * m);
    let windowed = cfg.window_pattern > 0;
    let ord = order(mw, mh, windowed.then_some(WINDOW / (p * m)));
    // Patch i runs as member i % g of merged patch ord.merged[i / g]; its grid (row, column).
    let at = |i: usize| {
        let t = ord.merged[i / g];
        ((t / mw) * m + (i % g) / m, (t % mw) * m + i % m)
    };
    let patches = patch_rows(pool, planes, (width, height), p, n, &at);
    let mut x = linear(pool, k, &w.patch, &patches, n);
    if !w.positions.is_empty() {
        let pos = resized_positions(&w.positions, cfg.grid(), e, (width / p, height / p));
        for (i, row) in x.chunks_exact_mut(e).enumerate() {
            let (py, px) = at(i);
            row.iter_mut().zip(&pos[(py * (width / p) + px) * e..][..e]).for_each(|(x, p)| *x += p);
        }
    }
    // Qwen2.5-VL's norms are RMS norms (no bias), Qwen3-VL's layer norms.
    let rms = cfg.projector == Projector::Qwen25Vl;
    let norm = |x: &[f32], ln: &LayerNorm, out: &mut [f32]| match rms {
        true => rms_norm(pool, x, &ln.w, cfg.eps, out),
        false => layer_norm(pool, x, ln, cfg.eps, out),
    };
    let rows = ord.merged.len();
    let ow = down.w.rows;
    // The merged rows: the main merger's, then each deepstack merger's (processing order).
    let mut merged = vec![Vec::new(); 1 + deepstack.len()];
    let angles = rotations(cfg.head_dim, n, &at);
    let mut h = vec![0.0; n * e];
    for (il, l) in w.layers.iter().enumerate() {
        if stop() {
            return None;
        }
        norm(&x, &l.ln1, &mut h);
        let [mut q, mut kk, v] = products(pool, k, [&l.q, &l.k, &l.v], &h, n);
        rotate(pool, &mut q, &angles, cfg.head_dim);
        rotate(pool, &mut kk, &angles, cfg.head_dim);
        let full = !windowed || (il + 1) % cfg.window_pattern == 0;
        let whole: Vec<_> = std::iter::once(0..ord.merged.len()).collect();
        let spans = if full { &whole } else { &ord.windows };
        let mut a = vec![0.0; n * e];
        for s in spans.iter().cloned() {
            let r = s.start * g * e..s.end * g * e;
            let o = attention(pool, k, cfg, &q[r.clone()], &kk[r.clone()], &v[r.clone()], s.len() * g);
            a[r].copy_from_slice(&o);
        }
        let o = linear(pool, k, &l.out, &a, n);
        x.iter_mut().zip(&o).for_each(|(x, o)| *x += o);
        norm(&x, &l.ln2, &mut h);
        let f = cfg.ffn;
        let d = match &l.gate {
            Some(gate) => {
                let [mut gt, u] = products(pool, k, [gate, &l.up], &h, n);
                pool.for_rows(&mut gt, f, &|first, rows| (k.swiglu)(rows, &u[first * f..][..rows.len()]));
                linear(pool, k, &l.down, &gt, n)
            }
            None => {
                let mut u = linear(pool, k, &l.up, &h, n);
                match cfg.quick_gelu {
                    true => {
                        pool.for_rows(&mut u, f, &|_, r| r.iter_mut().for_each(|x| *x /= 1.0 + (-1.702 * *x).exp()))
                    }
                    false => gelu(pool, k, &mut u, f),
                }
                linear(pool, k, &l.down, &u, n)
            }
        };
        x.iter_mut().zip(&d).for_each(|(x, d)| *x += d);
        for (j, ds) in deepstack.iter().enumerate().filter(|(_, ds)| ds.layer == il) {
            // The layer's output, each group's `g` patches (consecutive rows) as one row.
            let mut hn = vec![0.0; n * e];
            layer_norm(pool, &x, &ds.norm, cfg.eps, &mut hn);
            merged[1 + j] = mlp(pool, k, (&ds.fc1, &ds.fc2), &hn, rows);
        }
    }
    norm(&x, &w.post_ln, &mut h);
    merged[0] = mlp(pool, k, (up, down), &h, rows);
    // Each image token: its rows side by side, in raster order.
    let width_out = ow * merged.len();
    let mut out = vec![0.0; rows * width_out];
    for (i, &t) in ord.merged.iter().enumerate() {
        for (j, m) in merged.iter().enumerate() {
            out[t * width_out + j * ow..][..ow].copy_from_slice(&m[i * ow..][..ow]);
        }
    }
    Some(out)
}

/// `rows` rows of `x` through `up`, GELU, `down`.
fn mlp(pool: &ThreadPool, k: &Kernels, (up, down): (&Linear, &Linear), x: &[f32], rows: usize) -> Vec<f32> {
    let mut u = linear(pool, k, up, x, rows);
    gelu(pool, k, &mut u, up.w.rows);
    linear(pool, k, down, &u, rows)
}

/// A `grid x grid` table of `e`-wide learned positions resized to `(w, h)` (columns, rows):
/// bilinear with the corners aligned, as llama.cpp's `ggml_interpolate` computes it (the
/// source coordinate `i / ((out - 1) / (in - 1))` in f32, its neighbours clamped); the table
/// itself where the sizes agree. Rows in raster order.
pub fn resized_positions(table: &[f32], grid: usize, e: usize, (w, h): (usize, usize)) -> Vec<f32> {
    if (w, h) == (grid, grid) {
        return table.to_vec();
    }
    let axis = |out: usize, i: usize| {
        let sf = if out > 1 && grid > 1 { (out - 1) as f32 / (grid - 1) as f32 } else { out as f32 / grid as f32 };
        let s = i as f32 / sf;
        let lo = (s.floor().max(0.0) as usize).min(grid - 1);
        let hi = (lo + 1).min(grid - 1);
        (lo, hi, (s - lo as f32).clamp(0.0, 1.0))
    };
    let mut out = vec![0.0; w * h * e];
    for y in 0..h {
        let (y0, y1, dy) = axis(h, y);
        for x in 0..w {
            let (x0, x1, dx) = axis(w, x);
            let at = |yy: usize, xx: usize| &table[(yy * grid + xx) * e..][..e];
            let (a, b, c, d) = (at(y0, x0), at(y0, x1), at(y1, x0), at(y1, x1));
            for (i, o) in out[(y * w + x) * e..][..e].iter_mut().enumerate() {
                *o = a[i] * (1.0 - dx) * (1.0 - dy) + b[i] * dx * (1.0 - dy) + c[i] * (1.0 - dx) * dy + d[i] * dx * dy;
            }
        }
    }
    out
}

/// Each row of `x` RMS-normed into `out` with weight `w`.
fn rms_norm(pool: &ThreadPool, x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let e = w.len();
    pool.for_rows(out, e, &|r, rows| {
        for (i, o) in rows.chunks_exact_mut(e).enumerate() {
            inferd_kernels::ops::rms_norm(&x[(r + i) * e..][..e], w, eps, o);
        }
    });
}

/// Each patch's `(sin, cos)` for the pairs of a head of `head_dim`: the first quarter of the
/// pairs turned by its row, the second by its column, each quarter's frequencies from the
/// base down (`base^(-4j / head_dim)` for its `j`-th pair), the angle stepped in f32 as
/// llama.cpp's rotation cache does.
fn rotations(head_dim: usize, n: usize, at: &dyn Fn(usize) -> (usize, usize)) -> Vec<(f32, f32)> {
    let (pairs, quarter) = (head_dim / 2, head_dim / 4);
    let step = ROPE_BASE.powf(-2.0 / pairs as f32);
    let mut out = Vec::with_capacity(n * pairs);
    for i in 0..n {
        let (y, x) = at(i);
        let mut theta = 0.0;
        for j in 0..pairs {
            theta = match j {
                0 => y as f32,
                j if j == quarter => x as f32,
                _ => theta * step,
            };
            let (s, c) = theta.sin_cos();
            out.push((s, c));
        }
    }
    out
}

/// Rotates every head of every row of `x` (pair `j` is values `j` and `j + head_dim / 2`) by
/// its patch's angles.
fn rotate(pool: &ThreadPool, x: &mut [f32], angles: &[(f32, f32)], head_dim: usize) {
    let pairs = head_dim / 2;
    let width = x.len() / (angles.len() / pairs).max(1);
    pool.for_rows(x, width, &|first, rows| {
        for (t, row) in rows.chunks_exact_mut(width).enumerate() {
            let a = &angles[(first + t) * pairs..][..pairs];
            for head in row.chunks_exact_mut(head_dim) {
                for (j, &(s, c)) in a.iter().enumerate() {
                    let (x0, x1) = (head[j], head[j + pairs]);
                    head[j] = x0 * c - x1 * s;
                    head[j + pairs] = x0 * s + x1 * c;
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_group_the_merged_grid_and_cover_it_once() {
        // 5 x 3 merged patches in windows of 2: (0,0) (2,0) (4,0) on the first two rows, then
        // the last row's three.
        let o = order(5, 3, Some(2));
        assert_eq!(o.merged, [0, 1, 5, 6, 2, 3, 7, 8, 4, 9, 10, 11, 12, 13, 14]);
        assert_eq!(o.windows, [0..4, 4..8, 8..10, 10..12, 12..14, 14..15]);
        let mut seen = o.merged.clone();
        seen.sort_unstable();
        assert_eq!(seen, (0..15).collect::<Vec<_>>());
        assert_eq!(order(3, 2, None), Order { merged: (0..6).collect(), windows: std::iter::once(0..6).collect() });
    }

    #[test]
    fn the_rotation_turns_rows_then_columns() {
        // A head of 8: pairs 0-1 by the row, 2-3 by the column, frequencies 1 and 10000^-0.5.
        let a = rotations(8, 1, &|_| (3, 5));
        let f = 10000f32.powf(-0.5);
        let want = [3.0, 3.0 * f, 5.0, 5.0 * f].map(|t: f32| t.sin_cos());
        for (g, w) in a.iter().zip(want) {
            assert!((g.0 - w.0).abs() < 1e-6 && (g.1 - w.1).abs() < 1e-6, "{a:?}");
        }
    }
}
