//! The CUDA sources without a GPU: their weight decoding compiled as C++ on the host against
//! the CPU dequantizer, and the whole set compiled by NVRTC to device code for every checked
//! architecture (`tests/run` installs NVRTC; where the build found none, that test is ignored
//! with the reason).

use super::{nvrtc, translation_unit, CHECKED_ARCHES, KERNELS, SOURCES};
use crate::quant::{dequantize_row, DType, QuantType};
use crate::quantize::random_blocks;
use std::path::PathBuf;
use std::process::{Command, Stdio};

pub(super) fn scratch(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("inferd-test-{}", std::process::id())).join(tag);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// `common.cuh`'s `row_weight` over a row of `n` weights of `dtype`, run on the host.
fn host_decode(exe: &std::path::Path, dtype: DType, bytes: &[u8], n: usize) -> Vec<f32> {
    host_run(exe, dtype, bytes, n, false)
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// The harness's output for a row of `n` weights: the weights, or with `groups` each group as
/// `group_ints` decodes it (15 little-endian words: 8 quant words, sc, m, d, dmin, has_min).
fn host_run(exe: &std::path::Path, dtype: DType, bytes: &[u8], n: usize, groups: bool) -> Vec<u8> {
    use std::io::Write;
    let mut args = vec![dtype.ggml_type().to_string(), n.to_string()];
    if groups {
        args.push("groups".into());
    }
    let mut child = Command::new(exe).args(args).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
    child.stdin.take().unwrap().write_all(bytes).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    out.stdout
}

#[test]
fn the_kernels_decode_every_weight_type_and_its_groups_as_the_cpu_does() {
    let dir = scratch("cuda-host-decode");
    std::fs::write(dir.join("common.cuh"), SOURCES[0].1).unwrap();
    let harness = r#"
#include "common.cuh"
#include <cstdio>
#include <cstdlib>
#include <vector>
int main(int argc, char** argv) {
    int type = atoi(argv[1]);
    long n = atol(argv[2]);
    std::vector<uint8_t> bytes(n / block_len(type) * block_bytes(type));
    if (fread(bytes.data(), 1, bytes.size(), stdin) != bytes.size()) return 1;
    if (argc > 3) {  // the groups as integers: 32 quants, sc, m, d, dmin, has_min
        for (long g = 0; g < n / 32; g++) {
            GroupQ q;
            if (!group_ints(type, bytes.data(), (int)g, &q)) return 2;
            fwrite(q.q, 4, 8, stdout);
            fwrite(q.sc, 4, 2, stdout);
            fwrite(q.m, 4, 2, stdout);
            fwrite(&q.d, 4, 1, stdout);
            fwrite(&q.dmin, 4, 1, stdout);
            int has_min = q.has_min;
            fwrite(&has_min, 4, 1, stdout);
        }
        return 0;
    }
    for (long k = 0; k < n; k++) {
        float w = row_weight(type, bytes.data(), (int)k);
        fwrite(&w, 4, 1, stdout);
    }
    return 0;
}
"#;
    std::fs::write(dir.join("decode.cpp"), harness).unwrap();
    let exe = dir.join("decode");
    let cc = Command::new("c++")
        .args(["-O1", "-ffp-contract=off", "-o"])
        .arg(&exe)
        .arg(dir.join("decode.cpp"))
        .output()
        .expect("a C++ compiler (c++) for the host test of the CUDA sources");
    assert!(cc.status.success(), "{}", String::from_utf8_lossy(&cc.stderr));
    for q in QuantType::ALL {
        let blocks = 8;
        let bytes = random_blocks(q, blocks, 7 + q.dtype().ggml_type() as u64);
        let n = blocks * q.block_len();
        let mut want = vec![0f32; n];
        dequantize_row(q.dtype(), &bytes, &mut want);
        let got = host_decode(&exe, q.dtype(), &bytes, n);
        assert_eq!(got.len(), n);
        for (k, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.to_bits(), w.to_bits(), "{q:?} weight {k}: {g} vs the CPU's {w}");
        }
        // The products' integer form of each group (group_ints), against the CPU's group::decode.
        let words = host_run(&exe, q.dtype(), &bytes, n, true);
        let words: Vec<u32> = words.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        assert_eq!(words.len(), n / 32 * 15);
        for (g, w) in words.chunks_exact(15).enumerate() {
            let want = crate::group::decode(q, &bytes, g);
            let quants: Vec<i8> = w[..8].iter().flat_map(|v| v.to_le_bytes()).map(|b| b as i8).collect();
            assert_eq!(&quants[..], &want.q[..], "{q:?} group {g}: quants");
            assert_eq!([w[8] as i32, w[9] as i32], want.sc, "{q:?} group {g}: scales");
            assert_eq!(w[14] != 0, want.has_min, "{q:?} group {g}: has a min");
            if want.has_min {
                assert_eq!([w[10] as i32, w[11] as i32], want.m, "{q:?} group {g}: mins");
                assert_eq!(w[13], want.dmin.to_bits(), "{q:?} group {g}: dmin");
            }
            assert_eq!(w[12], want.d.to_bits(), "{q:?} group {g}: d");
        }
    }
    // Float types from random bits (subnormal, infinite and NaN halves included).
    let bits: Vec<u8> = (0..4096u32).flat_map(|i| (i.wrapping_mul(2_654_435_761) >> 7).to_le_bytes()).collect();
    for (dtype, size) in [(DType::F16, 2), (DType::BF16, 2), (DType::F32, 4)] {
        let n = bits.len() / size;
        let mut want = vec![0f32; n];
        dequantize_row(dtype, &bits, &mut want);
        let got = host_decode(&exe, dtype, &bits, n);
        for (k, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.to_bits(), w.to_bits(), "{dtype:?} value {k}: {g} vs the CPU's {w}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
#[cfg_attr(not(host_nvrtc), ignore = "no libnvrtc.so.13 or .12 at build time (tests/run installs NVIDIA's wheel)")]
fn every_kernel_compiles_to_device_code_for_the_checked_architectures() {
    assert!(nvrtc::available(), "{}", nvrtc::CompileError::Missing);
    let src = translation_unit();
    for arch in CHECKED_ARCHES {
        let cubin = nvrtc::compile_cubin(&src, arch).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(&cubin[..4], b"\x7fELF", "{arch}: a cubin is an ELF image");
        for k in KERNELS {
            assert!(
                cubin.windows(k.len() + 1).any(|w| &w[..k.len()] == k.as_bytes() && w[k.len()] == 0),
                "{arch}: {k}"
            );
        }
    }
    // A source error is an error that carries NVRTC's log.
    let e = nvrtc::compile_cubin("extern \"C\" __global__ void k() { undeclared(); }", "sm_90").unwrap_err();
    assert!(e.to_string().contains("undeclared"), "{e}");
    assert!(matches!(nvrtc::compile_cubin("", "compute_90"), Err(nvrtc::CompileError::BadArch(_))));
    // The cache: compiled once, then read back.
    let dir = scratch("cuda-cache");
    let first = nvrtc::cached_cubin("sm_90", &dir).unwrap();
    let files: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().map(|e| e.path()).collect();
    assert_eq!(files.len(), 1, "{files:?}");
    std::fs::write(&files[0], b"\x7fELFcached").unwrap();
    assert_eq!(nvrtc::cached_cubin("sm_90", &dir).unwrap(), b"\x7fELFcached", "read from the cache");
    assert_ne!(first, b"\x7fELFcached");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn without_the_driver_the_probe_says_so_instead_of_panicking() {
    use super::device::{driver_present, probe, CudaUnavailable};
    match probe() {
        Err(CudaUnavailable::NoDriver) => assert!(!driver_present()),
        Ok(d) => assert!(d.arch.starts_with("sm_") && d.memory_bytes > 0 && !d.name.is_empty(), "{d:?}"),
        Err(e) => assert!(driver_present(), "{e}"),
    }
}

#[test]
fn the_runtime_libraries_of_cuda_13_and_of_cuda_12_are_both_looked_for() {
    // A machine has one or the other (the nvidia-cuda-nvrtc wheels, a distribution's libnvrtc12,
    // a CUDA 13 toolkit): the binary loads either, whichever cudarc's bindings were built for.
    for lib in ["nvrtc", "cublas"] {
        let names = cudarc::get_lib_name_candidates(lib);
        for v in [13, 12] {
            assert!(names.contains(&format!("lib{lib}.so.{v}")), "lib{lib}.so.{v} not among {names:?}");
        }
    }
}

#[test]
fn auto_takes_only_the_kinds_of_gpu_the_checks_have_passed_on() {
    assert!(super::passed_on("sm_90"), "tests/gpu/run passed on an H200");
    for arch in ["sm_80", "sm_89", "sm_100", "sm_9", ""] {
        assert!(!super::passed_on(arch), "{arch}");
    }
}
