//! End-to-end tests of the engine: tiny generated models in every supported format, hostile
//! files, and the real default model against independent golden data (tests/golden).

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

mod corrupt;
mod golden;
mod tiny;
mod tokenizer;
