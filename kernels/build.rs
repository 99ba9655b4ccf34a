//! Tells the kernel tests which instruction sets the build machine has (`host_avx2`,
//! `host_avx512vnni`), so a test of a kernel this processor cannot run is reported as ignored
//! with the reason, not as passed. Only for native builds: when cross-compiling (TARGET differs
//! from HOST) neither is set and those tests are ignored. Nothing outside `#[cfg(test)]` reads
//! them: the kernels themselves choose their instruction set at run time.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(host_avx2)");
    println!("cargo::rustc-check-cfg=cfg(host_avx512vnni)");
    println!("cargo::rerun-if-changed=build.rs");
    if std::env::var("TARGET").ok() != std::env::var("HOST").ok() {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    {
        let avx2 =
            is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c");
        let avx512 = avx2
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512vnni");
        if avx2 {
            println!("cargo::rustc-cfg=host_avx2");
        }
        if avx512 {
            println!("cargo::rustc-cfg=host_avx512vnni");
        }
    }
}
