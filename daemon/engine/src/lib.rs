//! inferd-engine: the inference engine of the inferd daemon, embeddable by any Rust program.
//!
//! Nothing here knows HTTP, JSON requests, D-Bus or systemd, and nothing here awaits: the
//! daemon (crate `inferd`) is one user of this crate, `inferd run` another. See ARCHITECTURE.md
//! at the repository root for the map; in short:
//!
//! - [`model`]: loading GGUF files and Hugging Face directories (memory-mapped weights).
//! - [`tokenizer`], [`chat`]: text <-> ids, chat templates, streaming detokenization.
//! - [`template_host`]: chat templates rendered in a confined helper, bounded in memory.
//! - [`kv`]: the paged KV cache bookkeeping (block pool, block tables, prefix cache).
//! - [`backend`]: the forward pass behind the [`backend::Backend`] trait; the CPU backend.
//! - [`engine`]: the engine step on top of backend + KV cache.
//! - [`plugin`]: decoder plugins, host side: loading, registry, sessions over the C ABI.
//! - [`constraint`]: structured output: response formats compiled to token masks.
//! - [`decode`]: driving one request through a strategy plugin over a sequence store.
//! - [`request`]: one typed request, whatever the edge that built it.
//! - [`sched`]: the engine loop and its scheduler (continuous batching over many requests).
//! - [`tools`]: tool calls as each model family writes them: prompts, grammars, parsing.
//! - [`paths`]: where the default model and the plugins are looked for.
//! - [`vision`]: images in prompts: projector files, image decoding, the vision encoders.

#![deny(unsafe_code)]
#![cfg_attr(test, allow(clippy::unwrap_used))] // unit tests: a failed unwrap is a failed test

pub mod backend;
pub mod chat;
pub mod constraint;
pub mod decode;
pub mod engine;
pub mod kv;
pub mod model;
pub mod paths;
pub mod plugin;
pub mod request;
pub mod sched;
pub mod template_host;
pub mod time;
pub mod tokenizer;
pub mod tools;
pub mod vision;
