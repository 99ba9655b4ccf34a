//! AVX-512 VNNI kernels for quantized products (x86-64 with AVX512F/BW/VL and VNNI), on top of
//! the AVX2 table: the 16-row kernels (`avx512_gemv.rs` on rows as the file stores them,
//! `avx512_packed.rs` on packed weights) and attention (`avx512_attn.rs`). The single-row dots
//! are the AVX2 table's (`lane.rs`): every product here follows their lane arithmetic. Where
//! the processor also has AVX-512 BF16, the bf16 products of many tokens (`avx512_bf16.rs`).

use super::{Isa, Kernels};
/// The AVX-512 VNNI table, or `None` when the processor lacks any of the features.
pub fn kernels() -> Option<Kernels> {
    let has = |f: &str| match f {
        "avx512f" => is_x86_feature_detected!("avx512f"),
        "avx512bw" => is_x86_feature_detected!("avx512bw"),
        "avx512vl" => is_x86_feature_detected!("avx512vl"),
        _ => is_x86_feature_detected!("avx512vnni"),
    };
    if !["avx512f", "avx512bw", "avx512vl", "avx512vnni"].iter().all(|f| has(f)) {
        return None;
    }
    let base = super::avx2::kernels()?;
    // Each closure calls `#[target_feature]` functions of this file; the table only exists when
    // the features were detected above (and AVX2/FMA/F16C by `avx2::kernels`).
    Some(Kernels {
        isa: Isa::Avx512Vnni,
        // SAFETY: features detected above.
        gemv16: Some(|dt, w, rb, a, out| unsafe { super::avx512_gemv::gemv16(dt, w, rb, a, out) }),
        // SAFETY: as above.
        gemv16_packed: Some(|dt, w, rb, a, out| unsafe { super::avx512_packed::gemv16_packed(dt, w, rb, a, out) }),
        // SAFETY: as above.
        attn_scores: |k, q, g, scale, out, stride, ahead| unsafe {
            super::avx512_attn::attn_scores(k, q, g, scale, out, stride, ahead)
        },
        // SAFETY: as above.
        attn_values: |v, p, stride, hd, g, out| unsafe { super::avx512_attn::attn_values(v, p, stride, hd, g, out) },
        // SAFETY: as above.
        exp_sum: |x, shift| unsafe { super::avx512_attn::exp_sum(x, shift) },
        bf16: is_x86_feature_detected!("avx512bf16").then_some(super::Bf16Kernels {
            // SAFETY: as above, and BF16 detected here.
            tile: |t, c, ldc| unsafe { super::avx512_bf16::tile(t, c, ldc) },
            // SAFETY: as above.
            to_bf16: |x, out| unsafe { super::avx512_bf16::to_bf16(x, out) },
            words: 1,
            // SAFETY: as above.
            to_tokens: |x, out| unsafe { super::avx512_bf16::to_bf16(x, out) },
            // SAFETY: as above.
            softmax: |s, scale, out| unsafe { super::avx512_bf16::softmax(s, scale, out) },
        }),
        ..base
    })
}
