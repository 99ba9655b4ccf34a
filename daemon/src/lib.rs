//! inferd: the local LLM inference service.
//!
//! The crate is the daemon's library; `src/main.rs` is the `inferd` command line on top of it.
//! See ARCHITECTURE.md at the repository root for the map; in short:
//!
//! - [`model`]: loading GGUF files and Hugging Face directories (memory-mapped weights).
//! - [`tokenizer`]: text <-> ids, chat templates, streaming detokenization.
//! - [`kv`]: the paged KV cache bookkeeping (block pool, block tables, prefix cache).
//! - [`backend`]: the forward pass behind the [`backend::Backend`] trait; the CPU backend.
//! - [`engine`]: generation on top of backend + KV cache (greedy decoding for now).
//! - [`plugin`]: decoder plugins, host side: loading, registry, sessions over the C ABI.
//! - [`decode`]: driving a request through a strategy plugin over a sequence store.
//! - [`serve`]: the daemon: engine loops (continuous batching), HTTP and D-Bus edges, systemd.
//! - [`client`], [`ctl`]: the blocking HTTP client of the daemon's socket and `inferctl`.
//! - [`bench`]: the `inferd bench` measurements.

#![deny(unsafe_code)]
#![cfg_attr(test, allow(clippy::unwrap_used))] // unit tests: a failed unwrap is a failed test

pub mod backend;
pub mod bench;
pub mod chat;
pub mod client;
pub mod ctl;
pub mod decode;
pub mod engine;
pub mod kv;
pub mod model;
pub mod paths;
pub mod plugin;
pub mod serve;
pub mod tokenizer;
