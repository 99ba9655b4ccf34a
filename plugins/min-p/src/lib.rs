//! The min-p strategy (Nguyen et al. 2024): tokens below `min_p` times the top token's
//! probability are dropped, then the temperature reshapes the survivors (truncation before
//! temperature, so a high temperature cannot revive the tail); frequency and presence penalties
//! and logit bias apply first, as in `inferd_plugin_api::sampling`. Temperature 0 is greedy.

use inferd_plugin_api::params::Params;
use inferd_plugin_api::sampler::{Pick, Sampler};
use inferd_plugin_api::sampling::{Accept, Sampling};
use inferd_plugin_api::sdk::{Host, SessionInit};
use std::ffi::CStr;

pub struct MinP(Sampling);

impl Pick for MinP {
    const NAME: &'static CStr = c"min-p";
    const DESCRIPTION: &'static CStr =
        c"Min-p sampling: drop tokens below min_p times the top probability, then apply temperature";
    const PARAMS_DOC: &'static CStr = c"{\"min_p\": \"number 0..1, default 0.05\", \"temperature\": \"number 0..2, default 1; 0 is greedy\", \"frequency_penalty\": \"number -2..2, default 0\", \"presence_penalty\": \"number -2..2, default 0\", \"repeat_penalty\": \"number 0..10, default 1 (off); llama.cpp's, over the last repeat_last_n tokens of prompt and answer\", \"repeat_last_n\": \"integer, default 64\", \"logit_bias\": \"object token id -> number -100..100\"}";

    fn parse(p: &mut Params, init: &SessionInit) -> Result<Self, String> {
        let mut s = Sampling::from_params(p, init.vocab_size, Accept { top_k: false, top_p: false, min_p: false })?;
        s.min_p = p.f64("min_p", 0.0..=1.0, 0.05)? as f32;
        s.temperature_last = true;
        Ok(MinP(s))
    }

    fn prompt(&mut self, prompt: &[u32]) {
        self.0.with_prompt(prompt);
    }

    fn pick(&self, host: &Host, logits: &[f32], history: &[u32], choice: u32, position: u32) -> Result<u32, String> {
        let u = host.uniform(u64::from(choice), u64::from(position))?;
        self.0.sample(logits, history, u).map(|(t, _)| t).ok_or_else(|| "empty vocabulary".into())
    }
}

inferd_plugin_api::export_plugin!(name: "inferd-min-p", version: env!("CARGO_PKG_VERSION"), strategies: [Sampler<MinP>]);
