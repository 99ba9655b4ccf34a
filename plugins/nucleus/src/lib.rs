//! The nucleus strategy: temperature, top-k, top-p, frequency and presence penalties and logit
//! bias, in the order of `inferd_plugin_api::sampling` (temperature before truncation), then a
//! draw from the host's seeded generator. Temperature 0 is greedy.

use inferd_plugin_api::params::Params;
use inferd_plugin_api::sampler::{Pick, Sampler};
use inferd_plugin_api::sampling::{Accept, Sampling};
use inferd_plugin_api::sdk::{Host, SessionInit};
use std::ffi::CStr;

pub struct Nucleus(Sampling);

impl Pick for Nucleus {
    const NAME: &'static CStr = c"nucleus";
    const DESCRIPTION: &'static CStr = c"Sampling with temperature, top-k, top-p, penalties and logit bias";
    const PARAMS_DOC: &'static CStr = c"{\"temperature\": \"number 0..2, default 1; 0 is greedy\", \"top_k\": \"integer 0..vocab, default 0 (off)\", \"top_p\": \"number 0..1, default 1 (off)\", \"frequency_penalty\": \"number -2..2, default 0\", \"presence_penalty\": \"number -2..2, default 0\", \"repeat_penalty\": \"number 0..10, default 1 (off); llama.cpp's, over the last repeat_last_n tokens of prompt and answer\", \"repeat_last_n\": \"integer, default 64\", \"logit_bias\": \"object token id -> number -100..100\"}";

    fn parse(p: &mut Params, init: &SessionInit) -> Result<Self, String> {
        Ok(Nucleus(Sampling::from_params(p, init.vocab_size, Accept { top_k: true, top_p: true, min_p: false })?))
    }

    fn prompt(&mut self, prompt: &[u32]) {
        self.0.with_prompt(prompt);
    }

    fn pick(&self, host: &Host, logits: &[f32], history: &[u32], choice: u32, position: u32) -> Result<u32, String> {
        let u = host.uniform(u64::from(choice), u64::from(position))?;
        self.0.sample(logits, history, u).map(|(t, _)| t).ok_or_else(|| "empty vocabulary".into())
    }
}

inferd_plugin_api::export_plugin!(name: "inferd-nucleus", version: env!("CARGO_PKG_VERSION"), strategies: [Sampler<Nucleus>]);
