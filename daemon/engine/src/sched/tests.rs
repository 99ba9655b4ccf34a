//! The scheduler on its own, over a mock model with a bounded cache (`MockStore::with_blocks`)
//! and the in-process test strategies: scenario tables for admission by blocks, fairness and
//! priorities, chunked prefill, preemption and recompute, the shared-prefix wait and a cancel
//! or stop arriving in every state.

use super::budget::MIN_CHUNK;
use super::*;
use crate::decode::generate;
use crate::decode::store::MockStore;
use crate::plugin::{Registry, SessionRequest};
use std::collections::HashMap;
use std::sync::mpsc::{channel, Receiver, Sender};

const EOS: u32 = 7;

/// A model over 8 tokens whose next token is `last % 6 + 1`: it never says end-of-sequence.
fn model() -> MockStore {
    MockStore::new(
        8,
        Box::new(|p: &[u32]| {
            let next = p.last().map_or(1, |t| t % 6 + 1);
            (0..8).map(|t| if t == next { 5.0 } else { 0.0 }).collect()
        }),
    )
}

/// A prompt of `len` tokens; different `salt`s (1 to 6) share no prefix.
fn prompt(salt: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| (i * 5 + salt) % 6 + 1).collect()
}

#[derive(Clone)]
struct Spec {
    id: RequestId,
    strategy: &'static str,
    prompt: Vec<u32>,
    max_tokens: u32,
    n: u32,
    uid: u32,
    priority: Priority,
    /// An image at the prompt's start: a one-pixel image of this red value.
    image: Option<u8>,
}

fn spec(id: RequestId, strategy: &'static str, prompt: Vec<u32>, max_tokens: u32, n: u32) -> Spec {
    Spec { id, strategy, prompt, max_tokens, n, uid: 0, priority: Priority::Interactive, image: None }
}

/// The one-pixel image [`Spec::image`] names.
fn pixel(red: u8) -> std::sync::Arc<crate::vision::RgbImage> {
    std::sync::Arc::new(crate::vision::RgbImage { width: 1, height: 1, pixels: vec![red, 0, 0] })
}

/// What a request's client heard.
#[derive(Debug, Default)]
struct Heard {
    tokens: Vec<Vec<u32>>,
    end: Vec<Result<Generation, String>>,
}

struct Harness {
    sched: Scheduler,
    store: MockStore,
    reg: Registry,
    tx: Sender<(RequestId, Event)>,
    rx: Receiver<(RequestId, Event)>,
    heard: HashMap<RequestId, Heard>,
    steps: Vec<StepOutput>,
}

impl Harness {
    fn new(blocks: usize, block_size: usize, token_budget: usize, max_running: usize) -> Self {
        let (tx, rx) = channel();
        Harness {
            sched: Scheduler::new(LoopConfig {
                token_budget,
                max_running,
                eos: vec![EOS],
                monitor: None,
                vocabulary: None,
                kv_release_after: None,
                prefix_sharing: Default::default(),
            }),
            store: model().with_blocks(blocks, block_size),
            reg: crate::plugin::tests::registry(),
            tx,
            rx,
            heard: HashMap::new(),
            steps: Vec::new(),
        }
    }

    fn submit(&mut self, s: &Spec) {
        let tx = self.tx.clone();
        let id = s.id;
        let sub = Submission {
            id,
            strategy: self.reg.get(s.strategy).unwrap(),
            prompt: s.prompt.clone(),
            params: "{}".into(),
            max_tokens: s.max_tokens,
            n: s.n,
            seed: 1000 + id,
            logprobs: None,
            grammar: None,
            meta: RequestMeta { uid: s.uid, priority: s.priority, ..Default::default() },
            events: Box::new(move |e| tx.send((id, e)).is_ok()),
            images: (s.image.iter())
                .map(|&red| crate::vision::media::PromptImage { at: 0, image: pixel(red), media: None })
                .collect(),
        };
        self.sched.handle(Command::Submit(sub), &mut self.store);
    }

    fn command(&mut self, c: Command) {
        self.sched.handle(c, &mut self.store);
    }

    fn step(&mut self) -> StepOutput {
        let out = self.sched.step(&mut self.store);
        for (id, e) in self.rx.try_iter() {
            let h = self.heard.entry(id).or_default();
            match e {
                Event::Token { choice, token, .. } => {
                    if h.tokens.len() <= choice as usize {
                        h.tokens.resize(choice as usize + 1, Vec::new());
                    }
                    h.tokens[choice as usize].push(token);
                }
                Event::Finished(g) => h.end.push(Ok(g)),
                Event::Failed(m) => h.end.push(Err(m)),
            }
        }
        self.steps.push(out.clone());
        out
    }

    fn run_until_idle(&mut self) {
        for _ in 0..10_000 {
            if self.sched.is_idle() {
                return;
            }
            self.step();
        }
        panic!("the scheduler did not finish its work");
    }

    /// The step (index) in which `id` did something `what` says.
    fn first_step(&self, what: impl Fn(&StepOutput) -> bool) -> Option<usize> {
        self.steps.iter().position(what)
    }

    /// Every sequence freed, no block or image held.
    fn assert_clean(&self) {
        assert_eq!(self.store.live(), 0, "sequences leaked");
        assert_eq!(self.store.blocks_used(), 0, "blocks leaked");
        assert!(self.store.images_held.is_empty(), "images leaked: {:?}", self.store.images_held);
    }
}

/// The choices `s` gets alone, with nothing else running and room to spare.
fn alone(reg: &Registry, s: &Spec) -> Vec<Vec<u32>> {
    let req = SessionRequest {
        prompt: &s.prompt,
        generated: &[],
        params: "{}",
        max_tokens: s.max_tokens,
        n: s.n,
        seed: 1000 + s.id,
        eos: &[EOS],
        logprobs: None,
        vocabulary: None,
        grammar: None,
    };
    generate(&reg.get(s.strategy).unwrap(), &mut model(), &req, &mut |_, _| {})
        .unwrap()
        .into_iter()
        .map(|c| c.tokens)
        .collect()
}

/// `id` finished once, with the choices it gets alone, and streamed exactly those tokens.
fn assert_finished_as_alone(h: &Harness, s: &Spec) {
    let heard = &h.heard[&s.id];
    assert_eq!(heard.end.len(), 1, "request {} ended {} times", s.id, heard.end.len());
    let g = heard.end[0].as_ref().unwrap_or_else(|e| panic!("request {} failed: {e}", s.id));
    let got: Vec<Vec<u32>> = g.choices.iter().map(|c| c.tokens.clone()).collect();
    assert_eq!(got, alone(&h.reg, s), "request {}: choices differ from the request alone", s.id);
    assert_eq!(heard.tokens, got, "request {}: the stream is not the answer (a token sent twice or lost)", s.id);
}

#[test]
fn admission_by_blocks() {
    // (cache blocks, prompt lengths, admitted in the first step, failed in it). Blocks of 4
    // tokens; a prompt needs its tokens plus one, and each running request keeps one block of
    // growth.
    type Row = (usize, &'static [usize], &'static [RequestId], &'static [RequestId]);
    let table: &[Row] = &[
        (64, &[20, 20, 20], &[1, 2, 3], &[]),
        (6, &[20, 20], &[1], &[]),
        (10, &[20, 20], &[1, 2], &[]),
        // Larger than the whole cache: fails at admission, the next one goes on.
        (10, &[60, 8], &[2], &[1]),
    ];
    for &(blocks, lens, admitted, failed) in table {
        let mut h = Harness::new(blocks, 4, 512, 64);
        let specs: Vec<Spec> = lens
            .iter()
            .enumerate()
            .map(|(i, &l)| spec(i as u64 + 1, "test-top1", prompt(i as u32 + 1, l), 4, 1))
            .collect();
        specs.iter().for_each(|s| h.submit(s));
        let out = h.step();
        assert_eq!(out.admitted, admitted, "{blocks} blocks, prompts {lens:?}");
        let f: Vec<RequestId> =
            out.retired.iter().filter(|(_, o)| matches!(o, Outcome::Failed(_))).map(|(id, _)| *id).collect();
        assert_eq!(f, failed, "{blocks} blocks, prompts {lens:?}");
        h.run_until_idle();
        for s in specs.iter().filter(|s| !failed.contains(&s.id)) {
            assert_finished_as_alone(&h, s);
        }
        h.assert_clean();
    }
}

#[test]
fn users_take_turns_and_priority_classes_go_in_order() {
    use Priority::{Background as Bg, Interactive as It};
    // (uid, priority) in submission order -> the order of first tokens, one request at a time.
    type Row = (&'static [(u32, Priority)], &'static [RequestId]);
    let table: &[Row] = &[
        (&[(1, It), (1, It), (1, It), (1, It), (3, Bg), (2, It), (2, It)], &[1, 6, 2, 7, 3, 4, 5]),
        (&[(7, It), (7, It), (7, Bg), (7, It)], &[1, 2, 4, 3]),
        // User 1's interactive request first; then user 2, who has not had a turn yet.
        (&[(1, Bg), (2, Bg), (1, It)], &[3, 2, 1]),
    ];
    for &(reqs, want) in table {
        let mut h = Harness::new(256, 4, 512, 1);
        for (i, &(uid, priority)) in reqs.iter().enumerate() {
            let s = Spec { uid, priority, ..spec(i as u64 + 1, "test-top1", prompt(1, 4), 2, 1) };
            h.submit(&s);
        }
        h.run_until_idle();
        let order: Vec<RequestId> = h.steps.iter().flat_map(|s| s.admitted.clone()).collect();
        assert_eq!(order, want, "{reqs:?}");
        h.assert_clean();
    }
}

#[test]
fn preemption_recomputes_every_strategy_and_n_without_failing_or_repeating() {
    // Two requests that each fit the cache alone but not together: the newer one is preempted
    // and recomputed (one choice continues from its streamed tokens; several are replayed
    // from the prompt with the same seed). Nobody fails, every answer equals the request
    // alone, and every client's stream is exactly its answer.
    for (strategy, n, blocks) in [("test-top1", 1, 8), ("test-draw", 1, 8), ("test-top1", 4, 24), ("test-draw", 4, 24)]
    {
        let mut h = Harness::new(blocks, 4, 512, 64);
        let specs = [spec(1, strategy, prompt(1, 8), 12, n), spec(2, strategy, prompt(2, 8), 12, n)];
        specs.iter().for_each(|s| h.submit(s));
        h.run_until_idle();
        let ctx = format!("{strategy}, n = {n}");
        assert!(h.sched.stats().preempted >= 1, "{ctx}: nothing was preempted");
        assert_eq!(h.sched.stats().failed, 0, "{ctx}");
        assert_eq!(h.sched.stats().finished, 2, "{ctx}");
        specs.iter().for_each(|s| assert_finished_as_alone(&h, s));
        h.assert_clean();
    }
}

#[test]
fn a_request_that_cannot_fit_even_alone_fails_and_frees_its_blocks() {
    // The prompt fits, but four choices of 24 tokens do not: alone and still out of blocks.
    let mut h = Harness::new(12, 4, 512, 64);
    h.submit(&spec(1, "test-top1", prompt(1, 8), 24, 4));
    h.run_until_idle();
    let end = &h.heard[&1].end;
    assert!(matches!(&end[..], [Err(m)] if m.contains("does not fit")), "{end:?}");
    h.assert_clean();
}

#[test]
fn a_short_request_behind_a_long_prompt_answers_within_a_few_steps() {
    // Budget 64: the long prompt takes 32 steps alone. The short request arrives after the
    // first step; it is prefilled whole in the next one, ahead of the long prompt, and while
    // it decodes the long prompt's chunks shrink to a quarter of the budget.
    let mut h = Harness::new(4096, 16, 64, 64);
    let long = spec(1, "test-top1", prompt(1, 2000), 4, 1);
    let short = spec(2, "test-top1", prompt(2, 8), 4, 1);
    h.submit(&long);
    let first = h.step();
    assert_eq!(first.chunks, vec![(1, 64)], "alone, a long prompt takes the whole budget");
    h.submit(&short);
    let arrived = h.steps.len();
    h.run_until_idle();
    let token = |id| h.first_step(|s| s.planned.iter().any(|p| p.0 == id)).unwrap();
    let done = |id| h.first_step(|s| s.retired.iter().any(|r| r.0 == id)).unwrap();
    assert!(token(2) - arrived <= 1, "the short prompt waited {} steps", token(2) - arrived);
    assert!(done(2) - arrived <= 5, "the short request took {} steps", done(2) - arrived);
    assert!(done(2) < token(1), "the short request finished before the long prompt's first token");
    // (Its own prefill step is not decoding yet: the long prompt may use the rest then.)
    for s in &h.steps[token(2) + 1..done(2)] {
        let chunk: usize = s.chunks.iter().map(|c| c.1).sum();
        assert!(chunk <= 16, "a chunk of {chunk} tokens while another request decoded");
    }
    assert_finished_as_alone(&h, &long);
    assert_finished_as_alone(&h, &short);
    h.assert_clean();
}

#[test]
fn a_prompt_sharing_a_long_prefix_waits_for_its_prefill_only() {
    // b shares 200 tokens with a, which is prefilled in chunks: b is admitted once a's prompt
    // has run (then the prefix cache would have it), not before and not after a finishes.
    let mut h = Harness::new(4096, 16, 64, 64);
    let shared = prompt(1, 200);
    let a = spec(1, "test-top1", [shared.clone(), vec![1, 2]].concat(), 8, 1);
    let b = spec(2, "test-top1", [shared, vec![3, 4]].concat(), 8, 1);
    h.submit(&a);
    h.submit(&b);
    h.run_until_idle();
    let a_ran = h.first_step(|s| s.planned.iter().any(|p| p.0 == 1)).unwrap();
    let b_in = h.first_step(|s| s.admitted.contains(&2)).unwrap();
    let a_done = h.first_step(|s| s.retired.iter().any(|r| r.0 == 1)).unwrap();
    assert!(b_in > a_ran && b_in < a_done, "a's prompt ran in step {a_ran}, b came in {b_in}, a left in {a_done}");
    assert_finished_as_alone(&h, &a);
    assert_finished_as_alone(&h, &b);
    h.assert_clean();
}

/// Steps `h` until some request is in `state`; returns it.
fn reach(h: &mut Harness, state: RequestState) -> RequestId {
    for _ in 0..200 {
        if let Some(&(id, _)) = h.sched.requests().iter().find(|r| r.1 == state) {
            return id;
        }
        h.step();
    }
    panic!("never reached {state:?}");
}

#[test]
fn a_cancel_or_stop_arriving_in_every_state_ends_that_request_alone() {
    for state in [RequestState::Waiting, RequestState::Prefilling, RequestState::Decoding, RequestState::Preempted] {
        for stop in [false, true] {
            // Two long generations that do not fit together (preemption), a long prompt
            // (chunked prefill) and a third request waiting behind max_running.
            let mut h = Harness::new(40, 4, 32, 2);
            let specs = [
                spec(1, "test-draw", prompt(1, 100), 40, 1),
                spec(2, "test-top1", prompt(2, 8), 40, 2),
                spec(3, "test-top1", prompt(3, 8), 6, 1),
            ];
            specs.iter().for_each(|s| h.submit(s));
            let target = reach(&mut h, state);
            let sent_before = h.heard.get(&target).map(|x| x.tokens.clone()).unwrap_or_default();
            h.command(if stop { Command::Stop(target) } else { Command::Cancel(target) });
            h.run_until_idle();
            let ctx = format!("{} in state {state:?} (request {target})", if stop { "stop" } else { "cancel" });
            let heard = &h.heard[&target];
            assert_eq!(heard.end.len(), 1, "{ctx}: told {} times", heard.end.len());
            match (&heard.end[0], stop) {
                (Err(m), false) => assert_eq!(m, "cancelled", "{ctx}"),
                (Ok(g), true) => {
                    // It ends with what its client had, and nothing is sent after the stop.
                    let got: Vec<Vec<u32>> = g.choices.iter().map(|c| c.tokens.clone()).collect();
                    assert_eq!(heard.tokens, sent_before, "{ctx}: tokens after the stop");
                    let sent: Vec<&Vec<u32>> = heard.tokens.iter().filter(|t| !t.is_empty()).collect();
                    assert_eq!(got.iter().filter(|t| !t.is_empty()).collect::<Vec<_>>(), sent, "{ctx}");
                }
                (end, _) => panic!("{ctx}: ended with {end:?}"),
            }
            for s in specs.iter().filter(|s| s.id != target) {
                assert_finished_as_alone(&h, s);
            }
            let st = h.sched.stats();
            assert_eq!((st.cancelled, st.failed), (u64::from(!stop), 0), "{ctx}");
            h.assert_clean();
        }
    }
}

#[test]
fn plans_that_wait_for_room_run_within_a_few_steps_and_no_step_overruns_its_budget() {
    // A budget of 16 tokens against prompts of 5 to 40 tokens and their decodes: plans are
    // chunked or deferred, none starves, no step runs more than the budget (plus the oldest
    // prompt's minimum chunk), and every answer is the request's alone.
    let mut h = Harness::new(1024, 4, 16, 64);
    let lens = [40, 5, 12, 30, 7, 20];
    let specs: Vec<Spec> = lens
        .iter()
        .enumerate()
        .map(|(i, &l)| spec(i as u64 + 1, "test-top1", prompt(i as u32 % 6 + 1, l), 4, 1))
        .collect();
    specs.iter().for_each(|s| h.submit(s));
    h.run_until_idle();
    // Requests that were running but got nothing in a step: the budget deferred them.
    let (mut running, mut deferred) = (std::collections::BTreeSet::new(), 0);
    for (n, s) in h.steps.iter().enumerate() {
        let planned: usize = s.planned.iter().map(|p| p.1).sum();
        let chunked: usize = s.chunks.iter().map(|c| c.1).sum();
        // A decode plan that waited once runs whatever its size: at most one token each here.
        assert!(planned + chunked <= 16 + MIN_CHUNK + specs.len(), "step {n} ran {planned} + {chunked} tokens");
        running.extend(s.admitted.iter().copied());
        let ran: std::collections::BTreeSet<RequestId> = s.planned.iter().chain(&s.chunks).map(|p| p.0).collect();
        // (A request that finished this step planned nothing: it is not waiting.)
        for (id, _) in &s.retired {
            running.remove(id);
        }
        deferred += running.iter().filter(|id| !ran.contains(id)).count();
    }
    assert!(deferred > 0, "the budget never made a plan wait: the test does not test deferral");
    for s in &specs {
        let first = h.first_step(|o| o.planned.iter().any(|p| p.0 == s.id)).unwrap();
        assert!(first <= 12, "request {} first ran whole in step {first}", s.id);
        assert_finished_as_alone(&h, s);
    }
    h.assert_clean();
}

#[test]
fn admission_counts_choices_not_requests() {
    // 30 blocks of 4 tokens (the mock's forks copy their blocks: four choices of 22 tokens
    // hold 24). A 20-token prompt with four choices needs 6 blocks and 3 more for its other
    // choices' first tokens; then a 104-token prompt needs 27, plus a block of growth for each
    // of the four running choices: 31 > 30, so it waits for the first to finish. (Counting the
    // running request as one block of growth would have admitted it, to be preempted.)
    let mut h = Harness::new(30, 4, 512, 64);
    let wide = spec(1, "test-top1", prompt(1, 20), 2, 4);
    let next = spec(2, "test-top1", prompt(2, 104), 2, 1);
    h.submit(&wide);
    h.submit(&next);
    assert_eq!(h.step().admitted, vec![1]);
    h.run_until_idle();
    assert_finished_as_alone(&h, &wide);
    assert_finished_as_alone(&h, &next);
    assert_eq!(h.sched.stats().preempted, 0);
    h.assert_clean();
}

/// What an embedding job's client heard, through a channel the harness can read.
type EmbedHeard = Receiver<Result<Vec<Vec<f32>>, String>>;

impl Harness {
    fn embed(&mut self, id: RequestId, inputs: Vec<Vec<u32>>) -> EmbedHeard {
        let (tx, rx) = channel();
        let reply = Box::new(move |r| {
            let _ = tx.send(r);
        });
        self.command(Command::Embed(Embedding { id, meta: RequestMeta::default(), inputs, reply }));
        rx
    }
}

/// The mock's vector of a text: its length and the sum of its tokens.
fn mock_vector(t: &[u32]) -> Vec<f32> {
    vec![t.len() as f32, t.iter().sum::<u32>() as f32]
}

#[test]
fn embeddings_run_in_the_steps_beside_decoding_requests() {
    // A request decoding, then three long texts to embed: every step decodes, and the texts
    // run in chunks within the step's budget (once a blocking call held every completion for
    // the whole job).
    let mut h = Harness::new(1024, 4, 64, 64);
    let s = spec(1, "test-top1", prompt(1, 8), 60, 1);
    h.submit(&s);
    h.step();
    let texts: Vec<Vec<u32>> = (0..3).map(|i| prompt(i + 2, 300)).collect();
    let heard = h.embed(2, texts.clone());
    let (mut steps, mut job_over) = (0, false);
    while !job_over {
        let out = h.step();
        steps += 1;
        let embedded: usize = out.embedded.iter().map(|e| e.1).sum();
        assert!(out.planned.iter().any(|p| p.0 == 1), "step {steps}: the request did not decode: {out:?}");
        let decoded: usize = out.planned.iter().map(|p| p.1).sum();
        assert!(embedded + decoded <= 64, "step {steps}: {embedded} embedding tokens beside {decoded}");
        assert!(embedded > 0, "step {steps}: the embedding waited: {out:?}");
        job_over = out.retired.iter().any(|r| r.0 == 2);
    }
    assert!(h.heard[&1].end.is_empty(), "the request ended before the embedding");
    h.run_until_idle();
    assert_finished_as_alone(&h, &s);
    let vectors = heard.try_recv().expect("the embedding answered").unwrap();
    assert_eq!(vectors, texts.iter().map(|t| mock_vector(t)).collect::<Vec<_>>());
    // Alone, the job takes the whole budget, and short texts share steps.
    let many: Vec<Vec<u32>> = (0..100).map(|i| prompt(i % 6 + 1, 5)).collect();
    let heard = h.embed(3, many.clone());
    let before = h.steps.len();
    h.run_until_idle();
    assert!(h.steps.len() - before <= 500usize.div_ceil(64) + 1, "{} steps for 500 tokens", h.steps.len() - before);
    assert_eq!(heard.try_recv().unwrap().unwrap(), many.iter().map(|t| mock_vector(t)).collect::<Vec<_>>());
    assert_eq!(h.sched.stats().finished, 3);
    h.assert_clean();
}

#[test]
fn an_embedding_leaves_at_the_next_step_when_cancelled_failed_or_shut_down() {
    let mut h = Harness::new(1024, 4, 64, 64);
    // Cancelled in the middle of its first text.
    let heard = h.embed(1, vec![prompt(1, 1000), prompt(2, 1000)]);
    h.step();
    h.step();
    assert!(h.store.blocks_used() > 0);
    h.command(Command::Cancel(1));
    let out = h.step();
    assert_eq!(out.retired, vec![(1, Outcome::Cancelled)]);
    assert_eq!(heard.try_recv().unwrap(), Err("cancelled".to_string()));
    h.assert_clean();
    // A text larger than the whole cache fails alone; the next job runs.
    let mut h = Harness::new(8, 4, 64, 64);
    let big = h.embed(1, vec![prompt(1, 5), prompt(1, 100)]);
    let small = h.embed(2, vec![prompt(2, 10)]);
    h.run_until_idle();
    let why = big.try_recv().unwrap().unwrap_err();
    assert!(why.contains("input 1 needs 25 KV blocks"), "{why}");
    assert_eq!(small.try_recv().unwrap().unwrap(), vec![mock_vector(&prompt(2, 10))]);
    h.assert_clean();
    // Shut down mid-job, and one arriving with the shutdown.
    let mut h = Harness::new(1024, 4, 64, 64);
    let running = h.embed(1, vec![prompt(1, 1000)]);
    h.step();
    let (tx, late) = channel();
    let reply = Box::new(move |r| {
        let _ = tx.send(r);
    });
    let cmd = Command::Embed(Embedding { id: 2, meta: RequestMeta::default(), inputs: vec![vec![1]], reply });
    h.sched.shutdown(&mut h.store, vec![cmd]);
    for heard in [running, late] {
        assert_eq!(heard.try_recv().unwrap(), Err("the daemon is shutting down".to_string()));
    }
    h.assert_clean();
}

#[test]
fn a_request_waits_for_its_images_while_the_others_run() {
    use crate::vision::media::pixel_hash;
    let mut h = Harness::new(1024, 4, 64, 64);
    // Image 1 still encoding, image 2 failed, image 3 ready; a text request behind them all.
    h.store.encoding.insert(pixel_hash(&pixel(1)), Ok(()));
    h.store.encoding.insert(pixel_hash(&pixel(2)), Err("the vision encoder failed on this image".into()));
    let specs = [
        Spec { image: Some(1), ..spec(1, "test-top1", prompt(1, 8), 6, 1) },
        Spec { image: Some(2), ..spec(2, "test-top1", prompt(2, 8), 6, 1) },
        Spec { image: Some(3), ..spec(3, "test-top1", prompt(3, 8), 6, 1) },
        spec(4, "test-top1", prompt(4, 8), 6, 1),
    ];
    for s in &specs {
        h.submit(s);
    }
    assert!(!h.sched.stalled(), "nothing has been looked at yet");
    let out = h.step();
    assert_eq!(out.admitted, vec![3, 4], "the ready ones, in order");
    assert!(out.retired.iter().any(|r| matches!(&r.1, Outcome::Failed(w) if w.contains("encoder failed"))), "{out:?}");
    assert_eq!(h.heard[&2].end, vec![Err("the vision encoder failed on this image".to_string())]);
    // Request 1 waits, without holding up the others: they finish while its image encodes.
    while h.sched.running() > 0 {
        h.step();
    }
    assert_finished_as_alone(&h, &specs[2]);
    assert_finished_as_alone(&h, &specs[3]);
    assert!(h.heard.get(&1).is_none_or(|x| x.tokens.is_empty() && x.end.is_empty()));
    assert_eq!(h.sched.requests(), vec![(1, RequestState::Waiting)]);
    assert!(h.sched.stalled(), "only a request waiting for its image: the loop waits for the encoder");
    // Encoded: admitted at the next step, answered as alone.
    h.store.encoding.clear();
    let out = h.step();
    assert_eq!(out.admitted, vec![1]);
    assert!(!h.sched.stalled());
    h.run_until_idle();
    assert_finished_as_alone(&h, &specs[0]);
    h.assert_clean();
    // Cancelled while its image encodes: it leaves at once and lets go of the image.
    h.store.encoding.insert(pixel_hash(&pixel(1)), Ok(()));
    h.submit(&specs[0]);
    h.step();
    assert!(!h.store.images_held.is_empty());
    h.command(Command::Cancel(1));
    h.step();
    assert_eq!(h.heard[&1].end[1..], [Err("cancelled".to_string())]);
    h.assert_clean();
}
