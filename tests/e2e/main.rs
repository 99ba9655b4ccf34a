//! End-to-end tests of the engine: tiny generated models in every supported format, hostile
//! files, the real default model against independent golden data (tests/golden), and decoder
//! plugins through the C ABI.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

mod corrupt;
mod cuda_host;
mod dequant;
mod embed;
mod fuzz;
mod golden;
mod isolation;
mod plugins;
mod reference;
mod serve;
mod tiny;
mod tokenizer;
mod unsupported;
