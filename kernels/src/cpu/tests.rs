//! Property tests: every fast kernel against the scalar reference on random rows.

use super::{scalar, Kernels, KeysT};
use crate::quant::{quantize_row, BlockQ8, DType, QuantType, QK};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

fn row(len: usize) -> impl Strategy<Value = Vec<f32>> {
    proptest::collection::vec(-4.0f32..4.0, len)
}

fn q8(x: &[f32]) -> Vec<BlockQ8> {
    let mut b = vec![BlockQ8::default(); x.len() / QK];
    scalar::quantize_q8(x, &mut b);
    b
}

fn close(a: f32, b: f32, scale: f32) -> bool {
    (a - b).abs() <= 1e-4 * scale.max(1.0)
}

// Each check takes the table under test; `fast_table_tests!` runs it for every fast table.

fn quantize_q8_matches(k: &Kernels, x: &[f32]) -> Result<(), TestCaseError> {
    let r = q8(x);
    let mut f = vec![BlockQ8::default(); 4];
    (k.quantize_q8)(x, &mut f);
    for (a, b) in r.iter().zip(&f) {
        prop_assert_eq!(a.qs, b.qs);
        prop_assert_eq!(a.d, b.d);
        prop_assert!(close(a.s, b.s, a.s.abs()));
    }
    Ok(())
}

/// Single and four-token dots against the reference.
fn quantized_dots_match(k: &Kernels, w: &[f32], xs: &[Vec<f32>]) -> Result<(), TestCaseError> {
    let acts: Vec<Vec<BlockQ8>> = xs.iter().map(|x| q8(x)).collect();
    let a4 = [&acts[0][..], &acts[1][..], &acts[2][..], &acts[3][..]];
    // The table's dots for each type, reached the way the matmul dispatch reaches them.
    for q in QuantType::ALL {
        let reference = scalar::quant_dots(q).one;
        let (dt, (one, four)) = (q.dtype(), k.quant_dots(q));
        let mut wb = Vec::new();
        quantize_row(dt, w, &mut wb);
        let got4 = four(&wb, a4);
        for r in 0..4 {
            let want = reference(&wb, &acts[r]);
            let scale: f32 = w.iter().zip(&xs[r]).map(|(a, b)| (a * b).abs()).sum();
            prop_assert!(close(want, one(&wb, &acts[r]), scale), "{:?} {:?} single", k.isa, dt);
            prop_assert!(close(want, got4[r], scale), "{:?} {:?} x4 row {}", k.isa, dt, r);
        }
    }
    Ok(())
}

fn float_dots_match(k: &Kernels, w: &[f32], x: &[f32]) -> Result<(), TestCaseError> {
    let scale: f32 = w.iter().zip(x).map(|(a, b)| (a * b).abs()).sum();
    for (dt, reference, got) in [
        (DType::F32, scalar::dot_f32 as super::DotF, k.dot_f32),
        (DType::F16, scalar::dot_f16, k.dot_f16),
        (DType::BF16, scalar::dot_bf16, k.dot_bf16),
    ] {
        let mut wb = Vec::new();
        quantize_row(dt, w, &mut wb);
        prop_assert!(close(reference(&wb, x), got(&wb, x), scale), "{:?}", dt);
    }
    Ok(())
}

fn f16_attention_kernels_match(k: &Kernels, kv: &[f32], q: &[f32], a: f32) -> Result<(), TestCaseError> {
    let kh: Vec<half::f16> = kv.iter().map(|v| half::f16::from_f32(*v)).collect();
    let scale: f32 = kv.iter().zip(q).map(|(a, b)| (a * b).abs()).sum();
    prop_assert!(close(scalar::dot_f16_f32(&kh, q), (k.dot_f16_f32)(&kh, q), scale));
    let mut y1 = q.to_vec();
    let mut y2 = q.to_vec();
    scalar::axpy_f16(a, &kh, &mut y1);
    (k.axpy_f16)(a, &kh, &mut y2);
    for (u, v) in y1.iter().zip(&y2) {
        prop_assert!(close(*u, *v, u.abs()));
    }
    Ok(())
}

/// Scores and weighted values of `g` heads of size `hd` against `n` keys, for the head sizes
/// with AVX-512 value kernels of their own (64, 128, 256) and others (80: a 16-dimension tail
/// after the AVX2 value kernel's 32-wide tiles; 96), fewer and more keys than a vector's lanes
/// (a partial last run of 8 or 16), keys from a block's first slot and from inside it, and
/// head groups that do and do not fill the kernels' tiles (8 or 6 heads for scores, 3 or 4 for
/// values; Qwen2.5's 6 and 7, and 12).
fn grouped_attention_kernels_match(k: &Kernels, kv: &[f32], q: &[f32], p: &[f32]) -> Result<(), TestCaseError> {
    let cases = [
        (64, 3, 5),
        (64, 3, 37),
        (128, 7, 9),
        (256, 4, 20),
        (256, 1, 3),
        (80, 2, 11),
        (96, 5, 17),
        (128, 6, 21),
        (64, 5, 13),
        (128, 12, 7),
    ];
    for (hd, g, n) in cases {
        let take = |v: &[f32], len: usize| -> Vec<f32> {
            (0..len).map(|i| v[i % v.len()] * (1.0 + (i / v.len()) as f32 * 0.1)).collect()
        };
        let key = take(kv, n * hd);
        let (qs, ps) = (take(q, g * hd), take(p, n * g));
        let qt: Vec<f32> = (0..g * hd).map(|x| qs[x % g * hd + x / g]).collect();
        // The keys down the columns of a block's transposed tile: a block of 16 (or as many
        // as the keys) from its first slot, and a wider one from slot 3; the scores and
        // weights in rows longer than the keys, whose ends nothing may touch.
        for (bs, s0) in [(n.max(16), 0), (n + 5, 3)] {
            let mut tile = vec![half::f16::ZERO; hd * bs];
            for (i, d) in (0..n).flat_map(|i| (0..hd).map(move |d| (i, d))) {
                tile[d * bs + s0 + i] = half::f16::from_f32(key[i * hd + d]);
            }
            let keys = KeysT { k: &tile[s0..], bs, n, hd };
            let ahead = [(tile.as_ptr().cast(), 0..tile.len() / 32)];
            let stride = n + 2;
            let (mut s1, mut s2) = (vec![7.0; g * stride], vec![7.0; g * stride]);
            scalar::attn_scores(keys, &qt, g, 0.125, &mut s1, stride, &[]);
            (k.attn_scores)(keys, &qt, g, 0.125, &mut s2, stride, &ahead);
            for (at, (a, b)) in s1.iter().zip(&s2).enumerate() {
                prop_assert!(
                    if at % stride >= n { *a == 7.0 && *b == 7.0 } else { close(*a, *b, hd as f32 / 8.0) },
                    "{:?} scores hd {} g {} n {} bs {}: {} vs {} at {}",
                    k.isa,
                    hd,
                    g,
                    n,
                    bs,
                    a,
                    b,
                    at
                );
            }
        }
        let vh: Vec<half::f16> = key.iter().map(|v| half::f16::from_f32(*v)).collect();
        let stride = n + 3;
        let pw: Vec<f32> =
            (0..g * stride).map(|x| if x % stride < n { ps[x / stride * n + x % stride] } else { f32::NAN }).collect();
        let (mut o1, mut o2) = (qs.clone(), qs.clone());
        scalar::attn_values(&vh, &pw, stride, hd, g, &mut o1);
        (k.attn_values)(&vh, &pw, stride, hd, g, &mut o2);
        for (a, b) in o1.iter().zip(&o2) {
            prop_assert!(close(*a, *b, n as f32), "{:?} values hd {} g {} n {}: {} vs {}", k.isa, hd, g, n, a, b);
        }
    }
    Ok(())
}

fn exp_matches(k: &Kernels, x: &[f32]) -> Result<(), TestCaseError> {
    let mut y = x.to_vec();
    (k.exp)(&mut y);
    for (a, b) in x.iter().zip(&y) {
        let want = a.exp();
        prop_assert!((want - b).abs() <= 2e-6 * want, "exp({}) = {} vs {}", a, b, want);
    }
    Ok(())
}

fn exp_sum_matches(k: &Kernels, x: &[f32]) -> Result<(), TestCaseError> {
    // Shifted by the maximum, as a softmax row is: every value at most 1.
    let shift = x.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    let (mut want, mut got) = (x.to_vec(), x.to_vec());
    let s1 = scalar::exp_sum(&mut want, shift);
    let s2 = (k.exp_sum)(&mut got, shift);
    for (a, b) in want.iter().zip(&got) {
        prop_assert!((a - b).abs() <= 2e-6 * a.max(1e-30), "exp: {} vs {}", a, b);
    }
    prop_assert!((s1 - s2).abs() <= 1e-5 * s1, "sum over {} values: {} vs {}", x.len(), s1, s2);
    Ok(())
}

fn geglu_matches(k: &Kernels, x: &[f32]) -> Result<(), TestCaseError> {
    let up: Vec<f32> = x.iter().map(|v| 1.5 - v / 7.0).collect();
    let mut got = x.to_vec();
    (k.geglu)(&mut got, &up);
    for ((&xi, &ui), g) in x.iter().zip(&up).zip(&got) {
        // Against f64 (in the form `x σ(2y)`: the f64 `1 + tanh y` still cancels to 0 far out).
        let (x, u) = (f64::from(xi), f64::from(ui));
        let y = (2.0 / std::f64::consts::PI).sqrt() * (x + 0.044_715 * x.powi(3));
        let want = x / (1.0 + (-2.0 * y).exp()) * u;
        // f32's rounding of y grows e^(-2y)'s relative error by |2y|.
        let tol = 5e-7 * (4.0 + 2.0 * y.abs()) * want.abs() + 1e-30;
        prop_assert!((want - f64::from(*g)).abs() <= tol, "geglu({}) = {} vs {}", xi, g, want);
    }
    Ok(())
}

fn swiglu_matches(k: &Kernels, x: &[f32]) -> Result<(), TestCaseError> {
    let up: Vec<f32> = x.iter().map(|v| 1.5 - v / 7.0).collect();
    let mut got = x.to_vec();
    (k.swiglu)(&mut got, &up);
    for ((&xi, &ui), g) in x.iter().zip(&up).zip(&got) {
        let (x, u) = (f64::from(xi), f64::from(ui));
        let want = x / (1.0 + (-x).exp()) * u;
        // exp's 2e-6 relative error, where e^(-x) outweighs the 1 (x far left), and f32's
        // roundings of the quotient and product.
        let tol = 3e-6 * want.abs() + 1e-30;
        prop_assert!((want - f64::from(*g)).abs() <= tol, "swiglu({}) = {} vs {}", xi, g, want);
    }
    Ok(())
}

/// The property tests of one fast table, ignored (with the reason) where the processor lacks it.
macro_rules! fast_table_tests {
    ($module:ident, $isa:expr, $present:meta, $why:literal) => {
        mod $module {
            use super::*;

            fn k() -> Kernels {
                super::super::table($isa)
            }

            proptest! {
                #![proptest_config(ProptestConfig::with_cases(200))]

                #[test]
                #[cfg_attr(not($present), ignore = $why)]
                fn quantize_q8_matches_reference(x in row(4 * QK)) {
                    quantize_q8_matches(&k(), &x)?;
                }

                #[test]
                #[cfg_attr(not($present), ignore = $why)]
                fn quantized_dots_match_reference(w in row(8 * QK), xs in proptest::collection::vec(row(8 * QK), 4)) {
                    quantized_dots_match(&k(), &w, &xs)?;
                }

                #[test]
                #[cfg_attr(not($present), ignore = $why)]
                fn float_dots_match_reference(w in row(77), x in row(77)) {
                    float_dots_match(&k(), &w, &x)?;
                }

                #[test]
                #[cfg_attr(not($present), ignore = $why)]
                fn f16_attention_kernels_match_reference(kv in row(67), q in row(67), a in -2.0f32..2.0) {
                    f16_attention_kernels_match(&k(), &kv, &q, a)?;
                }

                #[test]
                #[cfg_attr(not($present), ignore = $why)]
                fn grouped_attention_kernels_match_reference(
                    kv in row(5 * 64), q in row(3 * 64), p in proptest::collection::vec(0.0f32..1.0, 15)
                ) {
                    grouped_attention_kernels_match(&k(), &kv, &q, &p)?;
                }

                #[test]
                #[cfg_attr(not($present), ignore = $why)]
                fn exp_matches_reference(x in proptest::collection::vec(-80.0f32..80.0, 1..40)) {
                    exp_matches(&k(), &x)?;
                }

                #[test]
                #[cfg_attr(not($present), ignore = $why)]
                fn exp_sum_matches_reference(x in proptest::collection::vec(-80.0f32..10.0, 1..300)) {
                    exp_sum_matches(&k(), &x)?;
                }

                #[test]
                #[cfg_attr(not($present), ignore = $why)]
                fn geglu_matches_reference(x in proptest::collection::vec(-60.0f32..60.0, 1..40)) {
                    geglu_matches(&k(), &x)?;
                }

                #[test]
                #[cfg_attr(not($present), ignore = $why)]
                fn swiglu_matches_reference(x in proptest::collection::vec(-120.0f32..120.0, 1..40)) {
                    swiglu_matches(&k(), &x)?;
                }
            }
        }
    };
}

fast_table_tests!(avx2, crate::cpu::Isa::Avx2, host_avx2, "this processor lacks AVX2, FMA or F16C");
fast_table_tests!(avx512, crate::cpu::Isa::Avx512Vnni, host_avx512vnni, "this processor lacks AVX-512 VNNI");

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    #[cfg_attr(not(host_avx512vnni), ignore = "this processor lacks AVX-512 VNNI")]
    fn gemv16_lanes_are_the_single_dots(ws in proptest::collection::vec(row(16 * QK), 16), xs in proptest::collection::vec(row(16 * QK), 1..=crate::cpu::GEMV_TOKENS), blocks in 1usize..=7) {
        // Sixteen rows against 1 to 4 tokens, an odd or even number of blocks (K-quants: one
        // or two super-blocks), with padding after each row as in a wider matrix, from the
        // quantizer and as random bits: every lane of every token must equal that row's
        // single-token dot with that token.
        let k = super::table(super::Isa::Avx512Vnni);
        let gemv = k.gemv16.expect("the AVX-512 table has gemv16");
        for q in QuantType::ALL {
            let per = q.block_len() / QK;
            let (len, n) = if per > 1 { (16 * QK, per * (1 + blocks % 2)) } else { (7 * QK, blocks) };
            let acts: Vec<Vec<BlockQ8>> = xs.iter().map(|x| q8(&x[..n * QK])).collect();
            let halves: Vec<Vec<[i32; 2]>> = acts.iter().map(|a| super::Acts::half_sums(a)).collect();
            let act_refs: Vec<super::Acts<'_>> = acts.iter().zip(&halves).map(|(q8, halves)| super::Acts { q8, halves }).collect();
            let (one, _) = k.quant_dots(q);
            let dt = q.dtype();
            let rb = dt.bytes_for(len).unwrap();
            let mut quantized = Vec::new();
            for w in &ws {
                quantize_row(dt, &w[..len], &mut quantized);
            }
            let random: Vec<u8> = (0..16).flat_map(|r| crate::quantize::random_blocks(q, len / q.block_len(), 100 + r)).collect();
            for wb in [quantized, random] {
                let mut got = vec![[0f32; 16]; acts.len()];
                gemv(q, &wb, rb, &act_refs, &mut got);
                for (t, (out, act)) in got.iter().zip(&acts).enumerate() {
                    for (r, &g) in out.iter().enumerate() {
                        let row = &wb[r * rb..r * rb + dt.bytes_for(n * QK).unwrap()];
                        prop_assert_eq!(g, one(row, act), "{:?} {:?} token {} lane {} of {} blocks", k.isa, dt, t, r, n);
                    }
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(100))]

    #[test]
    #[cfg_attr(not(host_avx2), ignore = "this processor lacks AVX2, FMA or F16C")]
    fn packed_gemv16_lanes_are_the_single_dots(xs in proptest::collection::vec(row(24 * QK), 1..=crate::cpu::GEMV_TOKENS), blocks in 1usize..=8, seed in 0u64..1000) {
        // Sixteen packed rows of random bits, an odd or even number of blocks, against 1 to 16
        // tokens, on every table with a packed kernel (AVX2, and AVX-512 where the processor
        // has it): every lane must equal the single-token dot of the unpacked row.
        let tables: Vec<Kernels> = Kernels::all().into_iter().filter(|k| k.gemv16_packed.is_some()).collect();
        prop_assert!(tables.iter().any(|k| k.isa == super::Isa::Avx2), "the AVX2 table has the packed kernel");
        for k in tables {
            let gemv = k.gemv16_packed.expect("filtered above");
            for q in QuantType::ALL {
                prop_assert!(k.packs(q.dtype()), "{:?} packs {:?}", k.isa, q);
                let dt = q.dtype();
                // Blocks of 32 weights each; super-blocks: one to three (a whole unit and a rest).
                let n = if q.block_len() > QK { q.block_len() / QK * (1 + blocks % 3) } else { blocks };
                let rb = dt.bytes_for(n * QK).unwrap();
                let acts: Vec<Vec<BlockQ8>> = xs.iter().map(|x| q8(&x[..n * QK])).collect();
                let halves: Vec<Vec<[i32; 2]>> = acts.iter().map(|a| super::Acts::half_sums(a)).collect();
                let act_refs: Vec<super::Acts<'_>> = acts.iter().zip(&halves).map(|(q8, halves)| super::Acts { q8, halves }).collect();
                let rows: Vec<u8> = (0..16).flat_map(|r| crate::quantize::random_blocks(q, n * QK / q.block_len(), seed * 16 + r)).collect();
                let packed = crate::pack::pack(&crate::pool::ThreadPool::new(1), dt, 16, n * QK, &rows).unwrap();
                let mut got = vec![[0f32; 16]; acts.len()];
                gemv(q, &packed, rb, &act_refs, &mut got);
                let (one, _) = k.quant_dots(q);
                for (t, (out, act)) in got.iter().zip(&acts).enumerate() {
                    for (r, &g) in out.iter().enumerate() {
                        prop_assert_eq!(g.to_bits(), one(&rows[r * rb..(r + 1) * rb], act).to_bits(), "{:?} {:?} token {} lane {} of {} blocks", k.isa, dt, t, r, n);
                    }
                }
            }
        }
    }
}

#[test]
fn quantized_dot_approximates_float_dot() {
    // The reference itself must be right: compare against a float dot of the dequantized
    // weights, for rows a quantizer wrote and for random bits. The only difference left is the
    // activations' 8-bit rounding.
    let w: Vec<f32> = (0..512).map(|i| ((i * 7919) % 97) as f32 / 48.0 - 1.0).collect();
    let x: Vec<f32> = (0..512).map(|i| ((i * 104729) % 89) as f32 / 44.0 - 1.0).collect();
    let a = q8(&x);
    for q in QuantType::ALL {
        let dot = scalar::quant_dots(q).one;
        let mut quantized = Vec::new();
        quantize_row(q.dtype(), &w, &mut quantized);
        let random = crate::quantize::random_blocks(q, 512 / q.block_len(), 7);
        for wb in [quantized, random] {
            let mut wd = vec![0.0; 512];
            crate::quant::dequantize_row(q.dtype(), &wb, &mut wd);
            let exact: f32 = wd.iter().zip(&x).map(|(a, b)| a * b).sum();
            let scale: f32 = wd.iter().zip(&x).map(|(a, b)| (a * b).abs()).sum();
            let got = dot(&wb, &a);
            assert!((exact - got).abs() < 0.02 * scale.max(1.0), "{q:?}: {exact} vs {got}");
        }
    }
}

#[test]
fn random_bits_take_the_same_products_on_every_table() {
    // Quantizers write a narrow set of bit patterns; every fast table must agree with the
    // reference on arbitrary blocks too.
    let xs: Vec<Vec<f32>> =
        (0..4).map(|t| (0..512).map(|i| (((i + 31 * t) * 104729) % 89) as f32 / 44.0 - 1.0).collect()).collect();
    let acts: Vec<Vec<BlockQ8>> = xs.iter().map(|x| q8(x)).collect();
    let a4 = [&acts[0][..], &acts[1][..], &acts[2][..], &acts[3][..]];
    for k in Kernels::all() {
        for q in QuantType::ALL {
            let wb = crate::quantize::random_blocks(q, 512 / q.block_len(), 11);
            let mut wd = vec![0.0; 512];
            crate::quant::dequantize_row(q.dtype(), &wb, &mut wd);
            let (one, four) = k.quant_dots(q);
            let got4 = four(&wb, a4);
            for r in 0..4 {
                let want = (scalar::quant_dots(q).one)(&wb, &acts[r]);
                let scale: f32 = wd.iter().zip(&xs[r]).map(|(a, b)| (a * b).abs()).sum();
                assert!(close(want, one(&wb, &acts[r]), scale), "{:?} {q:?} single", k.isa);
                assert_eq!(got4[r].to_bits(), one(&wb, &acts[r]).to_bits(), "{:?} {q:?} x4 is the single dot", k.isa);
            }
        }
    }
}
