//! Tells the kernel tests which instruction sets the build machine has (`host_avx2`,
//! `host_avx512vnni`, `host_avx512bf16`), whether it has NVIDIA's runtime compiler (`host_nvrtc`:
//! libnvrtc.so.13 or .12 on LD_LIBRARY_PATH or in the system's library directories) and an
//! NVIDIA GPU with its driver (`host_cuda`), so a test this machine cannot run is reported as
//! ignored with the reason, not as passed. Only for native builds: when cross-compiling (TARGET
//! differs from HOST) neither is set and those tests are ignored. Nothing outside
//! `#[cfg(test)]` reads them: the kernels themselves choose their instruction set at run time.
//!
//! The script watches only itself and LD_LIBRARY_PATH. It must not name a file that may not exist
//! (`/proc/driver/nvidia/version` on a machine without a GPU): Cargo counts a missing watched file
//! as changed, reruns the script on every build and recompiles every crate above this one. A
//! driver installed after the first build is seen after `touch kernels/build.rs`.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(host_avx2)");
    println!("cargo::rustc-check-cfg=cfg(host_avx512vnni)");
    println!("cargo::rustc-check-cfg=cfg(host_avx512bf16)");
    println!("cargo::rustc-check-cfg=cfg(host_nvrtc)");
    println!("cargo::rustc-check-cfg=cfg(host_cuda)");
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-env-changed=LD_LIBRARY_PATH");
    if std::env::var("TARGET").ok() != std::env::var("HOST").ok() {
        return;
    }
    let ld = std::env::var_os("LD_LIBRARY_PATH").unwrap_or_default();
    let dirs = std::env::split_paths(&ld).chain(
        ["/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/local/cuda/lib64", "/usr/lib"].map(std::path::PathBuf::from),
    );
    if dirs.into_iter().any(|d| ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"].iter().any(|l| d.join(l).exists()))
    {
        println!("cargo::rustc-cfg=host_nvrtc");
    }
    if std::path::Path::new("/proc/driver/nvidia/version").exists() {
        println!("cargo::rustc-cfg=host_cuda");
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
        if avx512 && is_x86_feature_detected!("avx512bf16") {
            println!("cargo::rustc-cfg=host_avx512bf16");
        }
    }
}
