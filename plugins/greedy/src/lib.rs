//! The greedy strategy: the most probable token, every step (ties go to the lower id).
//! No parameters, no randomness.

use inferd_plugin_api::params::Params;
use inferd_plugin_api::sampler::{Pick, Sampler};
use inferd_plugin_api::sampling::{argmax, log_softmax_at};
use inferd_plugin_api::sdk::{Host, SessionInit};
use std::ffi::CStr;

/// Whether to compute log-probabilities (a pass over the vocabulary per token).
pub struct Greedy(bool);

impl Pick for Greedy {
    const NAME: &'static CStr = c"greedy";
    const DESCRIPTION: &'static CStr = c"The most probable token at every step";

    fn parse(_p: &mut Params, init: &SessionInit) -> Result<Self, String> {
        Ok(Greedy(init.logprobs))
    }

    fn pick(
        &self,
        _host: &Host,
        logits: &[f32],
        _history: &[u32],
        _choice: u32,
        _position: u32,
    ) -> Result<(u32, f32), String> {
        let t = argmax(logits);
        Ok((t, if self.0 { log_softmax_at(logits, t as usize) } else { f32::NAN }))
    }
}

inferd_plugin_api::export_plugin!(name: "inferd-greedy", version: env!("CARGO_PKG_VERSION"), strategies: [Sampler<Greedy>]);
