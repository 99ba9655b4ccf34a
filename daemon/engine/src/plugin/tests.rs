//! Sessions against strategies built with the Rust SDK and linked into this test binary
//! (declared through the same entry point a loaded library exports), on a mock model.

#![allow(unsafe_code)] // `export_plugin!` defines the `#[no_mangle]` entry point

use super::*;
use crate::decode::generate;
use crate::decode::store::{MockStore, SeqStore};
use inferd_plugin_api::abi;
use inferd_plugin_api::params::Params;
use inferd_plugin_api::sampler::{Pick, Sampler};
use inferd_plugin_api::sdk::{Host, Plan, PlanItem, SessionInit, Strategy};
use std::ffi::CStr;

/// Greedy, but panics at the third token.
struct Panicky;
impl Pick for Panicky {
    const NAME: &'static CStr = c"test-panicky";
    const DESCRIPTION: &'static CStr = c"panics at the third token";
    fn parse(_: &mut Params, _: &SessionInit) -> Result<Self, String> {
        Ok(Panicky)
    }
    fn pick(&self, _: &Host, logits: &[f32], _: &[u32], _: u32, position: u32) -> Result<u32, String> {
        assert!(position < 2, "deliberate panic at position {position}");
        Ok(inferd_plugin_api::sampling::argmax(logits))
    }
}

/// Plain greedy through the shared sampler.
struct Top1;
impl Pick for Top1 {
    const NAME: &'static CStr = c"test-top1";
    const DESCRIPTION: &'static CStr = c"greedy";
    fn parse(p: &mut Params, _: &SessionInit) -> Result<Self, String> {
        p.bool("strict", true).map(|_| Top1)
    }
    fn pick(&self, _: &Host, logits: &[f32], _: &[u32], _: u32, _: u32) -> Result<u32, String> {
        Ok(inferd_plugin_api::sampling::argmax(logits))
    }
}

/// Draws uniformly among tokens 0..=6 from the request's random stream: seeded, so a
/// recompute gives the same tokens (the scheduler's replay after a preemption relies on it).
struct Draw;
impl Pick for Draw {
    const NAME: &'static CStr = c"test-draw";
    const DESCRIPTION: &'static CStr = c"uniform draws from the host's counter-based generator";
    fn parse(_: &mut Params, _: &SessionInit) -> Result<Self, String> {
        Ok(Draw)
    }
    fn pick(&self, host: &Host, _: &[f32], _: &[u32], choice: u32, position: u32) -> Result<u32, String> {
        Ok((host.uniform(u64::from(choice), u64::from(position))? * 7.0) as u32)
    }
}

/// Greedy among the tokens that spell digits, read through `token_bytes` (ABI 1.1): a mask of
/// its own (end-of-sequence tokens allowed too). Reports whether the host said the request is
/// constrained.
struct Digits {
    constrained: bool,
    eos: Vec<u32>,
}
impl Pick for Digits {
    const NAME: &'static CStr = c"test-digits";
    const DESCRIPTION: &'static CStr = c"greedy over digit tokens";
    fn parse(_: &mut Params, init: &SessionInit) -> Result<Self, String> {
        Ok(Digits { constrained: init.constrained, eos: init.eos.clone() })
    }
    fn pick(&self, host: &Host, logits: &[f32], _: &[u32], _: u32, position: u32) -> Result<u32, String> {
        if position == 0 && self.constrained {
            host.report("constrained", 1.0)?;
        }
        let mut best: Option<(u32, f32)> = None;
        for (t, &l) in logits.iter().enumerate() {
            let b = host.token_bytes(t as u32)?;
            let digit = !b.is_empty() && b.iter().all(u8::is_ascii_digit);
            if (digit || self.eos.contains(&(t as u32))) && l.is_finite() && best.is_none_or(|(_, x)| l > x) {
                best = Some((t as u32, l));
            }
        }
        best.map(|(t, _)| t).ok_or_else(|| "no digit is allowed".to_string())
    }
}

/// Forks sequences it never frees, and emits one token more than allowed when asked.
struct Leaky {
    root: abi::Seq,
    steps: u32,
    overrun: bool,
}
impl Strategy for Leaky {
    const NAME: &'static CStr = c"test-leaky";
    const DESCRIPTION: &'static CStr = c"leaks forks";
    fn validate(_: &Host, init: &SessionInit) -> Result<(), String> {
        inferd_plugin_api::sdk::parse_params(init, |p| p.bool("overrun", false)).map(drop)
    }
    fn create(_: &Host, init: &SessionInit) -> Result<Self, String> {
        let overrun = inferd_plugin_api::sdk::parse_params(init, |p| p.bool("overrun", false))?;
        Ok(Leaky { root: init.seq, steps: 0, overrun })
    }
    fn plan(&mut self, _: &Host) -> Result<Plan, String> {
        if self.steps == 3 {
            return Ok(Plan::Done);
        }
        Ok(Plan::Run(vec![PlanItem {
            seq: self.root,
            tokens: if self.steps == 0 { vec![] } else { vec![1] },
            n_logits: 1,
        }]))
    }
    fn observe(&mut self, host: &Host, _: &[&[f32]]) -> Result<(), String> {
        self.steps += 1;
        host.seq_fork(self.root)?;
        host.emit(0, 1, 0.0)?;
        if self.overrun && self.steps == 2 {
            host.emit(0, 1, 0.0)?;
        }
        Ok(())
    }
}

inferd_plugin_api::export_plugin!(name: "in-process-tests", version: "0", strategies: [Sampler<Panicky>, Sampler<Top1>, Sampler<Draw>, Sampler<Digits>, Leaky]);

/// The strategies above (`test-top1`, `test-draw`, ...), for every test of this crate.
pub(crate) fn registry() -> Registry {
    let mut reg = Registry::default();
    let decl = loader::declare(inferd_plugin_entry_v1).expect("the in-process plugin declares");
    reg.add(decl, Path::new("/in-process")).expect("added");
    reg
}

/// A mock model over 8 tokens whose next token is (last + 1) % 8; token 7 is end-of-sequence.
fn counting_model() -> MockStore {
    MockStore::new(
        8,
        Box::new(|prefix: &[u32]| {
            let next = (prefix.last().copied().unwrap_or(0) + 1) % 8;
            (0..8).map(|t| if t == next { 5.0 } else { 0.0 }).collect()
        }),
    )
}

fn request<'a>(prompt: &'a [u32], params: &'a str, max_tokens: u32, n: u32) -> SessionRequest<'a> {
    SessionRequest {
        logprobs: None,
        prompt,
        generated: &[],
        params,
        max_tokens,
        n,
        seed: 1,
        eos: &[7],
        vocabulary: None,
        grammar: None,
    }
}

#[test]
fn sessions_decode_and_free_every_sequence() {
    let reg = registry();
    let top1 = reg.get("test-top1").unwrap();
    let mut store = counting_model();
    let mut seen = Vec::new();
    let out = generate(&top1, &mut store, &request(&[2], "{}", 10, 1), &mut |c, t| seen.push((c, t))).unwrap();
    // 3, 4, 5, 6, then 7 is end-of-sequence: not emitted, finish reason stop.
    assert_eq!(out[0].tokens, vec![3, 4, 5, 6]);
    assert_eq!(out[0].finish, Some(FinishReason::Stop));
    assert_eq!(seen, vec![(0, 3), (0, 4), (0, 5), (0, 6)]);
    let out = generate(&top1, &mut store, &request(&[2], "{}", 2, 3), &mut |_, _| {}).unwrap();
    assert_eq!(out.len(), 3);
    assert!(out.iter().all(|c| c.tokens == vec![3, 4] && c.finish == Some(FinishReason::Length)));
    assert_eq!(store.live(), 0, "every sequence is freed");
}

#[test]
fn parameters_are_checked_before_anything_runs() {
    let reg = registry();
    let top1 = reg.get("test-top1").unwrap();
    let mut store = counting_model();
    for (params, why) in [
        (r#"{"strict": 1}"#, "true or false"),
        (r#"{"stict": true}"#, "unknown parameter stict"),
        ("[]", "JSON object"),
    ] {
        let e = generate(&top1, &mut store, &request(&[2], params, 4, 1), &mut |_, _| {}).unwrap_err();
        assert!(e.to_string().contains(why), "{e}");
        assert_eq!(store.positions_run, [0, 0], "nothing ran");
    }
    assert!(!top1.quarantined(), "invalid requests are the client's fault, not the plugin's");
    let e = reg.get("no-such").unwrap_err();
    assert!(e.to_string().contains("test-top1"), "the error lists what is available: {e}");
}

#[test]
fn a_panicking_plugin_fails_its_request_only_and_is_quarantined_after_repeated_failures() {
    let reg = registry();
    let bad = reg.get("test-panicky").unwrap();
    let good = reg.get("test-top1").unwrap();
    let mut store = counting_model();
    for i in 0..QUARANTINE_AFTER {
        let e = generate(&bad, &mut store, &request(&[0], "{}", 10, 2), &mut |_, _| {}).unwrap_err();
        assert!(e.to_string().contains("panicked") && e.to_string().contains("deliberate panic"), "{e}");
        assert_eq!(store.live(), 0, "the failed request's sequences are freed");
        // Every other request goes on.
        let ok = generate(&good, &mut store, &request(&[0], "{}", 3, 1), &mut |_, _| {}).unwrap();
        assert_eq!(ok[0].tokens, vec![1, 2, 3]);
        assert_eq!(reg.get("test-panicky").is_err(), i + 1 == QUARANTINE_AFTER);
    }
    assert!(matches!(reg.get("test-panicky"), Err(PluginError::Quarantined(..))));
}

#[test]
fn leaked_sequences_are_freed_and_overruns_refused() {
    let reg = registry();
    let leaky = reg.get("test-leaky").unwrap();
    let mut store = counting_model();
    let out = generate(&leaky, &mut store, &request(&[0], "{}", 5, 1), &mut |_, _| {}).unwrap();
    assert_eq!(out[0].tokens, vec![1, 1, 1]);
    assert_eq!(store.live(), 0, "three leaked forks and the target are freed at the end");
    let e = generate(&leaky, &mut store, &request(&[0], r#"{"overrun": true}"#, 2, 1), &mut |_, _| {}).unwrap_err();
    assert!(e.to_string().contains("more than max_tokens"), "{e}");
    assert_eq!(store.live(), 0);
    // A request for alternatives takes every token through emit_top; a plain emit fails it.
    let want_top = SessionRequest { logprobs: Some(2), ..request(&[0], "{}", 5, 1) };
    let e = generate(&leaky, &mut store, &want_top, &mut |_, _| {}).unwrap_err();
    assert!(e.to_string().contains("go out through emit_top"), "{e}");
    assert_eq!(store.live(), 0);
    let e = generate(&leaky, &mut store, &SessionRequest { logprobs: Some(21), ..want_top }, &mut |_, _| {});
    assert!(e.unwrap_err().to_string().contains("top_logprobs must be at most 20"));
}

#[test]
fn the_sampler_reports_each_tokens_log_softmax_and_alternatives() {
    let reg = registry();
    let top1 = reg.get("test-top1").unwrap();
    let mut store = counting_model();
    let req = SessionRequest { logprobs: Some(3), ..request(&[2], "{}", 4, 2) };
    let choices = generate(&top1, &mut store, &req, &mut |_, _| {}).unwrap();
    assert_eq!(choices.len(), 2);
    for ch in &choices {
        assert_eq!(ch.tokens.len(), 4);
        assert_eq!(ch.top_logprobs.len(), 4);
        for ((&t, &lp), top) in ch.tokens.iter().zip(&ch.logprobs).zip(&ch.top_logprobs) {
            assert_eq!(top.len(), 3);
            assert_eq!(top[0], (t, lp), "greedy's token is the most probable");
            assert!(top.windows(2).all(|w| w[0].1 >= w[1].1) && lp < 0.0);
            // One 5.0 logit among eight: ln(e^5 / (e^5 + 7)).
            assert!((lp - (5f32 - (5f32.exp() + 7.0).ln())).abs() < 1e-6, "{lp}");
        }
    }
    assert_eq!(store.live(), 0);
}

#[test]
fn continued_requests_keep_their_history_out_of_max_tokens() {
    let reg = registry();
    let top1 = reg.get("test-top1").unwrap();
    let mut store = counting_model();
    let req = SessionRequest { generated: &[3, 4], ..request(&[2], "{}", 2, 1) };
    let out = generate(&top1, &mut store, &req, &mut |_, _| {}).unwrap();
    assert_eq!(out[0].tokens, vec![5, 6]);
    assert_eq!(store.tokens(1), Vec::<u32>::new(), "freed");
}

/// The counting model's 8 tokens as text: letters and digits, and an end-of-sequence token.
fn spelled() -> Arc<crate::constraint::Vocabulary> {
    let words = ["a", "1", "b", "2", "c", "3", "d", "<end>"];
    let tokens = words.iter().enumerate().map(|(i, w)| (w.as_bytes().to_vec(), i == 7)).collect();
    Arc::new(crate::constraint::Vocabulary::from_tokens(tokens, &[7]).unwrap())
}

#[test]
fn plugins_read_token_bytes_and_hear_that_a_request_is_constrained() {
    let reg = registry();
    let digits = reg.get("test-digits").unwrap();
    let vocab = spelled();
    let mut store = counting_model();
    let req = SessionRequest { vocabulary: Some(&vocab), ..request(&[2], "{}", 4, 1) };
    let out = generate(&digits, &mut store, &req, &mut |_, _| {}).unwrap();
    // From 2 the model wants 3 ("2"); then 4 (a letter): the first digit wins the tie; from 1
    // it wants 2 (a letter) again.
    assert_eq!(out[0].tokens, vec![3, 1, 1, 1]);
    // Without a vocabulary the host says so, and the request fails cleanly.
    let e = generate(&digits, &mut store, &request(&[2], "{}", 4, 1), &mut |_, _| {}).unwrap_err();
    assert!(e.to_string().contains("no vocabulary"), "{e}");
    assert_eq!(store.live(), 0);
}

#[test]
fn a_response_format_masks_every_strategy_and_refuses_what_ignores_it() {
    use crate::constraint::ResponseFormat;
    let reg = registry();
    let vocab = spelled();
    let grammar = vocab.compile(&ResponseFormat::Lark(r#"start: "1" "2" "3""#.into())).unwrap();
    let mut store = counting_model();
    let req = SessionRequest { vocabulary: Some(&vocab), grammar: Some(&grammar), ..request(&[0], "{}", 8, 1) };
    // Greedy would count 1, 2, 3, ... (ids); the grammar allows only "1" "2" "3", then the end.
    for name in ["test-top1", "test-digits"] {
        let s = reg.get(name).unwrap();
        let g = crate::decode::generate_with_stats(&s, &mut store, &req, &mut |_, _| {}).unwrap();
        assert_eq!(g.choices[0].tokens, vec![1, 3, 5], "{name}");
        assert_eq!(g.choices[0].finish, Some(FinishReason::Stop), "{name}");
        assert_eq!(g.stats["masked_rows"], 4.0, "{name}");
        assert!(g.stats.contains_key("mask_ms"), "{name}");
    }
    let g =
        crate::decode::generate_with_stats(&reg.get("test-digits").unwrap(), &mut store, &req, &mut |_, _| {}).unwrap();
    assert_eq!(g.stats["constrained"], 1.0, "ABI 1.1: the session init says the rows are masked");
    // A strategy that ignores its logits (uniform draws) emits what the grammar forbids: its
    // request fails with the reason, nothing leaks.
    let draw = reg.get("test-draw").unwrap();
    let e = generate(&draw, &mut store, &req, &mut |_, _| {}).unwrap_err();
    assert!(e.to_string().contains("the response format forbids"), "{e}");
    assert_eq!(store.live(), 0);
}
