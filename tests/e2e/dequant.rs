//! Dequantization against the `gguf` Python package's reference dequantizers, bit for bit, on
//! random blocks of every quantized type (tests/run installs the package).

use inferd_kernels::quant::{dequantize_row, QuantType};
use inferd_kernels::quantize::random_blocks;

#[test]
fn dequantization_equals_the_gguf_package_bit_for_bit() {
    let dir = inferd_e2e::temp_dir("dequant");
    let raw: Vec<Vec<u8>> = QuantType::ALL
        .iter()
        .enumerate()
        .map(|(i, &q)| random_blocks(q, 4096 / q.block_len(), 1000 + i as u64))
        .collect();
    let names: Vec<&str> = QuantType::ALL.iter().map(|q| q.dtype().name()).collect();
    for (name, raw) in names.iter().zip(&raw) {
        std::fs::write(dir.join(format!("{name}.bin")), raw).unwrap();
    }
    let mut args = vec![dir.as_os_str()];
    args.extend(names.iter().map(std::ffi::OsStr::new));
    inferd_e2e::run_python("python/gguf_dequant.py", &args);
    for ((q, name), raw) in QuantType::ALL.into_iter().zip(&names).zip(&raw) {
        let want: Vec<u32> = std::fs::read(dir.join(format!("{name}.f32")))
            .unwrap()
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let mut got = vec![0f32; 4096];
        dequantize_row(q.dtype(), raw, &mut got);
        assert_eq!(want.len(), got.len(), "{name}");
        for (j, (w, g)) in want.iter().zip(&got).enumerate() {
            assert_eq!(*w, g.to_bits(), "{name} weight {j}: gguf {} inferd {g}", f32::from_bits(*w));
        }
    }
    let _ = std::fs::remove_dir_all(dir);
}
