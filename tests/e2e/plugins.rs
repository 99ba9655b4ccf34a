//! Decoder plugins through the C ABI, as the daemon loads them: the built-in strategies (built
//! by `cargo build` next to the test binaries), a strategy written in C compiled here with the
//! system C compiler, and broken plugins that must be refused or survived.

use inferd_engine::decode::generate;
use inferd_engine::decode::store::{EngineStore, MockStore, SeqStore};
use inferd_engine::engine::{Engine, EngineOptions};
use inferd_engine::model::Model;
use inferd_engine::plugin::{FinishReason, PluginError, Registry, SessionRequest, TrustPolicy, QUARANTINE_AFTER};
use inferd_plugin_api::params::Params;
use inferd_plugin_api::sampling::{Accept, Sampling};
use std::path::{Path, PathBuf};

/// Where cargo put the plugin libraries: the profile directory above this test's `deps/`.
pub fn build_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable");
    let dir = exe.parent().and_then(Path::parent).expect("target/<profile>").to_path_buf();
    assert!(
        dir.join("libinferd_greedy.so").exists(),
        "the plugins are not built in {} (tests/run builds them: cargo build --release)",
        dir.display()
    );
    dir
}

fn builtin() -> Registry {
    let mut reg = Registry::default();
    for name in ["greedy", "nucleus", "min_p", "beam", "speculative"] {
        reg.load_file(&build_dir().join(format!("libinferd_{name}.so")), TrustPolicy::User)
            .unwrap_or_else(|e| panic!("{e}"));
    }
    reg
}

/// Compiles tests/plugins/greedy.c into `dir/lib<name>.so` with `defines`.
pub fn compile_c(dir: &Path, name: &str, defines: &[&str]) -> PathBuf {
    inferd_e2e::compile_c_plugin(dir, name, defines)
}

/// A mock model over 16 tokens whose logits depend on the whole prefix (a hash), so any
/// decoding difference shows.
pub fn hashed_model() -> MockStore {
    MockStore::new(
        16,
        Box::new(|prefix: &[u32]| {
            let mut h: u64 = 1469598103934665603;
            for &t in prefix {
                h = (h ^ u64::from(t)).wrapping_mul(1099511628211);
            }
            (0..16u64).map(|i| ((h.rotate_left(i as u32 * 4) % 1000) as f32) / 250.0).collect()
        }),
    )
}

pub fn req<'a>(prompt: &'a [u32], params: &'a str, max_tokens: u32, n: u32, seed: u64) -> SessionRequest<'a> {
    SessionRequest {
        logprobs: None,
        prompt,
        generated: &[],
        params,
        max_tokens,
        n,
        seed,
        eos: &[15],
        vocabulary: None,
        grammar: None,
    }
}

#[test]
fn a_strategy_written_in_c_decodes_exactly_like_the_rust_greedy_plugin() {
    let dir = inferd_e2e::temp_dir("c-plugin");
    let mut reg = builtin();
    let decl = reg.load_file(&compile_c(&dir, "cgreedy", &[]), TrustPolicy::User).unwrap();
    assert_eq!((decl.name.as_str(), decl.strategies[0].name.as_str()), ("c-greedy", "c-greedy"));
    let (c, rust) = (reg.get("c-greedy").unwrap(), reg.get("greedy").unwrap());
    let mut store = hashed_model();
    for prompt in [[1u32, 2, 3], [9, 9, 9], [0, 5, 14]] {
        let a = generate(&c, &mut store, &req(&prompt, "{}", 12, 1, 0), &mut |_, _| {}).unwrap();
        let b = generate(&rust, &mut store, &req(&prompt, "{}", 12, 1, 0), &mut |_, _| {}).unwrap();
        assert_eq!(a[0].tokens, b[0].tokens);
        assert_eq!(a[0].finish, b[0].finish);
        assert!(!a[0].tokens.is_empty());
    }
    let e = generate(&c, &mut store, &req(&[1], r#"{"x": 1}"#, 4, 1, 0), &mut |_, _| {}).unwrap_err();
    assert!(e.to_string().contains("c-greedy takes no parameters"), "{e}");
    // Built for ABI 1.0, it knows nothing of top_logprobs: such requests are refused by name.
    let top = SessionRequest { logprobs: Some(2), ..req(&[1], "{}", 4, 1, 0) };
    let e = generate(&c, &mut store, &top, &mut |_, _| {}).unwrap_err();
    assert!(e.to_string().contains("top_logprobs is not reported by plugins built for ABI 1.0"), "{e}");
    assert_eq!(store.live(), 0);
}

#[test]
fn broken_plugins_are_refused_naming_the_file_and_why_and_the_rest_load() {
    let dir = inferd_e2e::temp_dir("broken-plugins");
    let cases = [
        ("major2", "FAULT_MAJOR2", "built for plugin ABI 2"),
        ("noentry", "FAULT_NO_ENTRY", "no inferd_plugin_entry_v1 symbol"),
        ("newminor", "FAULT_NEWER_MINOR", "built for ABI 1.3; this inferd speaks 1.2"),
        ("refuse", "FAULT_REFUSE", "refused this host"),
        ("badname", "FAULT_BAD_NAME", "invalid name"),
        ("noobserve", "FAULT_NO_OBSERVE", "no observe function"),
        ("oldsize", "FAULT_OLD_SIZE", "not an ABI 1.0 inferd_strategy"),
    ];
    for (name, define, _) in cases {
        compile_c(&dir, name, &[define]);
    }
    compile_c(&dir, "good", &[]);
    std::fs::write(dir.join("libjunk.so"), b"not a shared library").unwrap();
    let (reg, refused) = Registry::load_dirs(std::slice::from_ref(&dir), TrustPolicy::User);
    assert_eq!(reg.names(), vec!["c-greedy"], "the good plugin loads despite the others");
    assert_eq!(refused.len(), cases.len() + 1, "{refused:#?}");
    for (name, _, why) in cases {
        let line = refused
            .iter()
            .find(|l| l.contains(&format!("lib{name}.so")))
            .unwrap_or_else(|| panic!("no refusal for {name}: {refused:#?}"));
        assert!(line.contains(why), "{line}");
    }
    assert!(refused.iter().any(|l| l.contains("libjunk.so") && l.contains("cannot load")), "{refused:#?}");
}

#[test]
fn plugins_writable_by_others_are_refused() {
    use std::os::unix::fs::PermissionsExt;
    let dir = inferd_e2e::temp_dir("perm-plugins");
    let p = compile_c(&dir, "open", &[]);
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o666)).unwrap();
    let e = Registry::default().load_file(&p, TrustPolicy::User).unwrap_err();
    assert!(e.to_string().contains("writable by everyone"), "{e}");
    // Group-writable: fine for a user's own daemon, not for the system daemon.
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o664)).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let e = Registry::default().load_file(&p, TrustPolicy::System).unwrap_err();
    assert!(e.to_string().contains("writable by its group"), "{e}");
    assert!(Registry::default().load_file(&p, TrustPolicy::User).is_ok());
    let e = Registry::default().load_file(Path::new("relative/libx.so"), TrustPolicy::User).unwrap_err();
    assert!(e.to_string().contains("absolute"), "{e}");
}

#[test]
fn a_failing_c_plugin_fails_its_own_requests_until_quarantined() {
    let dir = inferd_e2e::temp_dir("failing-plugins");
    let mut reg = Registry::default();
    reg.load_file(&compile_c(&dir, "failplan", &["FAULT_FAIL_PLAN"]), TrustPolicy::User).unwrap();
    let good = builtin().get("greedy").unwrap();
    let mut store = hashed_model();
    for _ in 0..QUARANTINE_AFTER {
        let bad = reg.get("c-greedy").unwrap();
        let e = generate(&bad, &mut store, &req(&[1, 2], "{}", 5, 1, 0), &mut |_, _| {}).unwrap_err();
        assert!(e.to_string().contains("c-greedy was built to fail"), "{e}");
        assert_eq!(store.live(), 0);
        assert_eq!(
            generate(&good, &mut store, &req(&[1, 2], "{}", 5, 1, 0), &mut |_, _| {}).unwrap()[0].tokens.len(),
            5
        );
    }
    assert!(matches!(reg.get("c-greedy"), Err(PluginError::Quarantined(..))));

    // A plan naming a sequence the plugin never received is refused, not obeyed.
    let dir2 = inferd_e2e::temp_dir("badhandle-plugins");
    let mut reg = Registry::default();
    reg.load_file(&compile_c(&dir2, "badhandle", &["FAULT_BAD_HANDLE"]), TrustPolicy::User).unwrap();
    let e =
        generate(&reg.get("c-greedy").unwrap(), &mut store, &req(&[1, 2], "{}", 5, 1, 0), &mut |_, _| {}).unwrap_err();
    assert!(e.to_string().contains("not this request's"), "{e}");
    assert_eq!(store.live(), 0);
}

/// Draws `draws` first tokens from `strategy` with `params` and compares the frequencies with
/// the reference distribution, within 4.5 standard deviations per token.
fn check_distribution(
    reg: &Registry,
    strategy: &str,
    params: &str,
    want: &[(u32, f32)],
    logits: &[f32],
    history: &[u32],
) {
    let s = reg.get(strategy).unwrap();
    let fixed = logits.to_vec();
    let mut store = MockStore::new(logits.len(), Box::new(move |_| fixed.clone()));
    let draws = 20_000u64;
    let mut counts = vec![0u64; logits.len()];
    for seed in 0..draws {
        let r = SessionRequest {
            logprobs: None,
            prompt: &[0],
            generated: history,
            params,
            max_tokens: 1,
            n: 1,
            seed,
            eos: &[],
            vocabulary: None,
            grammar: None,
        };
        let out = generate(&s, &mut store, &r, &mut |_, _| {}).unwrap();
        counts[out[0].tokens[0] as usize] += 1;
    }
    for t in 0..logits.len() as u32 {
        let p = f64::from(want.iter().find(|x| x.0 == t).map_or(0.0, |x| x.1));
        let got = counts[t as usize] as f64 / draws as f64;
        let sd = (p * (1.0 - p) / draws as f64).sqrt();
        assert!((got - p).abs() <= 4.5 * sd + 1e-9, "{strategy} {params}: token {t} drawn {got:.4}, expected {p:.4}");
    }
}

#[test]
fn sampling_plugins_draw_from_the_documented_distribution() {
    let reg = builtin();
    let logits = [2.0, 1.0, 0.5, 0.0, -1.0, 1.5, -0.5, 0.25];
    let history = [5u32, 5, 1];
    let accept = |min_p: bool| Accept { top_k: !min_p, top_p: !min_p, min_p: false };
    for (strategy, params) in [
        ("nucleus", "{}"),
        ("nucleus", r#"{"temperature": 0.7}"#),
        ("nucleus", r#"{"top_k": 3}"#),
        ("nucleus", r#"{"top_p": 0.8}"#),
        ("nucleus", r#"{"frequency_penalty": 0.8, "presence_penalty": 0.3}"#),
        ("nucleus", r#"{"logit_bias": {"4": 3.5}}"#),
        (
            "nucleus",
            r#"{"temperature": 1.4, "top_k": 5, "top_p": 0.9, "frequency_penalty": 0.5, "logit_bias": {"0": -1}}"#,
        ),
        ("nucleus", r#"{"temperature": 0}"#),
        ("min-p", r#"{"min_p": 0.2}"#),
        ("min-p", r#"{"min_p": 0.2, "temperature": 1.8, "presence_penalty": 1.0}"#),
    ] {
        // The reference: the shared transform chain, configured as each plugin documents.
        let mut p = Params::parse(params).unwrap();
        let mut s = Sampling::from_params(&mut p, logits.len() as u32, accept(strategy == "min-p")).unwrap();
        if strategy == "min-p" {
            s.min_p = p.f64("min_p", 0.0..=1.0, 0.05).unwrap() as f32;
            s.temperature_last = true;
        }
        p.finish().unwrap();
        let want = s.distribution(&logits, &history);
        check_distribution(&reg, strategy, params, &want, &logits, &history);
    }
}

#[test]
fn seeded_requests_repeat_and_choices_fork_the_prompt() {
    let reg = builtin();
    let nucleus = reg.get("nucleus").unwrap();
    let mut store = hashed_model();
    let run = |store: &mut MockStore, seed: u64, n: u32| {
        let r = SessionRequest { logprobs: Some(0), ..req(&[3, 1], r#"{"temperature": 1.5}"#, 24, n, seed) };
        generate(&nucleus, store, &r, &mut |_, _| {}).unwrap()
    };
    let a = run(&mut store, 42, 1);
    assert_eq!(a, run(&mut store, 42, 1), "the same seed gives the same tokens");
    assert_ne!(a[0].tokens, run(&mut store, 43, 1)[0].tokens, "another seed gives other tokens");
    let many = run(&mut store, 42, 4);
    assert_eq!(many.len(), 4);
    assert_eq!(many[0], a[0], "choice 0 of n is the single choice of the same seed");
    assert!(many.iter().skip(1).any(|c| c.tokens != a[0].tokens), "choices draw independently");
    assert_eq!(store.live(), 0);
}

#[test]
fn the_greedy_plugin_on_the_real_model_equals_the_engines_argmax_and_frees_its_blocks() {
    let model = Model::load(&inferd_e2e::default_model()).unwrap();
    let prompt = model.tokenizer.encode("The three primary colors are", false).unwrap();
    let mut engine = Engine::cpu(&model, &EngineOptions { threads: 2, ..EngineOptions::default() }).unwrap();
    let want = engine.generate_greedy(&[&prompt], 16, model.tokenizer.eos(), &mut |_, _| {}).unwrap();
    let reg = builtin();
    let greedy = reg.get("greedy").unwrap();
    let mut store = EngineStore::new(&mut engine);
    let r = SessionRequest {
        logprobs: None,
        prompt: &prompt,
        generated: &[],
        params: "{}",
        max_tokens: 16,
        n: 3,
        seed: 0,
        eos: model.tokenizer.eos(),
        vocabulary: None,
        grammar: None,
    };
    let got = generate(&greedy, &mut store, &r, &mut |_, _| {}).unwrap();
    for c in &got {
        assert_eq!(c.tokens, want[0]);
        assert_eq!(c.finish, Some(FinishReason::Length));
    }
    assert_eq!(store.engine.kv.sequences(), 0, "every sequence freed");
    let stats = store.engine.kv.stats();
    assert_eq!(stats.free, stats.total, "no KV block leaked (cached prefix blocks stay evictable)");
    assert_eq!(store.vocab(), model.config.vocab);
}

/// The issue's beam example: after the prompt "overloaded" 0.5197 and "busy" 0.2335; after
/// "overloaded", "again" 0.36; after "busy", "handling" 0.92. Tokens: 0 overloaded, 1 busy,
/// 2 again, 3 handling, 4 and 5 filler, 6 end-of-sequence.
fn overloaded_model() -> MockStore {
    let row = |top: &[(usize, f32)]| {
        let rest = (1.0 - top.iter().map(|x| x.1).sum::<f32>()) / (7 - top.len()) as f32;
        (0..7).map(|t| top.iter().find(|x| x.0 == t).map_or(rest, |x| x.1).ln()).collect::<Vec<f32>>()
    };
    MockStore::new(
        7,
        Box::new(move |prefix: &[u32]| match prefix.last() {
            Some(0) if prefix.len() > 1 => row(&[(2, 0.36)]),
            Some(1) if prefix.len() > 1 => row(&[(3, 0.92)]),
            _ if prefix.len() == 1 => row(&[(0, 0.5197), (1, 0.2335)]),
            _ => row(&[]),
        }),
    )
}

#[test]
fn beam_search_finds_the_better_sequence_that_greedy_misses() {
    let reg = builtin();
    let mut store = overloaded_model();
    let r = |params: &'static str, n: u32| SessionRequest {
        logprobs: Some(0),
        prompt: &[5],
        generated: &[],
        params,
        max_tokens: 2,
        n,
        seed: 0,
        eos: &[6],
        vocabulary: None,
        grammar: None,
    };
    let prob = |c: &inferd_engine::plugin::Choice| c.logprobs.iter().map(|&l| f64::from(l)).sum::<f64>().exp();
    let greedy = generate(&reg.get("greedy").unwrap(), &mut store, &r("{}", 1), &mut |_, _| {}).unwrap();
    assert_eq!(greedy[0].tokens, vec![0, 2], "overloaded, again");
    assert!((prob(&greedy[0]) - 0.1871).abs() < 1e-4);
    let beam = reg.get("beam").unwrap();
    let out = generate(&beam, &mut store, &r(r#"{"beam_width": 2}"#, 2), &mut |_, _| {}).unwrap();
    assert_eq!(out[0].tokens, vec![1, 3], "busy, handling");
    assert!((prob(&out[0]) - 0.2148).abs() < 1e-4);
    assert_eq!(out[1].tokens, vec![0, 2], "the runner-up is the greedy sequence");
    // Width 1 is greedy.
    let one = generate(&beam, &mut store, &r(r#"{"beam_width": 1}"#, 1), &mut |_, _| {}).unwrap();
    assert_eq!(one[0].tokens, greedy[0].tokens);
    assert_eq!(store.live(), 0, "dropped beams were freed");
    let e = generate(&beam, &mut store, &r(r#"{"beam_width": 2}"#, 3), &mut |_, _| {}).unwrap_err();
    assert!(e.to_string().contains("must not exceed beam_width"), "{e}");
}

#[test]
fn beam_search_ends_hypotheses_at_end_of_sequence_and_ranks_by_normalized_score() {
    // Token 6 ends a sequence; after the prompt it is likely, so one hypothesis ends at once.
    let mut store = MockStore::new(
        7,
        Box::new(|prefix: &[u32]| {
            let mut l = vec![0.0f32; 7];
            if prefix.len() == 1 {
                l[6] = 2.0;
                l[0] = 1.5;
            } else {
                l[(prefix.len() % 5) + 1] = 3.0;
            }
            l
        }),
    );
    let reg = builtin();
    let beam = reg.get("beam").unwrap();
    let r = SessionRequest {
        logprobs: None,
        prompt: &[5],
        generated: &[],
        params: r#"{"beam_width": 3, "length_penalty": 0}"#,
        max_tokens: 6,
        n: 3,
        seed: 0,
        eos: &[6],
        vocabulary: None,
        grammar: None,
    };
    let out = generate(&beam, &mut store, &r, &mut |_, _| {}).unwrap();
    // With length_penalty 0 the score is the total log-probability: the immediate end wins.
    assert_eq!(out[0].tokens, Vec::<u32>::new());
    assert_eq!(out[0].finish, Some(FinishReason::Stop));
    assert!(out[1..].iter().all(|c| !c.tokens.is_empty()));
    // With a strong length reward the longest hypotheses win instead.
    let r = SessionRequest { params: r#"{"beam_width": 3, "length_penalty": 3, "early_stopping": false}"#, ..r };
    let out = generate(&beam, &mut store, &r, &mut |_, _| {}).unwrap();
    assert_eq!(out[0].tokens.len(), 6);
    assert_eq!(out[0].finish, Some(FinishReason::Length));
    assert_eq!(store.live(), 0);
}

/// A mock model over `vocab` tokens from a hash of the prefix and a salt (another salt is
/// another model with the same vocabulary), sharpened by `scale`.
fn salted_model(vocab: usize, salt: u64, scale: f32) -> inferd_engine::decode::store::LogitsFn {
    Box::new(move |prefix: &[u32]| {
        let mut h: u64 = 1469598103934665603 ^ salt;
        for &t in prefix {
            h = (h ^ u64::from(t)).wrapping_mul(1099511628211);
        }
        (0..vocab as u64).map(|i| (((h.rotate_left(i as u32 * 7) >> 7) % 1000) as f32) / 1000.0 * scale).collect()
    })
}

#[test]
fn greedy_speculative_decoding_is_token_for_token_greedy_decoding() {
    let reg = builtin();
    let (greedy, spec) = (reg.get("greedy").unwrap(), reg.get("speculative").unwrap());
    // A repetitive prompt so prompt lookup finds matches; a draft model that is often wrong.
    let prompt: Vec<u32> = (0..40).map(|i| [3, 1, 4, 1, 5, 9, 2, 6][i % 8]).collect();
    // With p_min, rounds whose drafting stops early where the draft is unsure.
    let cases =
        [("prompt-lookup", 0, 0.0), ("model", 99, 0.0), ("model", 7, 0.0), ("model", 99, 0.4), ("model", 7, 0.4)];
    for (drafter, draft_salt, p_min) in cases {
        let mut store = MockStore::new(12, salted_model(12, 7, 8.0)).with_draft(salted_model(12, draft_salt, 8.0));
        let top = |params| SessionRequest { logprobs: Some(4), ..req(&prompt, params, 40, 1, 0) };
        let want = generate(&greedy, &mut store, &top("{}"), &mut |_, _| {}).unwrap();
        let params = format!(r#"{{"drafter": "{drafter}", "temperature": 0, "k": 4, "p_min": {p_min}}}"#);
        let got = inferd_engine::decode::generate_with_stats(&spec, &mut store, &top(&params), &mut |_, _| {}).unwrap();
        assert_eq!(got.choices[0].tokens, want[0].tokens, "{drafter} (draft salt {draft_salt})");
        // Each token's numbers come from the verify row that scored its position.
        assert_eq!(got.choices[0].logprobs, want[0].logprobs, "{drafter}");
        assert_eq!(got.choices[0].top_logprobs, want[0].top_logprobs, "{drafter}");
        assert_eq!(want[0].top_logprobs.len(), want[0].tokens.len());
        assert_eq!(got.choices[0].finish, want[0].finish);
        let (drafted, accepted) = (got.stats["draft_tokens"], got.stats["accepted_tokens"]);
        assert!(accepted <= drafted && got.stats["rounds"] >= 1.0, "{:?}", got.stats);
        if draft_salt == 7 {
            assert_eq!(accepted, drafted, "an identical draft model is always right");
            // Fewer rounds than tokens: it drafts where it is sure.
            assert!(got.stats["rounds"] < 40.0 / if p_min > 0.0 { 1.2 } else { 3.0 }, "{:?}", got.stats);
        }
        let stops = got.stats.get("unsure_stops").copied().unwrap_or(0.0);
        assert_eq!(stops > 0.0, p_min > 0.0, "{params}: {:?}", got.stats);
        assert_eq!(store.live(), 0);
    }
}

#[test]
fn sampled_speculative_decoding_keeps_the_targets_distribution() {
    // Target and draft disagree; the first three tokens' joint distribution must be the
    // target's, computed exactly by enumeration.
    let vocab = 4usize;
    let target = |prefix: &[u32]| salted_model(4, 1, 3.0)(prefix);
    let p_next = |prefix: &[u32]| {
        let l = target(prefix);
        let m = l.iter().copied().fold(f32::MIN, f32::max);
        let e: Vec<f64> = l.iter().map(|&x| f64::from(x - m).exp()).collect();
        let s: f64 = e.iter().sum();
        e.into_iter().map(|x| x / s).collect::<Vec<f64>>()
    };
    let prompt = [0u32, 1, 0, 1, 0];
    let mut want = vec![0.0f64; vocab.pow(3)];
    for a in 0..vocab {
        for b in 0..vocab {
            for c in 0..vocab {
                let mut pre = prompt.to_vec();
                let pa = p_next(&pre)[a];
                pre.push(a as u32);
                let pb = p_next(&pre)[b];
                pre.push(b as u32);
                want[(a * vocab + b) * vocab + c] = pa * pb * p_next(&pre)[c];
            }
        }
    }
    let reg = builtin();
    let spec = reg.get("speculative").unwrap();
    // p_min stops drafting where the draft is unsure, from its distribution before any draw:
    // the output distribution stays the target's.
    let cases = [
        r#"{"drafter": "model", "k": 2}"#,
        r#"{"drafter": "model", "k": 2, "p_min": 0.5}"#,
        r#"{"drafter": "prompt-lookup", "k": 2, "ngram_min": 1}"#,
    ];
    for params in cases {
        let mut store = MockStore::new(vocab, salted_model(4, 1, 3.0)).with_draft(salted_model(4, 2, 3.0));
        let draws = 20_000u64;
        let mut counts = vec![0u64; vocab.pow(3)];
        let (mut rejected, mut stops) = (0.0, 0.0);
        for seed in 0..draws {
            let g = inferd_engine::decode::generate_with_stats(
                &spec,
                &mut store,
                &SessionRequest {
                    logprobs: None,
                    prompt: &prompt,
                    generated: &[],
                    params,
                    max_tokens: 3,
                    n: 1,
                    seed,
                    eos: &[],
                    vocabulary: None,
                    grammar: None,
                },
                &mut |_, _| {},
            )
            .unwrap();
            let t = &g.choices[0].tokens;
            counts[(t[0] as usize * vocab + t[1] as usize) * vocab + t[2] as usize] += 1;
            rejected += g.stats.get("draft_tokens").copied().unwrap_or(0.0)
                - g.stats.get("accepted_tokens").copied().unwrap_or(0.0);
            stops += g.stats.get("unsure_stops").copied().unwrap_or(0.0);
        }
        assert!(rejected > 100.0, "{params}: the test must exercise rejections ({rejected})");
        assert_eq!(stops > 100.0, params.contains("p_min"), "{params}: early stops {stops}");
        for (i, &p) in want.iter().enumerate() {
            let got = counts[i] as f64 / draws as f64;
            let sd = (p * (1.0 - p) / draws as f64).sqrt();
            assert!((got - p).abs() <= 4.5 * sd + 1e-9, "{params}: sequence {i} drawn {got:.4}, target {p:.4}");
        }
        assert_eq!(store.live(), 0);
    }
}

#[test]
fn speculative_decoding_on_the_real_model_matches_greedy_with_either_drafter() {
    let path = inferd_e2e::default_model();
    let (model, draft_model) = (Model::load(&path).unwrap(), Model::load(&path).unwrap());
    let opts = EngineOptions { threads: 2, ..EngineOptions::default() };
    let mut engine = Engine::cpu(&model, &opts).unwrap();
    // The draft computes on its target's threads, as the daemon runs it.
    let pool = engine.backend.cpu_pool().unwrap();
    let mut draft = Engine::cpu(&draft_model, &EngineOptions { pool: Some(pool.clone()), ..opts }).unwrap();
    assert!(std::sync::Arc::ptr_eq(&pool, &draft.backend.cpu_pool().unwrap()));
    let text = "Rewrite with one word changed: The quick brown fox jumps over the lazy dog near the river bank.";
    let prompt = model.tokenizer.encode(text, false).unwrap();
    let reg = builtin();
    let mut store = EngineStore::with_draft(&mut engine, &mut draft);
    let r = |params: &'static str| SessionRequest {
        logprobs: None,
        prompt: &prompt,
        generated: &[],
        params,
        max_tokens: 24,
        n: 1,
        seed: 0,
        eos: model.tokenizer.eos(),
        vocabulary: None,
        grammar: None,
    };
    let want = generate(&reg.get("greedy").unwrap(), &mut store, &r("{}"), &mut |_, _| {}).unwrap();
    let spec = reg.get("speculative").unwrap();
    for params in [r#"{"temperature": 0}"#, r#"{"temperature": 0, "drafter": "model", "k": 3}"#] {
        let got = inferd_engine::decode::generate_with_stats(&spec, &mut store, &r(params), &mut |_, _| {}).unwrap();
        assert_eq!(got.choices[0].tokens, want[0].tokens, "{params}");
        if params.contains("model") {
            assert_eq!(
                got.stats["accepted_tokens"], got.stats["draft_tokens"],
                "the same model as draft is always right"
            );
        }
    }
    // The same prompt again: the draft's copy of the context (created empty, filled by a run)
    // comes from the draft's prefix cache, as the target's prompt does; no token changes.
    use inferd_engine::decode::store::SeqStore;
    let before = store.cache_stats().unwrap().cached_run_tokens;
    let params = r#"{"temperature": 0, "drafter": "model", "k": 3}"#;
    let again = generate(&spec, &mut store, &r(params), &mut |_, _| {}).unwrap();
    assert_eq!(again[0].tokens, want[0].tokens);
    let reused = (store.cache_stats().unwrap().cached_run_tokens - before) as usize;
    // All of its full blocks but the one that holds the last token before drafting.
    assert!(prompt.len() >= 18 && reused == (prompt.len() - 2) / 16 * 16, "{reused} of {} reused", prompt.len());
    assert_eq!(store.engine.kv.sequences(), 0);
    assert_eq!(store.draft.as_ref().unwrap().kv.sequences(), 0);
}

#[test]
fn sampled_speculative_decoding_on_two_models_keeps_the_targets_distribution() {
    // Two random-weight models over one vocabulary (seeds 7 and 8) as target and draft on the
    // engine, at temperature 0.7: over many seeds, the frequencies of the first two tokens (the
    // second the first a draft proposed) match the target's own distribution, computed exactly from its logits (the second
    // token's marginal summed over every first token), by a chi-square test; rounds roll
    // both models' KV back as in serving.
    use inferd_e2e::{temp_dir, write_tiny_gguf, TinySpec};
    let dir = temp_dir("spec-dist");
    let f32 = inferd_kernels::DType::F32;
    let load = |seed| {
        let spec = TinySpec { seed, ..TinySpec::default() };
        Model::load(&write_tiny_gguf(&dir.join(format!("m{seed}.gguf")), &spec, f32, f32)).unwrap()
    };
    let (target, drafter) = (load(7), load(8));
    let opts = EngineOptions { threads: 2, ..EngineOptions::default() };
    let mut engine = Engine::cpu(&target, &opts).unwrap();
    let mut draft = Engine::cpu(&drafter, &EngineOptions { pool: engine.backend.cpu_pool(), ..opts }).unwrap();
    let vocab = target.config.vocab;
    let temp = 0.7f64;
    let probs = |e: &mut Engine, p: &[u32]| {
        let (s, l) = e.prefill(&[p]).unwrap().remove(0);
        e.release(s);
        let m = l.iter().copied().fold(f32::MIN, f32::max);
        let x: Vec<f64> = l.iter().map(|&v| (f64::from(v - m) / temp).exp()).collect();
        let z: f64 = x.iter().sum();
        x.into_iter().map(|v| v / z).collect::<Vec<f64>>()
    };
    let prompt: Vec<u32> = (0..9u32).map(|i| 3 + (i * 31 + 17) % 250).collect();
    let first = probs(&mut engine, &prompt);
    let mut second = vec![0.0f64; vocab];
    for (a, &pa) in first.iter().enumerate() {
        let mut p = prompt.clone();
        p.push(a as u32);
        for (b, pb) in probs(&mut engine, &p).into_iter().enumerate() {
            second[b] += pa * pb;
        }
    }
    // The draft disagrees: otherwise nothing would be rejected.
    let q = probs(&mut draft, &prompt);
    let tv: f64 = first.iter().zip(&q).map(|(p, q)| (p - q).abs()).sum::<f64>() / 2.0;
    assert!(tv > 0.1, "target and draft too alike ({tv})");
    let reg = builtin();
    let spec = reg.get("speculative").unwrap();
    let mut store = EngineStore::with_draft(&mut engine, &mut draft);
    let draws = 6000u64;
    for params in [
        r#"{"drafter": "model", "k": 3, "temperature": 0.7}"#,
        r#"{"drafter": "model", "k": 3, "temperature": 0.7, "p_min": 0.05}"#,
    ] {
        let (mut counts, mut rejected) = ([vec![0u64; vocab], vec![0u64; vocab]], 0.0);
        for seed in 0..draws {
            // Four tokens: the first the target's own, then a round with two drafted.
            let r = SessionRequest { eos: &[], ..req(&prompt, params, 4, 1, seed) };
            let g = inferd_engine::decode::generate_with_stats(&spec, &mut store, &r, &mut |_, _| {}).unwrap();
            let t = &g.choices[0].tokens;
            assert_eq!(t.len(), 4);
            counts[0][t[0] as usize] += 1;
            counts[1][t[1] as usize] += 1;
            rejected += g.stats.get("draft_tokens").copied().unwrap_or(0.0)
                - g.stats.get("accepted_tokens").copied().unwrap_or(0.0);
        }
        assert!(rejected > 500.0, "{params}: the test must exercise rejections ({rejected})");
        for (pos, (want, got)) in [&first, &second].into_iter().zip(&counts).enumerate() {
            // Bins of at least 5 expected draws; the rest pooled into one.
            let (mut chi2, mut bins, mut rest) = (0.0, 0usize, (0.0, 0.0));
            for (&p, &c) in want.iter().zip(got) {
                let e = p * draws as f64;
                if e >= 5.0 {
                    chi2 += (c as f64 - e).powi(2) / e;
                    bins += 1;
                } else {
                    rest = (rest.0 + e, rest.1 + c as f64);
                }
            }
            if rest.0 > 0.0 {
                chi2 += (rest.1 - rest.0).powi(2) / rest.0;
                bins += 1;
            }
            // A p-value of about 1e-4 for `bins - 1` degrees of freedom (Wilson-Hilferty).
            let df = (bins - 1) as f64;
            let bound = df * (1.0 - 2.0 / (9.0 * df) + 3.72 * (2.0 / (9.0 * df)).sqrt()).powi(3);
            assert!(chi2 < bound, "{params}: token {pos}: chi-square {chi2:.1} over {bins} bins, bound {bound:.1}");
        }
    }
    assert_eq!(store.engine.kv.sequences(), 0);
    assert_eq!(store.draft.as_ref().unwrap().kv.sequences(), 0);
}

#[test]
fn a_draft_with_a_cheaper_output_projection_still_gives_greedy_output() {
    // The daemon requantizes a draft's output projection to Q4_0 (the default model's is its
    // Q8_0 embedding, tied): the draft's own guesses move a little, the output not at all.
    let path = inferd_e2e::default_model();
    let model = Model::load(&path).unwrap();
    let mut cheap = Model::load(&path).unwrap();
    assert!(cheap.cheapen_output_for_drafting(2));
    assert_eq!(cheap.weights.output.dtype, inferd_kernels::quant::DType::Q4_0);
    assert_eq!(cheap.weights.token_embd.dtype, model.weights.token_embd.dtype, "the embedding stays");
    assert!(!cheap.cheapen_output_for_drafting(2), "already cheap");
    let opts = EngineOptions { threads: 2, ..EngineOptions::default() };
    let mut engine = Engine::cpu(&model, &opts).unwrap();
    let mut draft = Engine::cpu(&cheap, &EngineOptions { pool: engine.backend.cpu_pool(), ..opts }).unwrap();
    let prompt =
        model.tokenizer.encode("def fibonacci(n):\n    \"\"\"The n-th Fibonacci number.\"\"\"\n", false).unwrap();
    let reg = builtin();
    let mut store = EngineStore::with_draft(&mut engine, &mut draft);
    let r = |params: &'static str| SessionRequest { eos: model.tokenizer.eos(), ..req(&prompt, params, 48, 1, 0) };
    let want = generate(&reg.get("greedy").unwrap(), &mut store, &r("{}"), &mut |_, _| {}).unwrap();
    let spec = reg.get("speculative").unwrap();
    for params in [
        r#"{"temperature": 0, "drafter": "model", "k": 4}"#,
        r#"{"temperature": 0, "drafter": "model", "k": 8, "p_min": 0.75}"#,
    ] {
        let got = inferd_engine::decode::generate_with_stats(&spec, &mut store, &r(params), &mut |_, _| {}).unwrap();
        assert_eq!(got.choices[0].tokens, want[0].tokens, "{params}");
        let (drafted, accepted) = (got.stats["draft_tokens"], got.stats["accepted_tokens"]);
        assert!(drafted > 0.0 && accepted <= drafted && accepted >= 0.5 * drafted, "{params}: {:?}", got.stats);
    }
    assert_eq!(store.engine.kv.sequences(), 0);
}

#[test]
fn sessions_batched_together_decode_as_they_do_alone() {
    // Greedy, sampled, beam and speculative requests in the daemon's engine loop, their plans
    // merged into one batch per step on the real model: every one gets exactly the tokens and
    // log-probabilities it gets alone (batch-invariant kernels, per-request seeds), and a
    // failing request in the batch fails alone.
    use inferd_engine::sched::{channel_sink, engine_loop, Command, Event, LoopConfig, Submission};
    use std::sync::mpsc::channel;
    let model = Model::load(&inferd_e2e::default_model()).unwrap();
    let mut engine = Engine::cpu(&model, &EngineOptions { threads: 2, ..EngineOptions::default() }).unwrap();
    let reg = builtin();
    let prompts: Vec<Vec<u32>> = [
        "The capital of France is",
        "Once upon a time, a fox",
        "List three fruits: apple, pear,",
        "Repeat: one two three, one two three,",
    ]
    .iter()
    .map(|t| model.tokenizer.encode(t, false).unwrap())
    .collect();
    let eos = model.tokenizer.eos().to_vec();
    let specs = [
        ("greedy", "{}", 1),
        ("nucleus", r#"{"temperature": 0.9, "top_p": 0.9}"#, 2),
        ("beam", r#"{"beam_width": 2}"#, 1),
        ("speculative", r#"{"temperature": 0}"#, 1),
    ];
    let mut store = EngineStore::new(&mut engine);
    let alone: Vec<_> = specs
        .iter()
        .zip(&prompts)
        .enumerate()
        .map(|(i, ((name, params, n), p))| {
            let r = SessionRequest {
                logprobs: Some(0),
                prompt: p,
                generated: &[],
                params,
                max_tokens: 12,
                n: *n,
                seed: 40 + i as u64,
                eos: &eos,
                vocabulary: None,
                grammar: None,
            };
            generate(&reg.get(name).unwrap(), &mut store, &r, &mut |_, _| {}).unwrap()
        })
        .collect();
    // Runs (strategy, prompt index, params, n, seed) requests together; each request's events.
    let run = |store: &mut EngineStore<'_>,
               subs: Vec<(std::sync::Arc<inferd_engine::plugin::LoadedStrategy>, usize, &'static str, u32, u64)>|
     -> Vec<Vec<Event>> {
        let (tx, rx) = channel();
        let mut outs = Vec::new();
        for (id, (strategy, p, params, n, seed)) in subs.into_iter().enumerate() {
            let (etx, erx) = channel();
            let sub = Submission {
                id: id as u64,
                strategy,
                prompt: prompts[p].clone(),
                params: params.into(),
                max_tokens: 12,
                n,
                seed,
                logprobs: Some(0),
                meta: Default::default(),
                events: channel_sink(etx),
                grammar: None,
                images: Vec::new(),
            };
            tx.send(Command::Submit(sub)).unwrap();
            outs.push(erx);
        }
        drop(tx);
        engine_loop(
            store,
            &rx,
            &LoopConfig {
                token_budget: 256,
                max_running: 64,
                eos: eos.clone(),
                monitor: None,
                vocabulary: None,
                kv_release_after: None,
                prefix_sharing: Default::default(),
            },
        );
        outs.into_iter().map(|r| r.try_iter().collect()).collect()
    };
    let subs = specs
        .iter()
        .enumerate()
        .map(|(i, (name, params, n))| (reg.get(name).unwrap(), i, *params, *n, 40 + i as u64))
        .collect();
    let events = run(&mut store, subs);
    for (i, ev) in events.iter().enumerate() {
        let Some(Event::Finished(g)) = ev.last() else { panic!("request {i} ({}): {ev:?}", specs[i].0) };
        assert_eq!(g.choices, alone[i], "request {i} ({})", specs[i].0);
    }
    let streamed = events[0].iter().filter(|e| matches!(e, Event::Token { .. })).count();
    assert_eq!(streamed, alone[0][0].tokens.len());
    assert_eq!(store.engine.kv.sequences(), 0);

    // A broken plugin's request fails; the one batched with it does not notice.
    let dir = inferd_e2e::temp_dir("batch-badhandle");
    let mut bad = Registry::default();
    bad.load_file(&compile_c(&dir, "badhandle", &["FAULT_BAD_HANDLE"]), TrustPolicy::User).unwrap();
    let events = run(
        &mut store,
        vec![(bad.get("c-greedy").unwrap(), 0, "{}", 1, 40), (reg.get("greedy").unwrap(), 0, "{}", 1, 40)],
    );
    assert!(matches!(events[0].last(), Some(Event::Failed(m)) if m.contains("not this request's")), "{:?}", events[0]);
    assert!(matches!(events[1].last(), Some(Event::Finished(g)) if g.choices == alone[0]), "{:?}", events[1]);
    assert_eq!(store.engine.kv.sequences(), 0);
}
