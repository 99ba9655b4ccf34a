//! The greedy strategy: the most probable token, every step (ties go to the lower id).
//! No parameters, no randomness.

use inferd_plugin_api::params::Params;
use inferd_plugin_api::sampler::{Pick, Sampler};
use inferd_plugin_api::sampling::argmax;
use inferd_plugin_api::sdk::{Host, SessionInit};
use std::ffi::CStr;

pub struct Greedy;

impl Pick for Greedy {
    const NAME: &'static CStr = c"greedy";
    const DESCRIPTION: &'static CStr = c"The most probable token at every step";

    fn parse(_p: &mut Params, _init: &SessionInit) -> Result<Self, String> {
        Ok(Greedy)
    }

    fn pick(
        &self,
        _host: &Host,
        logits: &[f32],
        _history: &[u32],
        _choice: u32,
        _position: u32,
    ) -> Result<u32, String> {
        Ok(argmax(logits))
    }
}

inferd_plugin_api::export_plugin!(name: "inferd-greedy", version: env!("CARGO_PKG_VERSION"), strategies: [Sampler<Greedy>]);
