//! The CUDA kernels' logic on the host: `host_shim.h` runs each kernel's blocks with real
//! threads (barriers for `__syncthreads` and the warp shuffles), and every kernel's output is
//! compared with the CPU backend's operation or a float64 reference. What this cannot show
//! (memory coalescing, occupancy, the device's own math functions) is `tests/gpu/run`'s.

use super::SOURCES;
use crate::ops::{Rope, RopeStyle};
use crate::quant::{dequantize_row, DType, QuantType};
use crate::quantize::random_blocks;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

const SHIM: &str = include_str!("../../cuda/host_shim.h");
const HARNESS: &str = include_str!("../../cuda/host_harness.cpp");

/// The harness, compiled once per test process.
fn harness() -> &'static Path {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    EXE.get_or_init(|| {
        let dir = super::tests::scratch("cuda-host-harness");
        for (name, src) in SOURCES.iter().chain(&[("host_shim.h", SHIM), ("host_harness.cpp", HARNESS)]) {
            std::fs::write(dir.join(name), src).unwrap();
        }
        let exe = dir.join("harness");
        let out = Command::new("c++")
            .args(["-std=c++20", "-O1", "-ffp-contract=off", "-pthread", "-o"])
            .arg(&exe)
            .arg(dir.join("host_harness.cpp"))
            .output()
            .expect("a C++ compiler (c++)");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        exe
    })
}

/// Runs kernel `op` on the host with `params` and the named inputs; returns its output.
fn run<T: Copy + Default>(op: &str, params: &[f64], inputs: &[(&str, Vec<u8>)]) -> Vec<T> {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let dir =
        super::tests::scratch(&format!("cuda-host-{op}-{}", N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)));
    let p: Vec<u8> = params.iter().flat_map(|x| x.to_le_bytes()).collect();
    std::fs::write(dir.join("params"), p).unwrap();
    for (name, bytes) in inputs {
        std::fs::write(dir.join(name), bytes).unwrap();
    }
    let out = Command::new(harness()).arg(op).arg(&dir).output().unwrap();
    assert!(out.status.success(), "{op}: {}", String::from_utf8_lossy(&out.stderr));
    let raw = std::fs::read(dir.join("out")).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let n = raw.len() / std::mem::size_of::<T>();
    let mut v = vec![T::default(); n];
    // SAFETY: `v` holds n values of a plain-old-data T (f32 here), n * size_of::<T>() bytes
    // are copied from `raw`, which has at least that many.
    unsafe { std::ptr::copy_nonoverlapping(raw.as_ptr(), v.as_mut_ptr().cast::<u8>(), n * std::mem::size_of::<T>()) };
    v
}

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn i32s(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn close(got: &[f32], want: &[f32], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= tol * (1.0 + w.abs()), "{what} [{i}]: {g} vs {w}");
    }
}

#[test]
fn rms_norm_rope_and_the_activations_compute_what_the_cpu_does() {
    let (rows, n) = (3, 96);
    let (x, w) = (values(rows * n, 1), values(n, 2));
    let got: Vec<f32> = run("rms_norm", &[rows as f64, n as f64, 1e-6], &[("x", f32s(&x)), ("w", f32s(&w))]);
    let mut want = vec![0f32; rows * n];
    for r in 0..rows {
        crate::ops::rms_norm(&x[r * n..(r + 1) * n], &w, 1e-6, &mut want[r * n..(r + 1) * n]);
    }
    close(&got, &want, 1e-5, "rms_norm");

    // Partial rotation (12 of 16 dimensions), both pairings, LongRoPE-style magnitude.
    let (tokens, heads, hd, pairs, scale) = (3, 4, 16, 6, 1.118f32);
    let freq = Rope::frequencies(2 * pairs, 10000.0);
    let pos = [0, 7, 300];
    for (style, neox) in [(RopeStyle::Neox, 1.0), (RopeStyle::Interleaved, 0.0)] {
        let x = values(tokens * heads * hd, 3);
        let params = [tokens as f64, heads as f64, hd as f64, pairs as f64, neox, f64::from(scale)];
        let inputs = [("x", f32s(&x)), ("pos", i32s(&pos)), ("inv_freq", f32s(&freq))];
        let got: Vec<f32> = run("rope", &params, &inputs);
        let rope = Rope::with_frequencies(style, freq.clone()).scaled(scale);
        let mut want = x.clone();
        for (t, &p) in pos.iter().enumerate() {
            rope.apply(&mut want[t * heads * hd..(t + 1) * heads * hd], hd, p as usize);
        }
        close(&got, &want, 2e-5, &format!("rope {style:?}"));
    }

    let n = 200;
    let (g, u) = (values(n, 4).iter().map(|v| v * 6.0).collect::<Vec<_>>(), values(n, 5));
    for gelu in [0.0, 1.0] {
        let got: Vec<f32> = run("gated_act", &[n as f64, gelu], &[("gate", f32s(&g)), ("up", f32s(&u))]);
        let mut want = g.clone();
        if gelu == 0.0 {
            crate::ops::swiglu(&mut want, &u);
        } else {
            crate::ops::geglu(&mut want, &u);
        }
        close(&got, &want, 1e-5, if gelu == 0.0 { "swiglu" } else { "geglu" });
    }
}

#[test]
fn matvec_and_embed_compute_every_weight_type_as_the_dequantized_product() {
    let (rows, cols) = (37, 512);
    let types: Vec<DType> =
        QuantType::ALL.iter().map(|q| q.dtype()).chain([DType::F16, DType::BF16, DType::F32]).collect();
    for dtype in types {
        let row_bytes = dtype.bytes_for(cols).unwrap();
        let w: Vec<u8> = match dtype.class() {
            crate::quant::WeightClass::Quantized(q) => {
                random_blocks(q, rows * cols / q.block_len(), 11 + u64::from(dtype.ggml_type()))
            }
            crate::quant::WeightClass::Float(_) => {
                let v = values(rows * cols, 12);
                match dtype {
                    DType::F16 => v.iter().flat_map(|x| half::f16::from_f32(*x).to_le_bytes()).collect(),
                    DType::BF16 => v.iter().flat_map(|x| half::bf16::from_f32(*x).to_le_bytes()).collect(),
                    _ => f32s(&v),
                }
            }
        };
        let mut dense = vec![0f32; rows * cols];
        for r in 0..rows {
            dequantize_row(dtype, &w[r * row_bytes..(r + 1) * row_bytes], &mut dense[r * cols..(r + 1) * cols]);
        }
        for tokens in [1usize, 3, 8] {
            let x = values(tokens * cols, 13 + tokens as u64);
            let params = [f64::from(dtype.ggml_type()), rows as f64, cols as f64, tokens as f64, row_bytes as f64];
            let got: Vec<f32> = run("matvec", &params, &[("w", w.clone()), ("x", f32s(&x))]);
            assert_eq!(got.len(), rows * tokens);
            for t in 0..tokens {
                for r in 0..rows {
                    let (wr, xt) = (&dense[r * cols..(r + 1) * cols], &x[t * cols..(t + 1) * cols]);
                    let want: f64 = wr.iter().zip(xt).map(|(a, b)| f64::from(*a) * f64::from(*b)).sum();
                    let mag: f64 = wr.iter().zip(xt).map(|(a, b)| (f64::from(*a) * f64::from(*b)).abs()).sum();
                    let g = f64::from(got[t * rows + r]);
                    assert!((g - want).abs() <= 1e-5 * mag + 1e-6, "{dtype:?} token {t} row {r}: {g} vs {want}");
                }
            }
        }
        // The embedding lookup of the same table: the dequantized rows, scaled.
        let ids = [3, 0, 36];
        let params = [f64::from(dtype.ggml_type()), row_bytes as f64, 3.0, cols as f64, 2.5];
        let got: Vec<f32> = run("embed", &params, &[("table", w.clone()), ("ids", i32s(&ids))]);
        let want: Vec<f32> = ids
            .iter()
            .flat_map(|&i| dense[i as usize * cols..(i as usize + 1) * cols].iter().map(|v| v * 2.5))
            .collect();
        assert_eq!(got, want, "{dtype:?} embedding");
    }
}

#[test]
fn paged_attention_over_scattered_blocks_matches_a_float64_reference() {
    // Two sequences in a pool of 9 blocks of 4 positions, their blocks scattered: sequence 0
    // has 11 positions and queries its last 3 (a prefill chunk), sequence 1 has 6 and queries
    // its last (decode). 4 query heads share 2 KV heads.
    let (qh, kvh, bs, blocks) = (4usize, 2usize, 4usize, 9usize);
    let tables: [[i32; 3]; 2] = [[7, 2, 5], [0, 8, 1]];
    let lens = [11usize, 6];
    for (hd, window) in [(64usize, 0usize), (40, 5)] {
        let kv_dim = kvh * hd;
        let mut slots = Vec::new();
        let mut kv_of = Vec::new(); // (seq, pos) of each stored row
        for (s, &len) in lens.iter().enumerate() {
            for p in 0..len {
                slots.push(tables[s][p / bs] * bs as i32 + (p % bs) as i32);
                kv_of.push((s, p));
            }
        }
        let k = values(slots.len() * kv_dim, 21);
        let v = values(slots.len() * kv_dim, 22);
        let queries: Vec<(usize, usize)> = vec![(0, 8), (0, 9), (0, 10), (1, 5)];
        let q = values(queries.len() * qh * hd, 23);
        let scale = 1.0 / (hd as f32).sqrt();
        let params = [
            queries.len() as f64,
            qh as f64,
            kvh as f64,
            hd as f64,
            bs as f64,
            window as f64,
            f64::from(scale),
            3.0,
            blocks as f64,
        ];
        let inputs = [
            ("k", f32s(&k)),
            ("v", f32s(&v)),
            ("slot", i32s(&slots)),
            ("q", f32s(&q)),
            ("tables", i32s(&tables.concat())),
            ("table_of", i32s(&queries.iter().map(|&(s, _)| s as i32).collect::<Vec<_>>())),
            ("q_pos", i32s(&queries.iter().map(|&(_, p)| p as i32).collect::<Vec<_>>())),
        ];
        let got: Vec<f32> = run("kv_attention", &params, &inputs);
        let round = |x: f32| f64::from(half::f16::from_f32(x).to_f32());
        for (i, &(s, p)) in queries.iter().enumerate() {
            let first = if window > 0 { (p + 1).saturating_sub(window) } else { 0 };
            for h in 0..qh {
                let g = h / (qh / kvh);
                let qv = &q[(i * qh + h) * hd..(i * qh + h + 1) * hd];
                let rows: Vec<usize> =
                    (first..=p).map(|pp| kv_of.iter().position(|&x| x == (s, pp)).unwrap()).collect();
                let scores: Vec<f64> = rows
                    .iter()
                    .map(|&r| {
                        let kr = &k[r * kv_dim + g * hd..r * kv_dim + (g + 1) * hd];
                        qv.iter().zip(kr).map(|(a, b)| f64::from(*a) * round(*b)).sum::<f64>() * f64::from(scale)
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for d in 0..hd {
                    let want: f64 =
                        rows.iter().zip(&e).map(|(&r, w)| w * round(v[r * kv_dim + g * hd + d])).sum::<f64>() / z;
                    let gv = f64::from(got[(i * qh + h) * hd + d]);
                    assert!(
                        (gv - want).abs() <= 1e-5,
                        "hd {hd} window {window} query {i} head {h} dim {d}: {gv} vs {want}"
                    );
                }
            }
        }
    }
}
