//! The engine loop on the real model: continuous batching gives every request the tokens it
//! gets alone, short requests overtake long ones, a full cache preempts and recomputes without
//! failing anyone, cancellation and oversized requests are handled, nothing leaks.

use inferd_engine::decode::generate;
use inferd_engine::decode::store::EngineStore;
use inferd_engine::engine::{Engine, EngineOptions};
use inferd_engine::model::Model;
use inferd_engine::plugin::{Registry, SessionRequest, TrustPolicy};
use inferd_engine::sched::{channel_sink, engine_loop, Command, Event, LoopConfig, LoopStats, Submission};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;

fn registry() -> Registry {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().and_then(std::path::Path::parent).unwrap().to_path_buf();
    let (reg, refused) = Registry::load_dirs(&[dir], TrustPolicy::User);
    assert!(reg.names().contains(&"greedy".to_string()), "plugins not built: {refused:?}");
    reg
}

/// Starts an engine thread over `model` with a KV pool of `blocks` blocks; returns its command
/// sender and a handle yielding the loop's counters and the engine's live sequence count.
fn start(model: Arc<Model>, blocks: usize) -> (Sender<Command>, std::thread::JoinHandle<(LoopStats, usize)>) {
    start_with_budget(model, blocks, 256)
}

fn start_with_budget(
    model: Arc<Model>,
    blocks: usize,
    token_budget: usize,
) -> (Sender<Command>, std::thread::JoinHandle<(LoopStats, usize)>) {
    let (tx, rx) = channel();
    let h = std::thread::spawn(move || {
        let bytes = blocks * inferd_engine::backend::cpu::kv_block_bytes(&model.config, 16);
        let mut engine =
            Engine::cpu(&model, &EngineOptions { threads: 2, kv_budget_bytes: bytes, ..EngineOptions::default() })
                .unwrap();
        let mut store = EngineStore::new(&mut engine);
        let stats = engine_loop(
            &mut store,
            &rx,
            &LoopConfig {
                token_budget,
                max_running: 64,
                eos: model.tokenizer.eos().to_vec(),
                monitor: None,
                vocabulary: None,
                kv_release_after: None,
                prefix_sharing: Default::default(),
            },
        );
        (stats, engine.kv.sequences())
    });
    (tx, h)
}

struct Req {
    id: u64,
    strategy: &'static str,
    params: &'static str,
    prompt: Vec<u32>,
    max_tokens: u32,
}

fn submit(tx: &Sender<Command>, reg: &Registry, r: &Req) -> Receiver<Event> {
    let (etx, erx) = channel();
    let sub = Submission {
        id: r.id,
        strategy: reg.get(r.strategy).unwrap(),
        prompt: r.prompt.clone(),
        params: r.params.into(),
        max_tokens: r.max_tokens,
        n: 1,
        seed: r.id,
        logprobs: None,
        meta: Default::default(),
        events: channel_sink(etx),
        grammar: None,
        images: Vec::new(),
    };
    tx.send(Command::Submit(sub)).unwrap();
    erx
}

/// Streamed tokens and the final ones (or the failure).
fn collect(rx: &Receiver<Event>) -> (Vec<u32>, Result<Vec<u32>, String>) {
    let mut streamed = Vec::new();
    loop {
        match rx.recv().expect("the engine answers every request") {
            Event::Token { token, .. } => streamed.push(token),
            Event::Finished(g) => return (streamed, Ok(g.choices[0].tokens.clone())),
            Event::Failed(m) => return (streamed, Err(m)),
        }
    }
}

fn alone(model: &Model, reg: &Registry, r: &Req) -> Vec<u32> {
    let mut engine = Engine::cpu(model, &EngineOptions { threads: 2, ..EngineOptions::default() }).unwrap();
    let req = SessionRequest {
        prompt: &r.prompt,
        generated: &[],
        params: r.params,
        max_tokens: r.max_tokens,
        n: 1,
        seed: r.id,
        eos: model.tokenizer.eos(),
        logprobs: None,
        vocabulary: None,
        grammar: None,
    };
    generate(&reg.get(r.strategy).unwrap(), &mut EngineStore::new(&mut engine), &req, &mut |_, _| {}).unwrap()[0]
        .tokens
        .clone()
}

fn requests(model: &Model) -> Vec<Req> {
    let p = |t: &str| model.tokenizer.encode(t, false).unwrap();
    vec![
        Req { id: 1, strategy: "greedy", params: "{}", prompt: p("A long story about a dragon:"), max_tokens: 48 },
        Req {
            id: 2,
            strategy: "nucleus",
            params: r#"{"temperature": 0.8}"#,
            prompt: p("The weather today is"),
            max_tokens: 40,
        },
        Req { id: 3, strategy: "greedy", params: "{}", prompt: p("2 + 2 ="), max_tokens: 3 },
        Req {
            id: 4,
            strategy: "min-p",
            params: r#"{"min_p": 0.1}"#,
            prompt: p("My favourite colour is"),
            max_tokens: 36,
        },
    ]
}

#[test]
fn continuous_batching_matches_each_request_alone_and_short_requests_finish_first() {
    let model = Arc::new(Model::load(&inferd_e2e::default_model()).unwrap());
    let reg = registry();
    let reqs = requests(&model);
    let (tx, h) = start(Arc::clone(&model), 2048);
    let rxs: Vec<Receiver<Event>> = reqs.iter().map(|r| submit(&tx, &reg, r)).collect();
    // Each client on its own thread, noting when its request finished.
    let clients: Vec<_> =
        rxs.into_iter().map(|rx| std::thread::spawn(move || (collect(&rx), std::time::Instant::now()))).collect();
    let (results, finished_at): (Vec<_>, Vec<_>) = clients.into_iter().map(|c| c.join().unwrap()).unzip();
    // The short request (id 3), submitted after the long one (id 1), finished first.
    assert!(finished_at[2] < finished_at[0], "a short request does not wait for a long one");
    tx.send(Command::Shutdown).unwrap();
    let (stats, live) = h.join().unwrap();
    for (r, (streamed, done)) in reqs.iter().zip(&results) {
        let done = done.as_ref().unwrap();
        assert_eq!(done, &alone(&model, &reg, r), "request {} batched vs alone", r.id);
        assert_eq!(streamed, done, "request {}: the stream is the result", r.id);
    }
    assert_eq!((stats.finished, stats.failed, stats.preempted), (4, 0, 0));
    assert!(stats.steps < 48 + 10, "the requests shared steps ({} steps)", stats.steps);
    assert_eq!(live, 0);
}

#[test]
fn a_full_cache_preempts_and_recomputes_without_failing_or_repeating_tokens() {
    let model = Arc::new(Model::load(&inferd_e2e::default_model()).unwrap());
    let reg = registry();
    // Three greedy requests of about 4 blocks each in a cache of 8 blocks.
    let p = |t: &str| model.tokenizer.encode(t, false).unwrap();
    let reqs = [
        Req { id: 11, strategy: "greedy", params: "{}", prompt: p("A long story about a dragon:"), max_tokens: 52 },
        Req { id: 12, strategy: "greedy", params: "{}", prompt: p("Ten facts about the moon:"), max_tokens: 52 },
        Req { id: 13, strategy: "greedy", params: "{}", prompt: p("How to bake bread, step by step:"), max_tokens: 52 },
    ];
    let (tx, h) = start(Arc::clone(&model), 8);
    let rxs: Vec<Receiver<Event>> = reqs.iter().map(|r| submit(&tx, &reg, r)).collect();
    let results: Vec<_> = rxs.iter().map(collect).collect();
    tx.send(Command::Shutdown).unwrap();
    let (stats, live) = h.join().unwrap();
    for (r, (streamed, done)) in reqs.iter().zip(&results) {
        let done = done.as_ref().unwrap_or_else(|e| panic!("request {} failed: {e}", r.id));
        assert_eq!(done, &alone(&model, &reg, r), "request {} after preemption vs alone", r.id);
        assert_eq!(streamed, done, "request {}: no token streamed twice or lost", r.id);
    }
    assert!(stats.preempted > 0, "the cache was too small for all: {stats:?}");
    assert_eq!(stats.failed, 0);
    assert_eq!(live, 0);
}

#[test]
fn cancelled_and_oversized_requests_fail_alone_and_free_their_blocks() {
    let model = Arc::new(Model::load(&inferd_e2e::default_model()).unwrap());
    let reg = registry();
    let (tx, h) = start(Arc::clone(&model), 6);
    let huge = Req { id: 7, strategy: "greedy", params: "{}", prompt: vec![300; 200], max_tokens: 4 };
    let long = Req {
        id: 8,
        strategy: "greedy",
        params: "{}",
        prompt: model.tokenizer.encode("Count: 1, 2, 3,", false).unwrap(),
        max_tokens: 60,
    };
    let short = Req {
        id: 9,
        strategy: "greedy",
        params: "{}",
        prompt: model.tokenizer.encode("Hello", false).unwrap(),
        max_tokens: 5,
    };
    let rx_huge = submit(&tx, &reg, &huge);
    let rx_long = submit(&tx, &reg, &long);
    // Cancel the long request once it has streamed a few tokens.
    let mut got = 0;
    while got < 3 {
        if let Event::Token { .. } = rx_long.recv().unwrap() {
            got += 1;
        }
    }
    tx.send(Command::Cancel(8)).unwrap();
    let rx_short = submit(&tx, &reg, &short);
    let (_, huge_done) = collect(&rx_huge);
    assert!(huge_done.unwrap_err().contains("more than the cache holds"));
    let (_, long_done) = collect(&rx_long);
    assert_eq!(long_done.unwrap_err(), "cancelled");
    let (_, short_done) = collect(&rx_short);
    assert_eq!(short_done.unwrap(), alone(&model, &reg, &short));
    tx.send(Command::Shutdown).unwrap();
    let (stats, live) = h.join().unwrap();
    assert_eq!((stats.cancelled, stats.failed, stats.finished), (1, 1, 1));
    assert_eq!(live, 0, "the cancelled request's blocks were freed");
}

/// The order in which requests got their first token, with `max_running` requests at a time, for
/// `(uid, priority)` submissions queued before the loop starts.
fn admission_order(reqs: &[(u32, inferd_engine::sched::Priority)], max_running: usize) -> Vec<usize> {
    use inferd_engine::decode::store::MockStore;
    use inferd_engine::sched::RequestMeta;
    let reg = registry();
    let (tx, rx) = channel();
    let (etx, erx) = channel::<(usize, Event)>();
    for (i, &(uid, priority)) in reqs.iter().enumerate() {
        let etx = etx.clone();
        let events = Box::new(move |e: Event| etx.send((i, e)).is_ok());
        let meta = RequestMeta { uid, priority, ..RequestMeta::default() };
        let sub = Submission {
            id: i as u64,
            strategy: reg.get("greedy").unwrap(),
            prompt: vec![1, 2, 3],
            params: "{}".into(),
            max_tokens: 3,
            n: 1,
            seed: 0,
            logprobs: None,
            meta,
            events,
            grammar: None,
            images: Vec::new(),
        };
        tx.send(Command::Submit(sub)).unwrap();
    }
    drop(tx);
    drop(etx);
    let mut store = MockStore::new(
        8,
        Box::new(|p: &[u32]| (0..8).map(|t| if t == (p.len() % 8) as u32 { 1.0 } else { 0.0 }).collect()),
    );
    engine_loop(
        &mut store,
        &rx,
        &LoopConfig {
            token_budget: 256,
            max_running,
            eos: Vec::new(),
            monitor: None,
            vocabulary: None,
            kv_release_after: None,
            prefix_sharing: Default::default(),
        },
    );
    let mut order = Vec::new();
    for (i, e) in erx.iter() {
        if matches!(e, Event::Token { .. }) && !order.contains(&i) {
            order.push(i);
        }
    }
    order
}

#[test]
fn users_take_turns_and_interactive_requests_go_before_background_ones() {
    use inferd_engine::sched::Priority::{Background, Interactive};
    // User 1 queues four requests before user 2's two: they alternate instead of user 2 waiting
    // for all of user 1's; background work waits for every interactive request.
    let reqs = [
        (1, Interactive),
        (1, Interactive),
        (1, Interactive),
        (1, Interactive),
        (3, Background),
        (2, Interactive),
        (2, Interactive),
    ];
    assert_eq!(admission_order(&reqs, 1), vec![0, 5, 1, 6, 2, 3, 4]);
    // With two slots, each user holds one while both have work.
    assert_eq!(admission_order(&reqs, 2), vec![0, 5, 1, 6, 2, 3, 4]);
    // One user alone is served in order (first come, first served).
    assert_eq!(
        admission_order(&[(7, Interactive), (7, Interactive), (7, Background), (7, Interactive)], 1),
        vec![0, 1, 3, 2]
    );
}

#[test]
fn a_long_prompt_is_prefilled_in_chunks_while_others_keep_decoding() {
    let model = Arc::new(Model::load(&inferd_e2e::default_model()).unwrap());
    let reg = registry();
    let p = |t: &str| model.tokenizer.encode(t, false).unwrap();
    let story = "The old lighthouse keeper climbed the stairs every evening, counting each step. ".repeat(30);
    let decoding =
        Req { id: 21, strategy: "greedy", params: "{}", prompt: p("Ten facts about the moon:"), max_tokens: 40 };
    let long = Req { id: 22, strategy: "greedy", params: "{}", prompt: p(&story), max_tokens: 4 };
    assert!(long.prompt.len() > 400, "{}", long.prompt.len());
    let (tx, h) = start_with_budget(Arc::clone(&model), 2048, 64);
    // One channel for both, to see how their tokens interleave.
    let (etx, erx) = channel::<(u64, Event)>();
    for r in [&decoding, &long] {
        let etx = etx.clone();
        let id = r.id;
        let sub = Submission {
            id,
            strategy: reg.get(r.strategy).unwrap(),
            prompt: r.prompt.clone(),
            params: r.params.into(),
            max_tokens: r.max_tokens,
            n: 1,
            seed: id,
            logprobs: None,
            meta: Default::default(),
            events: Box::new(move |e| etx.send((id, e)).is_ok()),
            grammar: None,
            images: Vec::new(),
        };
        tx.send(Command::Submit(sub)).unwrap();
    }
    drop(etx);
    let mut order = Vec::new();
    let mut results = std::collections::HashMap::new();
    for (id, e) in erx.iter() {
        match e {
            Event::Token { .. } => order.push(id),
            Event::Finished(g) => {
                results.insert(id, g.choices[0].tokens.clone());
                if results.len() == 2 {
                    break;
                }
            }
            Event::Failed(m) => panic!("request {id} failed: {m}"),
        }
    }
    tx.send(Command::Shutdown).unwrap();
    let (stats, live) = h.join().unwrap();
    assert_eq!(results[&21], alone(&model, &reg, &decoding));
    assert_eq!(
        results[&22],
        alone(&model, &reg, &long),
        "a prompt prefilled in chunks gives the tokens it gives whole"
    );
    // While the long prompt was prefilled (about 64 tokens a step), the other request went on
    // decoding a token a step: without chunks it would have waited for the whole prompt.
    let before_first_long = order.iter().take_while(|&&id| id != 22).count();
    assert!(
        before_first_long >= long.prompt.len() / 64 - 1,
        "only {before_first_long} decode tokens during the prefill: {order:?}"
    );
    assert_eq!((stats.failed, live), (0, 0));
}

#[test]
fn a_shared_prompt_arriving_twice_at_once_is_prefilled_once() {
    use inferd_engine::sched::monitor::Monitor;
    let model = Arc::new(Model::load(&inferd_e2e::default_model()).unwrap());
    let reg = registry();
    let p = |t: &str| model.tokenizer.encode(t, false).unwrap();
    let system = "You answer questions about lighthouses, briefly and politely. ".repeat(40);
    let a = Req {
        id: 31,
        strategy: "greedy",
        params: "{}",
        prompt: p(&format!("{system}Question: how tall are they?")),
        max_tokens: 4,
    };
    let b = Req {
        id: 32,
        strategy: "greedy",
        params: "{}",
        prompt: p(&format!("{system}Question: who keeps them?")),
        max_tokens: 4,
    };
    let shared = a.prompt.iter().zip(&b.prompt).take_while(|(x, y)| x == y).count();
    assert!(shared > 300, "{shared}");
    let monitor = Arc::new(Monitor::new("m"));
    let (tx, rx) = channel();
    let (m, mon) = (Arc::clone(&model), Arc::clone(&monitor));
    let h = std::thread::spawn(move || {
        let mut engine = Engine::cpu(&m, &EngineOptions { threads: 2, ..EngineOptions::default() }).unwrap();
        engine_loop(
            &mut EngineStore::new(&mut engine),
            &rx,
            &LoopConfig {
                token_budget: 64,
                max_running: 64,
                eos: m.tokenizer.eos().to_vec(),
                monitor: Some(mon),
                vocabulary: None,
                kv_release_after: None,
                prefix_sharing: Default::default(),
            },
        )
    });
    // Both in the queue before the loop takes its first command.
    let rxs: Vec<Receiver<Event>> = [&a, &b].iter().map(|r| submit(&tx, &reg, r)).collect();
    let results: Vec<_> = rxs.iter().map(collect).collect();
    tx.send(Command::Shutdown).unwrap();
    h.join().unwrap();
    assert_eq!(results[0].1.as_ref().unwrap(), &alone(&model, &reg, &a));
    assert_eq!(results[1].1.as_ref().unwrap(), &alone(&model, &reg, &b));
    // The second found the shared part in the cache: computed once, not twice.
    let s = monitor.snapshot();
    assert!(
        s.cached_prompt_tokens as usize >= shared / 16 * 16 - 16,
        "cached {} of a {shared}-token shared prefix",
        s.cached_prompt_tokens
    );
}

#[test]
fn submissions_that_meet_a_shutdown_are_told_so() {
    use inferd_engine::decode::store::MockStore;
    let reg = registry();
    let (tx, rx) = channel();
    let mut events = Vec::new();
    for id in [1, 2] {
        let (etx, erx) = channel();
        events.push(erx);
        let sub = Submission {
            id,
            strategy: reg.get("greedy").unwrap(),
            prompt: vec![1, 2],
            params: "{}".into(),
            max_tokens: 3,
            n: 1,
            seed: 0,
            logprobs: None,
            meta: Default::default(),
            events: channel_sink(etx),
            grammar: None,
            images: Vec::new(),
        };
        tx.send(Command::Submit(sub)).unwrap();
        if id == 1 {
            tx.send(Command::Shutdown).unwrap();
        }
    }
    drop(tx);
    let mut store = MockStore::new(8, Box::new(|_: &[u32]| vec![0.0; 8]));
    engine_loop(
        &mut store,
        &rx,
        &LoopConfig {
            token_budget: 64,
            max_running: 4,
            eos: Vec::new(),
            monitor: None,
            vocabulary: None,
            kv_release_after: None,
            prefix_sharing: Default::default(),
        },
    );
    for (i, erx) in events.iter().enumerate() {
        match erx.try_recv() {
            Ok(Event::Failed(m)) => assert!(m.contains("shutting down"), "request {i}: {m}"),
            other => panic!("request {i} got {other:?} instead of a failure"),
        }
    }
}

#[test]
fn a_request_sharing_a_prompt_waits_only_for_the_prefill_not_the_whole_generation() {
    let model = Arc::new(Model::load(&inferd_e2e::default_model()).unwrap());
    let reg = registry();
    let p = |t: &str| model.tokenizer.encode(t, false).unwrap();
    let system = "You answer questions about lighthouses, briefly and politely. ".repeat(40);
    // Beam search emits its tokens only at the end; the greedy request must not wait for that.
    let beam = Req {
        id: 41,
        strategy: "beam",
        params: r#"{"beam_width": 2}"#,
        prompt: p(&format!("{system}Question: how tall are they?")),
        max_tokens: 48,
    };
    let greedy = Req {
        id: 42,
        strategy: "greedy",
        params: "{}",
        prompt: p(&format!("{system}Question: who keeps them?")),
        max_tokens: 2,
    };
    let (tx, h) = start_with_budget(Arc::clone(&model), 2048, 256);
    let (etx, erx) = channel::<(u64, Event)>();
    for r in [&beam, &greedy] {
        let (etx, id) = (etx.clone(), r.id);
        let sub = Submission {
            id,
            strategy: reg.get(r.strategy).unwrap(),
            prompt: r.prompt.clone(),
            params: r.params.into(),
            max_tokens: r.max_tokens,
            n: 1,
            seed: 0,
            logprobs: None,
            meta: Default::default(),
            events: Box::new(move |e| etx.send((id, e)).is_ok()),
            grammar: None,
            images: Vec::new(),
        };
        tx.send(Command::Submit(sub)).unwrap();
    }
    drop(etx);
    let mut finished = Vec::new();
    for (id, e) in erx.iter() {
        match e {
            Event::Finished(_) => finished.push(id),
            Event::Failed(m) => panic!("request {id} failed: {m}"),
            Event::Token { .. } => {}
        }
        if finished.len() == 2 {
            break;
        }
    }
    tx.send(Command::Shutdown).unwrap();
    let (stats, live) = h.join().unwrap();
    assert_eq!(finished, [42, 41], "the greedy request finished while the beam search ran");
    assert_eq!((stats.failed, live), (0, 0));
}

#[test]
fn several_choices_and_beams_in_a_small_cache_all_succeed_and_leave_the_cache_clean() {
    // The stress of issue 10 scaled to this machine: requests with four choices (greedy and
    // seeded sampling) and beam searches in a cache of 20 blocks, where each fits alone but
    // only about two fit together. Before, most failed with "preempted", some came back wrong
    // and the wrong blocks entered the prefix cache. Now every answer equals the request run
    // alone, and afterwards the same engine answers each request alone as a fresh one does.
    let model = Arc::new(Model::load(&inferd_e2e::default_model()).unwrap());
    let reg = registry();
    let prompts = [
        "The capital of France is",
        "Ten facts about the moon:",
        "A long story about a dragon:",
        "How to bake bread:",
        "My favourite colour is",
        "The weather today is",
    ];
    // (id, strategy, params, prompt, n)
    let mut reqs: Vec<(u64, &str, &str, Vec<u32>, u32)> = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let ids = model.tokenizer.encode(p, false).unwrap();
        let id = 100 + i as u64;
        match i % 3 {
            0 => reqs.push((id, "greedy", "{}", ids, 4)),
            1 => reqs.push((id, "nucleus", r#"{"temperature": 0.9}"#, ids, 4)),
            _ => reqs.push((id, "beam", r#"{"beam_width": 4}"#, ids, 1)),
        }
    }
    let max_tokens = 20;
    let run_alone = |engine: &mut Engine, (id, strategy, params, prompt, n): &(u64, &str, &str, Vec<u32>, u32)| {
        let req = SessionRequest {
            prompt,
            generated: &[],
            params,
            max_tokens,
            n: *n,
            seed: *id,
            eos: model.tokenizer.eos(),
            logprobs: None,
            vocabulary: None,
            grammar: None,
        };
        let choices =
            generate(&reg.get(strategy).unwrap(), &mut EngineStore::new(engine), &req, &mut |_, _| {}).unwrap();
        choices.into_iter().map(|c| c.tokens).collect::<Vec<_>>()
    };
    let mut fresh = Engine::cpu(&model, &EngineOptions { threads: 2, ..EngineOptions::default() }).unwrap();
    let want: Vec<Vec<Vec<u32>>> = reqs.iter().map(|r| run_alone(&mut fresh, r)).collect();

    let (tx, rx) = channel();
    let m = Arc::clone(&model);
    let h = std::thread::spawn(move || {
        let bytes = 20 * inferd_engine::backend::cpu::kv_block_bytes(&m.config, 16);
        let mut engine =
            Engine::cpu(&m, &EngineOptions { threads: 2, kv_budget_bytes: bytes, ..EngineOptions::default() }).unwrap();
        let cfg = LoopConfig {
            token_budget: 256,
            max_running: 64,
            eos: m.tokenizer.eos().to_vec(),
            monitor: None,
            vocabulary: None,
            kv_release_after: None,
            prefix_sharing: Default::default(),
        };
        let stats = engine_loop(&mut EngineStore::new(&mut engine), &rx, &cfg);
        (stats, engine)
    });
    let rxs: Vec<Receiver<Event>> = reqs
        .iter()
        .map(|(id, strategy, params, prompt, n)| {
            let (etx, erx) = channel();
            let sub = Submission {
                id: *id,
                strategy: reg.get(strategy).unwrap(),
                prompt: prompt.clone(),
                params: (*params).into(),
                max_tokens,
                n: *n,
                seed: *id,
                logprobs: None,
                meta: Default::default(),
                events: channel_sink(etx),
                grammar: None,
                images: Vec::new(),
            };
            tx.send(Command::Submit(sub)).unwrap();
            erx
        })
        .collect();
    for ((r, rx), want) in reqs.iter().zip(&rxs).zip(&want) {
        let mut streamed: Vec<Vec<u32>> = vec![Vec::new(); r.4 as usize];
        let got = loop {
            match rx.recv().unwrap() {
                Event::Token { choice, token, .. } => streamed[choice as usize].push(token),
                Event::Finished(g) => break g.choices.into_iter().map(|c| c.tokens).collect::<Vec<_>>(),
                Event::Failed(m) => panic!("request {} ({}) failed: {m}", r.0, r.1),
            }
        };
        assert_eq!(&got, want, "request {} ({}): under pressure vs alone", r.0, r.1);
        assert_eq!(streamed, got, "request {}: the stream is the answer", r.0);
    }
    tx.send(Command::Shutdown).unwrap();
    let (stats, mut engine) = h.join().unwrap();
    assert!(stats.preempted > 0, "the cache was too small for all: {stats:?}");
    assert_eq!((stats.failed, stats.finished), (0, reqs.len() as u64), "{stats:?}");
    assert_eq!(engine.kv.sequences(), 0);
    // What the stress left in the prefix cache is right: the same engine answers as a fresh one.
    for (r, want) in reqs.iter().zip(&want) {
        assert_eq!(&run_alone(&mut engine, r), want, "request {} alone after the stress", r.0);
    }
}

/// Embeddings run as work of the steps, in chunks beside a request decoding (once they were
/// a blocking call between steps that held every completion for the whole job): the vectors
/// are bit-for-bit those of each text alone (`Engine::embed`, checked against llama.cpp in
/// embed.rs), the request gets the tokens it gets alone and keeps streaming while the texts
/// run, and a job cancelled in the middle of a text gives its blocks back at the next step.
#[test]
fn embeddings_run_in_the_steps_beside_decoding_and_are_cancelled_like_requests() {
    use inferd_engine::sched::{Embedding, RequestMeta};
    let model = Arc::new(Model::load(&inferd_e2e::default_model()).unwrap());
    let reg = registry();
    let p = |t: &str| model.tokenizer.encode(t, false).unwrap();
    let texts: Vec<Vec<u32>> = vec![
        p("Hello"),
        p(&"The lighthouse keeper climbed the stairs every night. ".repeat(40)),
        p("The cat sat on the mat."),
    ];
    assert!(texts[1].len() > 64 * 4, "the long text runs in several chunks");
    let alone_vectors: Vec<Vec<f32>> = {
        let mut e = Engine::cpu(&model, &EngineOptions { threads: 2, ..EngineOptions::default() }).unwrap();
        texts.iter().map(|t| e.embed(t).unwrap()).collect()
    };
    let (tx, h) = start_with_budget(Arc::clone(&model), 512, 64);
    let r = Req { id: 1, strategy: "greedy", params: "{}", prompt: p("A long story about a dragon:"), max_tokens: 40 };
    let rx = submit(&tx, &reg, &r);
    assert!(matches!(rx.recv().unwrap(), Event::Token { .. }));
    let embed = |id: u64, inputs: Vec<Vec<u32>>| {
        let (etx, erx) = channel();
        let reply = Box::new(move |v| {
            let _ = etx.send(v);
        });
        tx.send(Command::Embed(Embedding { id, meta: RequestMeta::default(), inputs, reply })).unwrap();
        erx
    };
    let job = embed(2, texts.clone());
    // Tokens keep coming while the job runs.
    let (mut streamed, mut during) = (1, 0);
    let vectors = loop {
        if let Ok(v) = job.try_recv() {
            break v.unwrap();
        }
        match rx.recv_timeout(std::time::Duration::from_secs(30)).expect("the request kept streaming") {
            Event::Token { .. } => {
                streamed += 1;
                during += 1;
            }
            e => panic!("the request ended before the embedding: {e:?}"),
        }
    };
    assert!(during >= 2, "only {during} tokens streamed while the texts ran");
    assert_eq!(vectors, alone_vectors, "embedded in chunks beside a decode, not as alone");
    let (rest, done) = collect(&rx);
    assert_eq!(streamed + rest.len(), 40);
    assert_eq!(done.unwrap(), alone(&model, &reg, &r));
    // A job of long texts cancelled once it has started.
    let long: Vec<Vec<u32>> = (0..4).map(|_| texts[1].clone()).collect();
    let cancelled = embed(3, long);
    std::thread::sleep(std::time::Duration::from_millis(200));
    tx.send(Command::Cancel(3)).unwrap();
    assert_eq!(cancelled.recv().unwrap(), Err("cancelled".to_string()));
    tx.send(Command::Shutdown).unwrap();
    let (stats, live) = h.join().unwrap();
    assert_eq!((stats.finished, stats.cancelled, stats.failed), (2, 1, 0));
    assert_eq!(live, 0, "every text's sequence was freed");
}
