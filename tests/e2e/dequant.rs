//! Dequantization against the `gguf` Python package's reference dequantizers, bit for bit, on
//! random blocks of every quantized type (tests/run installs the package).

use inferd_kernels::quant::{dequantize_row, QuantType};
use inferd_kernels::quantize::random_blocks;
use std::process::Command;

#[test]
fn dequantization_equals_the_gguf_package_bit_for_bit() {
    let dir = std::env::temp_dir().join(format!("inferd-dequant-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let blocks = |q: QuantType| 4096 / q.block_len();
    let mut names = Vec::new();
    for (i, q) in QuantType::ALL.into_iter().enumerate() {
        let name = q.dtype().name();
        std::fs::write(dir.join(format!("{name}.bin")), random_blocks(q, blocks(q), 1000 + i as u64)).unwrap();
        names.push(name);
    }
    let pylib = std::env::var("INFERD_TEST_PYTHONPATH")
        .unwrap_or_else(|_| format!("{}/.cache/inferd/python", std::env::var("HOME").unwrap_or_default()));
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/python/gguf_dequant.py");
    let out = Command::new("python3").arg(script).arg(&dir).args(&names).env("PYTHONPATH", &pylib).output().unwrap();
    assert!(
        out.status.success(),
        "the gguf package is installed by tests/run into {pylib}:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for (i, q) in QuantType::ALL.into_iter().enumerate() {
        let name = q.dtype().name();
        let want: Vec<u32> = std::fs::read(dir.join(format!("{name}.f32")))
            .unwrap()
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let raw = random_blocks(q, blocks(q), 1000 + i as u64);
        let mut got = vec![0f32; 4096];
        dequantize_row(q.dtype(), &raw, &mut got);
        assert_eq!(want.len(), got.len(), "{name}");
        for (j, (w, g)) in want.iter().zip(&got).enumerate() {
            assert_eq!(*w, g.to_bits(), "{name} weight {j}: gguf {} inferd {g}", f32::from_bits(*w));
        }
    }
    let _ = std::fs::remove_dir_all(dir);
}
