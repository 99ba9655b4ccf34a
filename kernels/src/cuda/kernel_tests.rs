//! Every CUDA kernel against the CPU backend's operation or a float64 reference, through a
//! `Runner`: on the host everywhere (`host_shim.h` runs each kernel's blocks with real threads,
//! barriers for `__syncthreads` and the warp shuffles), and on the GPU through the launch layer
//! (`super::launch::Gpu`) where there is one (elsewhere that test is ignored with the reason;
//! `tests/gpu/run` runs it). The host run checks the kernels' logic; the GPU run adds the
//! device's own math, memory and launch geometry.

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
fn run(op: &str, params: &[f64], inputs: &[(&str, Vec<u8>)]) -> Vec<f32> {
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
    raw.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// The kernels as the checks call them: inputs in, output out.
trait Runner {
    fn rms_norm(&self, x: &[f32], w: &[f32], eps: f32) -> Vec<f32>;
    #[allow(clippy::too_many_arguments)]
    fn rope(&self, x: &[f32], pos: &[i32], freq: &[f32], heads: usize, hd: usize, neox: bool, scale: f32) -> Vec<f32>;
    fn gated_act(&self, gate: &[f32], up: &[f32], gelu: bool) -> Vec<f32>;
    fn matvec(&self, dtype: DType, w: &[u8], rows: usize, cols: usize, x: &[f32]) -> Vec<f32>;
    fn embed(&self, dtype: DType, table: &[u8], ids: &[i32], cols: usize, scale: f32) -> Vec<f32>;
    fn kv_attention(&self, a: &AttentionCase) -> Vec<f32>;
}

/// Tokens' K/V stored into a pool of `blocks` blocks, then queries attending over their
/// sequences' block tables (`table_len` entries each).
struct AttentionCase {
    k: Vec<f32>,
    v: Vec<f32>,
    slots: Vec<i32>,
    q: Vec<f32>,
    tables: Vec<i32>,
    table_len: usize,
    table_of: Vec<i32>,
    q_pos: Vec<i32>,
    heads: (usize, usize),
    hd: usize,
    bs: usize,
    blocks: usize,
    window: usize,
    scale: f32,
}

/// The kernels compiled for the host with `host_shim.h`.
struct Host;

impl Runner for Host {
    fn rms_norm(&self, x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
        let n = w.len();
        run("rms_norm", &[(x.len() / n) as f64, n as f64, f64::from(eps)], &[("x", f32s(x)), ("w", f32s(w))])
    }
    fn rope(&self, x: &[f32], pos: &[i32], freq: &[f32], heads: usize, hd: usize, neox: bool, scale: f32) -> Vec<f32> {
        let params =
            [pos.len() as f64, heads as f64, hd as f64, freq.len() as f64, f64::from(u8::from(neox)), f64::from(scale)];
        run("rope", &params, &[("x", f32s(x)), ("pos", i32s(pos)), ("inv_freq", f32s(freq))])
    }
    fn gated_act(&self, gate: &[f32], up: &[f32], gelu: bool) -> Vec<f32> {
        run("gated_act", &[gate.len() as f64, f64::from(u8::from(gelu))], &[("gate", f32s(gate)), ("up", f32s(up))])
    }
    fn matvec(&self, dtype: DType, w: &[u8], rows: usize, cols: usize, x: &[f32]) -> Vec<f32> {
        let rb = dtype.bytes_for(cols).unwrap();
        let params = [f64::from(dtype.ggml_type()), rows as f64, cols as f64, (x.len() / cols) as f64, rb as f64];
        run("matvec", &params, &[("w", w.to_vec()), ("x", f32s(x))])
    }
    fn embed(&self, dtype: DType, table: &[u8], ids: &[i32], cols: usize, scale: f32) -> Vec<f32> {
        let rb = dtype.bytes_for(cols).unwrap();
        let params = [f64::from(dtype.ggml_type()), rb as f64, ids.len() as f64, cols as f64, f64::from(scale)];
        run("embed", &params, &[("table", table.to_vec()), ("ids", i32s(ids))])
    }
    fn kv_attention(&self, a: &AttentionCase) -> Vec<f32> {
        let params = [
            a.q_pos.len() as f64,
            a.heads.0 as f64,
            a.heads.1 as f64,
            a.hd as f64,
            a.bs as f64,
            a.window as f64,
            f64::from(a.scale),
            a.table_len as f64,
            a.blocks as f64,
        ];
        let inputs = [
            ("k", f32s(&a.k)),
            ("v", f32s(&a.v)),
            ("slot", i32s(&a.slots)),
            ("q", f32s(&a.q)),
            ("tables", i32s(&a.tables)),
            ("table_of", i32s(&a.table_of)),
            ("q_pos", i32s(&a.q_pos)),
        ];
        run("kv_attention", &params, &inputs)
    }
}

/// The kernels on the GPU through the launch layer.
struct Device(super::launch::Gpu);

impl Runner for Device {
    fn rms_norm(&self, x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
        let g = &self.0;
        let (dx, dw, mut dy) = (g.upload(x).unwrap(), g.upload(w).unwrap(), g.zeros::<f32>(x.len()).unwrap());
        g.rms_norm(&dx, &dw, &mut dy, w.len(), eps).unwrap();
        g.download(&dy).unwrap()
    }
    fn rope(&self, x: &[f32], pos: &[i32], freq: &[f32], heads: usize, hd: usize, neox: bool, scale: f32) -> Vec<f32> {
        let g = &self.0;
        let mut dx = g.upload(x).unwrap();
        g.rope(&mut dx, &g.upload(pos).unwrap(), &g.upload(freq).unwrap(), heads, hd, neox, scale).unwrap();
        g.download(&dx).unwrap()
    }
    fn gated_act(&self, gate: &[f32], up: &[f32], gelu: bool) -> Vec<f32> {
        let g = &self.0;
        let mut dg = g.upload(gate).unwrap();
        g.gated_act(&mut dg, &g.upload(up).unwrap(), gelu).unwrap();
        g.download(&dg).unwrap()
    }
    fn matvec(&self, dtype: DType, w: &[u8], rows: usize, cols: usize, x: &[f32]) -> Vec<f32> {
        let g = &self.0;
        let mut dy = g.zeros::<f32>(rows * (x.len() / cols)).unwrap();
        let (dw, dx) = (g.upload(w).unwrap(), g.upload(x).unwrap());
        g.matvec(&dw, dtype.ggml_type(), dtype.bytes_for(cols).unwrap(), rows, cols, &dx, &mut dy).unwrap();
        g.download(&dy).unwrap()
    }
    fn embed(&self, dtype: DType, table: &[u8], ids: &[i32], cols: usize, scale: f32) -> Vec<f32> {
        let g = &self.0;
        let mut dy = g.zeros::<f32>(ids.len() * cols).unwrap();
        let (dt, di) = (g.upload(table).unwrap(), g.upload(ids).unwrap());
        g.embed(&dt, dtype.ggml_type(), dtype.bytes_for(cols).unwrap(), &di, cols, scale, &mut dy).unwrap();
        g.download(&dy).unwrap()
    }
    fn kv_attention(&self, a: &AttentionCase) -> Vec<f32> {
        let g = &self.0;
        let pool = a.blocks * a.bs * a.heads.1 * a.hd;
        let (mut kc, mut vc) = (g.zeros::<u16>(pool).unwrap(), g.zeros::<u16>(pool).unwrap());
        let (dk, dv, ds) = (g.upload(&a.k).unwrap(), g.upload(&a.v).unwrap(), g.upload(&a.slots).unwrap());
        g.kv_store(&dk, &dv, &mut kc, &mut vc, &ds, a.heads.1 * a.hd).unwrap();
        let mut out = g.zeros::<f32>(a.q.len()).unwrap();
        let (dq, tables) = (g.upload(&a.q).unwrap(), g.upload(&a.tables).unwrap());
        let (table_of, q_pos) = (g.upload(&a.table_of).unwrap(), g.upload(&a.q_pos).unwrap());
        let window = (a.window > 0).then_some(a.window);
        let geometry = (a.heads, a.hd, a.bs, window, a.scale);
        g.attention(&dq, (&kc, &vc), &tables, &table_of, a.table_len, &q_pos, geometry, &mut out).unwrap();
        g.download(&out).unwrap()
    }
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

fn check_norm_rope_activations(on: &dyn Runner) {
    let (rows, n) = (3, 96);
    let (x, w) = (values(rows * n, 1), values(n, 2));
    let got = on.rms_norm(&x, &w, 1e-6);
    let mut want = vec![0f32; rows * n];
    for r in 0..rows {
        crate::ops::rms_norm(&x[r * n..(r + 1) * n], &w, 1e-6, &mut want[r * n..(r + 1) * n]);
    }
    close(&got, &want, 1e-5, "rms_norm");

    // Partial rotation (12 of 16 dimensions), both pairings, LongRoPE-style magnitude.
    let (tokens, heads, hd, pairs, scale) = (3, 4, 16, 6, 1.118f32);
    let freq = Rope::frequencies(2 * pairs, 10000.0);
    let pos = [0, 7, 300];
    for (style, neox) in [(RopeStyle::Neox, true), (RopeStyle::Interleaved, false)] {
        let x = values(tokens * heads * hd, 3);
        let got = on.rope(&x, &pos, &freq, heads, hd, neox, scale);
        let rope = Rope::with_frequencies(style, freq.clone()).scaled(scale);
        let mut want = x.clone();
        for (t, &p) in pos.iter().enumerate() {
            rope.apply(&mut want[t * heads * hd..(t + 1) * heads * hd], hd, p as usize);
        }
        close(&got, &want, 2e-5, &format!("rope {style:?}"));
    }

    let n = 200;
    let (g, u) = (values(n, 4).iter().map(|v| v * 6.0).collect::<Vec<_>>(), values(n, 5));
    for gelu in [false, true] {
        let got = on.gated_act(&g, &u, gelu);
        let mut want = g.clone();
        if gelu {
            crate::ops::geglu(&mut want, &u);
        } else {
            crate::ops::swiglu(&mut want, &u);
        }
        close(&got, &want, 1e-5, if gelu { "geglu" } else { "swiglu" });
    }
}

fn check_matvec_embed(on: &dyn Runner) {
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
            let got = on.matvec(dtype, &w, rows, cols, &x);
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
        let got = on.embed(dtype, &w, &ids, cols, 2.5);
        let want: Vec<f32> = ids
            .iter()
            .flat_map(|&i| dense[i as usize * cols..(i as usize + 1) * cols].iter().map(|v| v * 2.5))
            .collect();
        assert_eq!(got, want, "{dtype:?} embedding");
    }
}

fn check_attention(on: &dyn Runner) {
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
        let case = AttentionCase {
            k: k.clone(),
            v: v.clone(),
            slots: slots.clone(),
            q: q.clone(),
            tables: tables.concat(),
            table_len: 3,
            table_of: queries.iter().map(|&(s, _)| s as i32).collect(),
            q_pos: queries.iter().map(|&(_, p)| p as i32).collect(),
            heads: (qh, kvh),
            hd,
            bs,
            blocks,
            window,
            scale,
        };
        let got = on.kv_attention(&case);
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

#[test]
fn on_the_host_rms_norm_rope_and_the_activations_compute_what_the_cpu_does() {
    check_norm_rope_activations(&Host);
}

#[test]
fn on_the_host_matvec_and_embed_compute_every_weight_type_as_the_dequantized_product() {
    check_matvec_embed(&Host);
}

#[test]
fn on_the_host_paged_attention_over_scattered_blocks_matches_a_float64_reference() {
    check_attention(&Host);
}

#[test]
#[cfg_attr(not(host_cuda), ignore = "no NVIDIA GPU on this machine (tests/gpu/run runs it where there is one)")]
fn on_the_gpu_every_kernel_computes_what_the_cpu_does() {
    let gpu = super::launch::Gpu::open(&super::tests::scratch("cuda-gpu-cache")).unwrap_or_else(|e| panic!("{e}"));
    eprintln!("GPU: {:?}", gpu.device);
    let d = Device(gpu);
    check_norm_rope_activations(&d);
    check_matvec_embed(&d);
    check_attention(&d);
}
