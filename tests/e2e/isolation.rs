//! Plugin libraries in a helper process: they decode exactly as they do in the daemon, and one
//! that crashes, hangs, hoards memory or reaches for the system fails its own requests and
//! nothing else, is quarantined across restarts, and finds the sandbox shut.

use crate::plugins::{build_dir, compile_c, hashed_model, req};
use inferd_engine::decode::generate;
use inferd_engine::plugin::{Isolate, Isolation, PluginError, Quarantine, Registry, SessionRequest, TrustPolicy};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn isolation(quarantine: &Path, timeout_ms: u64) -> Isolation {
    Isolation {
        exe: build_dir().join("inferd"),
        call_timeout: Duration::from_millis(timeout_ms),
        memory_mib: 512,
        quarantine: Some(Arc::new(Quarantine::open(quarantine))),
    }
}

#[test]
fn an_isolated_library_decodes_exactly_as_it_does_in_the_daemon() {
    let dir = inferd_e2e::temp_dir("isolated-same");
    let libs = [
        compile_c(&dir, "cgreedy", &[]),
        build_dir().join("libinferd_nucleus.so"),
        build_dir().join("libinferd_beam.so"),
    ];
    let mut apart = Registry::isolating(Isolate::All, isolation(&dir.join("q"), 5000));
    let mut inside = Registry::default();
    for lib in &libs {
        apart.load_file(lib, TrustPolicy::User).unwrap();
        inside.load_file(lib, TrustPolicy::User).unwrap();
    }
    assert!(apart.get("beam").unwrap().isolated() && !inside.get("beam").unwrap().isolated());
    let mut store = hashed_model();
    let cases = [
        ("c-greedy", "{}", 1),
        // Seeded sampling: the helper draws the host's Philox stream itself.
        ("nucleus", r#"{"temperature": 0.9, "top_p": 0.95}"#, 3),
        // Forks, frees and per-beam plans through forwarded callbacks.
        ("beam", r#"{"beam_width": 3}"#, 2),
    ];
    for (name, params, n) in cases {
        for prompt in [[1u32, 2, 3], [9, 9, 9], [0, 5, 14]] {
            // With log-probabilities: they show the rows crossed the shared memory bit for bit.
            let r = SessionRequest { logprobs: Some(0), ..req(&prompt, params, 16, n, 42) };
            let (mut sa, mut si) = (Vec::new(), Vec::new());
            let a = generate(&apart.get(name).unwrap(), &mut store, &r, &mut |c, t| sa.push((c, t))).unwrap();
            let b = generate(&inside.get(name).unwrap(), &mut store, &r, &mut |c, t| si.push((c, t))).unwrap();
            assert_eq!(a, b, "{name} {prompt:?}");
            assert_eq!(sa, si, "{name}: the tokens stream in the same order");
            assert!(
                !a[0].tokens.is_empty() && a.iter().all(|c| c.logprobs.iter().all(|p| !p.is_nan())),
                "{name}: {a:?}"
            );
        }
    }
    // Refusals keep their messages across the process boundary.
    let e = generate(&apart.get("c-greedy").unwrap(), &mut store, &req(&[1], r#"{"x": 1}"#, 4, 1, 0), &mut |_, _| {})
        .unwrap_err();
    assert!(e.to_string().contains("c-greedy takes no parameters"), "{e}");
    assert_eq!(store.live(), 0);
}

#[test]
fn a_library_that_crashes_hangs_or_hoards_memory_fails_its_requests_and_nothing_else() {
    let dir = inferd_e2e::temp_dir("isolated-faults");
    let cases = [
        ("segv", "FAULT_SEGV", "killed by signal 11 (SIGSEGV)", true),
        ("abort", "FAULT_ABORT", "killed by signal 6 (SIGABRT)", true),
        ("hang", "FAULT_HANG", "ran for longer than 300 ms", true),
        // 20 GiB against a 512 MiB limit: malloc says no, and the plugin says so.
        ("hoard", "FAULT_HUGE_ALLOC", "could not allocate 20 GiB", false),
    ];
    for (name, define, expect, quarantined) in cases {
        let lib = compile_c(&dir, name, &[define]);
        let list = dir.join(format!("quarantine-{name}"));
        let mut reg = Registry::isolating(Isolate::ThirdParty, isolation(&list, 300));
        reg.load_file(&build_dir().join("libinferd_greedy.so"), TrustPolicy::User).unwrap();
        reg.load_file(&lib, TrustPolicy::User).unwrap();
        assert!(!reg.get("greedy").unwrap().isolated(), "inferd's own strategies stay in the daemon");
        let mut store = hashed_model();
        let mut streamed = Vec::new();
        let t0 = Instant::now();
        let e = generate(&reg.get("c-greedy").unwrap(), &mut store, &req(&[1, 2, 3], "{}", 12, 1, 0), &mut |_, t| {
            streamed.push(t)
        })
        .unwrap_err();
        let took = t0.elapsed();
        assert!(e.to_string().contains(expect), "{name}: {e}");
        assert_eq!(streamed.len(), 2, "{name}: the tokens before the fault went out");
        assert_eq!(store.live(), 0, "{name}: every sequence came back");
        assert!(took < Duration::from_secs(5), "{name}: took {took:?}");
        // The daemon's own strategies carry on.
        let ok = generate(&reg.get("greedy").unwrap(), &mut store, &req(&[1, 2, 3], "{}", 12, 1, 0), &mut |_, _| {});
        assert_eq!(ok.unwrap()[0].tokens.len(), 12);
        match reg.get("c-greedy") {
            Err(PluginError::Quarantined(_, why)) => {
                assert!(quarantined, "{name}: an error status is no fault");
                assert!(why.contains(expect), "{why}");
                // After a restart the file is refused, until another version replaces it.
                let mut again = Registry::isolating(Isolate::ThirdParty, isolation(&list, 300));
                let e = again.load_file(&lib, TrustPolicy::User).unwrap_err();
                assert!(e.to_string().contains("quarantined since") && e.to_string().contains(expect), "{e}");
                compile_c(&dir, name, &[]);
                again.load_file(&lib, TrustPolicy::User).unwrap();
            }
            Ok(s) => assert!(!quarantined && !s.quarantined(), "{name}: not quarantined"),
            Err(e) => panic!("{name}: {e}"),
        }
        assert_eq!(store.live(), 0);
    }
}

#[test]
fn a_library_that_crashes_while_loading_is_refused_and_remembered() {
    let dir = inferd_e2e::temp_dir("isolated-crash-load");
    let lib = compile_c(&dir, "crashload", &["FAULT_CRASH_LOAD"]);
    let list = dir.join("quarantine");
    let mut reg = Registry::isolating(Isolate::ThirdParty, isolation(&list, 1000));
    let e = reg.load_file(&lib, TrustPolicy::User).unwrap_err();
    assert!(e.to_string().contains("died while loading it (killed by signal 11 (SIGSEGV))"), "{e}");
    let e = Registry::isolating(Isolate::ThirdParty, isolation(&list, 1000)).load_file(&lib, TrustPolicy::User);
    assert!(e.unwrap_err().to_string().contains("quarantined since"));
}

#[test]
fn the_sandbox_leaves_a_library_nothing_but_computing() {
    let dir = inferd_e2e::temp_dir("isolated-escape");
    let lib = compile_c(&dir, "escape", &["FAULT_ESCAPE"]);
    let mut store = hashed_model();
    let r = req(&[1, 2, 3], "{}", 8, 1, 0);
    // Loaded into this process, the library can open files, sockets and signal its parent.
    let mut inside = Registry::default();
    inside.load_file(&lib, TrustPolicy::User).unwrap();
    let e = generate(&inside.get("c-greedy").unwrap(), &mut store, &r, &mut |_, _| {}).unwrap_err();
    assert!(e.to_string().contains("escaped: opened /etc/hostname"), "{e}");
    // In its helper it can do none of it, and decodes.
    let mut apart = Registry::isolating(Isolate::All, isolation(&dir.join("q"), 1000));
    apart.load_file(&lib, TrustPolicy::User).unwrap();
    let out = generate(&apart.get("c-greedy").unwrap(), &mut store, &r, &mut |_, _| {});
    assert_eq!(out.unwrap()[0].tokens.len(), 8);
    assert_eq!(store.live(), 0);
}
