//! The inferd decoder-plugin ABI and its Rust SDK.
//!
//! Decoding strategies (greedy, nucleus, min-p, beam, speculative, third-party ones) will load as
//! shared libraries behind a versioned C ABI defined here: a checked-in C header, its
//! `#[repr(C)]` mirror, and a Rust SDK. The crate is in the workspace now so the dependency
//! direction (plugin-api <- daemon, plugins) is fixed from the start; the ABI itself lands with
//! the plugin issue. Until then the engine decodes greedily in-process.

#![forbid(unsafe_code)]

/// The major version of the plugin ABI this crate will define.
pub const ABI_MAJOR: u32 = 1;
