//! inferd: the local LLM inference service.
//!
//! The daemon's library over the engine crate (`inferd-engine`); `src/main.rs` is the `inferd`
//! command line on top of it. Only this crate knows HTTP, JSON, D-Bus and systemd. See
//! ARCHITECTURE.md at the repository root for the map; in short:
//!
//! - [`serve`]: the daemon: one engine thread per model, the HTTP and D-Bus edges, systemd,
//!   config, metrics.
//! - [`bench`], [`bench_decoders`], [`bench_speculative`], [`bench_editor`], [`bench_kl`]: the
//!   `inferd bench` measurements; [`kl_divergence`]: accuracy against full precision, in llama.cpp's terms.

#![deny(unsafe_code)]
#![cfg_attr(test, allow(clippy::unwrap_used))] // unit tests: a failed unwrap is a failed test

pub mod bandwidth;
pub mod bench;
pub mod bench_constrained;
pub mod bench_decoders;
pub mod bench_editor;
pub mod bench_kl;
pub mod bench_speculative;
pub mod kl_divergence;
pub mod serve;
