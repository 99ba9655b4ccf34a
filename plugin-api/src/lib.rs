//! The inferd decoder-plugin ABI and its Rust SDK.
//!
//! Decoding strategies are shared libraries behind the C ABI of `include/inferd_plugin.h`
//! (the contract; [`abi`] mirrors it and a test checks the two agree). Rust plugins use the SDK:
//! implement [`sdk::Strategy`] (or, for one-token-per-step strategies, [`sampler::Pick`]) and
//! export it with [`export_plugin!`]. [`sampling`] holds the sampling transforms every strategy
//! shares, [`params`] the checked reading of strategy parameters.

#![deny(unsafe_code)]
#![cfg_attr(test, allow(clippy::unwrap_used))] // unit tests: a failed unwrap is a failed test

pub mod abi;
pub mod params;
pub mod sampler;
pub mod sampling;
#[allow(unsafe_code)]
pub mod sdk;

pub use abi::{ABI_MAJOR, ABI_MINOR};
