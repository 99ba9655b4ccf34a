//! Tiny random-weight models written by the tests: formats agree, batching and prefix caching
//! do not change results, KV blocks are never leaked.

use inferd_e2e::{temp_dir, write_tiny_gguf, write_tiny_hf, TinySpec};
use inferd_engine::engine::{argmax, Engine, EngineError, EngineOptions, RunItem};
use inferd_engine::kv::OutOfBlocks;
use inferd_engine::model::Model;
use inferd_kernels::DType;

fn opts() -> EngineOptions {
    EngineOptions { kv_budget_bytes: 8 << 20, block_size: 4, prefill_chunk: 7, threads: 2, pool: None }
}

fn prompt(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| 3 + (i * 31 + salt * 17) % 250).collect()
}

fn last_logits(model: &Model, p: &[u32]) -> Vec<f32> {
    let mut e = Engine::cpu(model, &opts()).unwrap();
    let (s, l) = e.prefill(&[p]).unwrap().remove(0);
    e.release(s);
    l
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

#[test]
fn gguf_and_safetensors_of_the_same_weights_agree() {
    // The GGUF file stores Q/K permuted for interleaved RoPE, the HF one in rotate-half layout:
    // equal logits prove both loaders and both RoPE styles.
    let dir = temp_dir("formats");
    let spec = TinySpec::default();
    let g = Model::load(&write_tiny_gguf(&dir.join("m.gguf"), &spec, DType::F32, DType::F32)).unwrap();
    let h = Model::load(&write_tiny_hf(&dir.join("hf"), &spec, safetensors::Dtype::F32)).unwrap();
    assert_eq!(g.config.rope_style, inferd_kernels::ops::RopeStyle::Interleaved);
    assert_eq!(h.config.rope_style, inferd_kernels::ops::RopeStyle::Neox);
    let p = prompt(19, 1);
    let (lg, lh) = (last_logits(&g, &p), last_logits(&h, &p));
    assert!(max_diff(&lg, &lh) < 1e-3, "GGUF vs safetensors: {}", max_diff(&lg, &lh));
    // The tokenizers agree too.
    let text = "the 123 then\n  inner <|im_start|>";
    for special in [false, true] {
        assert_eq!(g.tokenizer.encode(text, special).unwrap(), h.tokenizer.encode(text, special).unwrap());
    }
}

#[test]
fn every_weight_type_loads_and_tracks_the_f32_model() {
    let dir = temp_dir("dtypes");
    let spec = TinySpec::default();
    let reference = Model::load(&write_tiny_gguf(&dir.join("f32.gguf"), &spec, DType::F32, DType::F32)).unwrap();
    let p = prompt(9, 2);
    let want = last_logits(&reference, &p);
    let scale = want.iter().fold(0f32, |a, v| a.max(v.abs()));
    for (dt, emb, tol) in [
        (DType::F16, DType::F16, 0.01),
        (DType::BF16, DType::BF16, 0.05),
        (DType::Q8_0, DType::Q8_0, 0.1),
        (DType::Q4_1, DType::Q8_0, 0.35),
        (DType::Q4_0, DType::Q8_0, 0.5),
    ] {
        let m = Model::load(&write_tiny_gguf(&dir.join(format!("{}.gguf", dt.name())), &spec, dt, emb)).unwrap();
        assert_eq!(m.weights.layers[0].attention().unwrap().wq.dtype, dt);
        let got = last_logits(&m, &p);
        let d = max_diff(&want, &got);
        assert!(d < tol * scale, "{}: max diff {d} vs logit scale {scale}", dt.name());
    }
    for st in [safetensors::Dtype::F16, safetensors::Dtype::BF16] {
        let m = Model::load(&write_tiny_hf(&dir.join(format!("hf-{st:?}")), &spec, st)).unwrap();
        let d = max_diff(&want, &last_logits(&m, &p));
        assert!(d < 0.05 * scale, "{st:?}: {d}");
    }
}

#[test]
fn batched_decode_equals_unbatched() {
    let dir = temp_dir("batch");
    let m = Model::load(&write_tiny_gguf(&dir.join("m.gguf"), &TinySpec::default(), DType::Q4_1, DType::Q8_0)).unwrap();
    let prompts: Vec<Vec<u32>> = (0..8).map(|i| prompt(5 + 3 * i, i as u32)).collect();
    let refs: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
    let mut alone = Vec::new();
    for p in &refs {
        let mut e = Engine::cpu(&m, &opts()).unwrap();
        alone.push(e.generate_greedy(&[p], 12, &[], &mut |_, _| {}).unwrap().remove(0));
    }
    let mut e = Engine::cpu(&m, &opts()).unwrap();
    let together = e.generate_greedy(&refs, 12, &[], &mut |_, _| {}).unwrap();
    assert_eq!(alone, together);
    assert_eq!(e.kv.sequences(), 0);
    assert_eq!(e.kv.stats().free, e.kv.stats().total, "every block returned");
}

#[test]
fn prefix_cache_hit_gives_the_cold_logits() {
    let dir = temp_dir("prefix");
    let m = Model::load(&write_tiny_gguf(&dir.join("m.gguf"), &TinySpec::default(), DType::Q8_0, DType::Q8_0)).unwrap();
    let system = prompt(21, 5);
    let mut a = system.clone();
    a.extend(prompt(6, 8));
    let cold = last_logits(&m, &a);
    let mut e = Engine::cpu(&m, &opts()).unwrap();
    let (s, _) = e.prefill(&[&system]).unwrap().remove(0);
    e.release(s);
    let before = e.kv.prefix_hit_tokens;
    let (s, warm) = e.prefill(&[&a]).unwrap().remove(0);
    assert_eq!(e.kv.prefix_hit_tokens - before, 20, "five full blocks of four reused");
    assert!(max_diff(&cold, &warm) < 1e-4, "{}", max_diff(&cold, &warm));
    e.release(s);
}

#[test]
fn forked_sequences_diverge_without_disturbing_each_other() {
    let dir = temp_dir("fork");
    let m = Model::load(&write_tiny_gguf(&dir.join("m.gguf"), &TinySpec::default(), DType::F16, DType::F16)).unwrap();
    let p = prompt(10, 3);
    let mut e = Engine::cpu(&m, &opts()).unwrap();
    let (a, _) = e.prefill(&[&p]).unwrap().remove(0);
    let b = e.kv.fork(a);
    let la = e.decode(&[(a, 7), (b, 9)]).unwrap().to_vec();
    let vocab = e.vocab();
    // Each branch must equal a fresh sequence with the same tokens.
    for (i, t) in [7u32, 9].into_iter().enumerate() {
        let mut q = p.clone();
        q.push(t);
        let want = last_logits(&m, &q);
        assert!(max_diff(&want, &la[i * vocab..(i + 1) * vocab]) < 1e-4);
    }
    e.release(a);
    e.release(b);
    assert_eq!(e.kv.stats().free, e.kv.stats().total);
}

#[test]
fn bad_batches_are_errors_and_leak_nothing() {
    let dir = temp_dir("bad");
    let m = Model::load(&write_tiny_gguf(&dir.join("m.gguf"), &TinySpec::default(), DType::F32, DType::F32)).unwrap();
    let mut e = Engine::cpu(&m, &opts()).unwrap();
    let vocab = e.vocab() as u32;
    assert!(e.prefill(&[&[]]).is_err());
    assert!(e.prefill(&[&[1, 2], &[vocab + 5]]).is_err(), "out-of-vocabulary id");
    assert!(e.prefill(&[&prompt(300, 1)]).is_err(), "longer than the context");
    assert_eq!(e.kv.sequences(), 0);
    assert_eq!(e.kv.stats().free, e.kv.stats().total);
    // A pool too small for the prompt is a value, not a panic.
    let mut small = Engine::cpu(&m, &EngineOptions { kv_budget_bytes: 1, ..opts() }).unwrap();
    assert!(matches!(small.prefill(&[&prompt(40, 1)]), Err(inferd_engine::engine::EngineError::OutOfBlocks(_))));
    assert_eq!(small.kv.sequences(), 0);
    let _ = argmax(&[0.0]);
}

#[test]
fn a_decode_step_that_runs_out_of_blocks_leaves_every_sequence_intact() {
    let dir = temp_dir("oob-cow");
    let m = Model::load(&write_tiny_gguf(&dir.join("m.gguf"), &TinySpec::default(), DType::F32, DType::F32)).unwrap();
    let block_bytes = inferd_engine::backend::cpu::kv_block_bytes(&m.config, 4);
    let mut e = Engine::cpu(&m, &EngineOptions { kv_budget_bytes: 4 * block_bytes, ..opts() }).unwrap();
    assert_eq!(e.kv.stats().total, 4);
    let p = prompt(6, 4);
    let (a, _) = e.prefill(&[&p]).unwrap().remove(0); // two blocks, the last one partial
    let b = e.kv.fork(a); // shares both
    let (c, _) = e.prefill(&[&prompt(4, 9)]).unwrap().remove(0); // one full block
    assert_eq!(e.kv.stats().free, 1);
    // `a` copies its shared block into the last free one, then `c` finds no block for its token.
    assert!(matches!(e.decode(&[(a, 7), (c, 9)]), Err(inferd_engine::engine::EngineError::OutOfBlocks(_))));
    assert_eq!((e.kv.len(a), e.kv.len(c)), (6, 4), "the step was undone");
    e.release(c);
    let got = e.decode(&[(a, 7)]).unwrap().to_vec();
    let mut q = p.clone();
    q.push(7);
    assert!(max_diff(&last_logits(&m, &q), &got) < 1e-4, "sequence a kept its cache contents");
    e.release(a);
    e.release(b);
    assert_eq!(e.kv.stats().free, 4);
}

#[test]
fn sharded_safetensors_load_through_their_index() {
    let dir = temp_dir("shards");
    let spec = TinySpec::default();
    let single = Model::load(&write_tiny_hf(&dir.join("one"), &spec, safetensors::Dtype::BF16)).unwrap();
    // Split the same tensors over two shards and an index, as large checkpoints ship.
    let sharded = write_tiny_hf(&dir.join("two"), &spec, safetensors::Dtype::BF16);
    let bytes = std::fs::read(sharded.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut shards: [Vec<(String, safetensors::tensor::TensorView<'_>)>; 2] = [Vec::new(), Vec::new()];
    let mut weight_map = serde_json::Map::new();
    for (i, (name, view)) in st.tensors().into_iter().enumerate() {
        let file = format!("model-0000{}-of-00002.safetensors", i % 2 + 1);
        weight_map.insert(name.clone(), serde_json::json!(file));
        shards[i % 2].push((name, view));
    }
    for (i, shard) in shards.into_iter().enumerate() {
        safetensors::tensor::serialize_to_file(
            shard,
            None,
            &sharded.join(format!("model-0000{}-of-00002.safetensors", i + 1)),
        )
        .unwrap();
    }
    std::fs::remove_file(sharded.join("model.safetensors")).unwrap();
    let index = serde_json::json!({ "metadata": {}, "weight_map": weight_map });
    std::fs::write(sharded.join("model.safetensors.index.json"), index.to_string()).unwrap();
    let two = Model::load(&sharded).unwrap();
    let p = prompt(11, 6);
    assert_eq!(last_logits(&single, &p), last_logits(&two, &p));
    // An index naming a shard outside the directory is refused.
    let evil = serde_json::json!({ "weight_map": { "lm_head.weight": "../one/model.safetensors" } });
    std::fs::write(sharded.join("model.safetensors.index.json"), evil.to_string()).unwrap();
    assert!(Model::load(&sharded).unwrap_err().to_string().contains("leaves the model directory"));
}

#[test]
fn an_exported_hugging_face_directory_is_the_same_model() {
    // GGUF (Q/K interleaved for RoPE, quantized) -> HF directory (rotate-half, F32 / BF16):
    // same logits up to the export precision, same tokenizer, same special tokens.
    use inferd_engine::model::export::{export_hf, ExportDtype};
    let dir = temp_dir("export");
    let spec = TinySpec::default();
    // (A quantized GGUF runs with 8-bit activations, its float export without: a looser bound.)
    for (dtype, tol) in [(DType::F32, 1e-3f32), (DType::Q8_0, 0.3)] {
        let g =
            Model::load(&write_tiny_gguf(&dir.join(format!("m-{dtype:?}.gguf")), &spec, dtype, DType::F32)).unwrap();
        for (ex, extra) in [(ExportDtype::F32, 0.0f32), (ExportDtype::BF16, 0.15)] {
            let out = dir.join(format!("hf-{dtype:?}-{ex:?}"));
            export_hf(&g, &out, ex).unwrap();
            let h = Model::load(&out).unwrap();
            assert_eq!(h.config.rope_style, inferd_kernels::ops::RopeStyle::Neox);
            assert_eq!(
                (h.config.n_layers, h.config.vocab, h.tokenizer.eos()),
                (g.config.n_layers, g.config.vocab, g.tokenizer.eos())
            );
            let p = prompt(13, 2);
            let d = max_diff(&last_logits(&g, &p), &last_logits(&h, &p));
            assert!(d < tol + extra, "{dtype:?} -> {ex:?}: logits differ by {d}");
            let text = "the 123 then\n  inner <|im_start|>";
            assert_eq!(g.tokenizer.encode(text, true).unwrap(), h.tokenizer.encode(text, true).unwrap());
        }
    }
}

#[test]
fn a_step_that_runs_out_of_blocks_on_a_later_item_changes_nothing() {
    // a and its fork b share a partial block; c comes later in the same step and does not fit.
    // The step must be refused before anything moves: no copy-on-write block left to a or b,
    // nothing published to the prefix cache. Run afterwards in steps that fit, every output
    // equals the same requests run on an engine with room to spare, bit for bit.
    let dir = temp_dir("oob-step");
    let m = Model::load(&write_tiny_gguf(&dir.join("m.gguf"), &TinySpec::default(), DType::F32, DType::F32)).unwrap();
    let block_bytes = inferd_engine::backend::cpu::kv_block_bytes(&m.config, 4);
    let (p, q) = (prompt(6, 4), prompt(4, 9));
    let long = prompt(16, 5);
    let run = |e: &mut Engine, pressure: bool| -> Vec<Vec<f32>> {
        let (a, _) = e.prefill(&[&p]).unwrap().remove(0); // two blocks, the last one partial
        let b = e.kv.fork(a);
        let (c, _) = e.prefill(&[&q]).unwrap().remove(0); // one full block
        let step =
            |a_tok: &'static [u32], b_tok: &'static [u32]| [RunItem::logits(a, a_tok, 1), RunItem::logits(b, b_tok, 1)];
        if pressure {
            // a copies the shared block (1), c needs four more: 5 of the 4 free.
            assert_eq!(e.kv.stats().free, 4);
            let tables: Vec<Vec<u32>> = [a, b, c].iter().map(|&s| e.kv.block_table(s).to_vec()).collect();
            let stats = e.kv.stats();
            let [ia, ib] = step(&[7], &[9]);
            let err = e.step(&[ia, ib, RunItem::logits(c, &long, 1)]).unwrap_err();
            assert!(
                matches!(err, EngineError::OutOfBlocks(OutOfBlocks { needed: 5, free: 4, states: false })),
                "{err}"
            );
            assert_eq!(e.kv.stats(), stats, "no block moved");
            for (s, t) in [a, b, c].into_iter().zip(&tables) {
                assert_eq!(e.kv.block_table(s), &t[..], "block tables untouched");
            }
            assert_eq!((e.kv.len(a), e.kv.len(b), e.kv.len(c)), (6, 6, 4));
        }
        let mut out = e.step(&step(&[7], &[9])).unwrap();
        out.extend(e.step(&step(&[11], &[13])).unwrap());
        e.release(a);
        e.release(b);
        out.extend(e.step(&[RunItem::logits(c, &long, 1)]).unwrap());
        e.release(c);
        // What the prefix cache now holds must be right too.
        out.extend(e.prefill(&[&[p.clone(), vec![7, 11]].concat()]).unwrap().into_iter().map(|(s, l)| {
            e.release(s);
            l
        }));
        assert_eq!(e.kv.sequences(), 0);
        out
    };
    let mut tight = Engine::cpu(&m, &EngineOptions { kv_budget_bytes: 7 * block_bytes, ..opts() }).unwrap();
    let mut roomy = Engine::cpu(&m, &opts()).unwrap();
    let (got, want) = (run(&mut tight, true), run(&mut roomy, false));
    assert_eq!(got.len(), 6);
    assert!(got == want, "outputs under pressure differ from outputs with room");
    assert_eq!(tight.kv.stats().free, 7);
}

#[test]
fn a_profiled_decode_step_is_cut_into_its_phases_and_computes_the_same() {
    use inferd_engine::backend::profile::Phase;
    let dir = temp_dir("profile");
    let spec = TinySpec::default();
    let m = Model::load(&write_tiny_gguf(&dir.join("m.gguf"), &spec, DType::Q4_1, DType::Q8_0)).unwrap();
    let steps = 6;
    let decode = |profiled: bool| {
        let mut e = Engine::cpu(&m, &opts()).unwrap();
        assert!(e.backend.take_profile().is_none(), "off until asked for");
        let (s, l) = e.prefill(&[&prompt(11, 3)]).unwrap().remove(0);
        assert!(e.backend.set_profiling(profiled) || !profiled);
        let (mut tok, mut logits, t) = (argmax(&l), Vec::new(), std::time::Instant::now());
        for _ in 0..steps {
            logits.extend_from_slice(e.decode(&[(s, tok)]).unwrap());
            tok = argmax(&logits[logits.len() - l.len()..]);
        }
        (logits, e.backend.take_profile(), t.elapsed())
    };
    let (plain, none, _) = decode(false);
    assert!(none.is_none());
    let (logits, profile, wall) = decode(true);
    assert!(plain == logits, "the clocks change nothing computed");
    let p = profile.unwrap();
    assert_eq!((p.passes, p.tokens), (steps, steps));
    // One dispatch per product per layer, attention's of its own, none between; every phase
    // measured but the DeltaNet layers' (this model has none), and all of them within the
    // steps' wall time.
    let layers = spec.layers as u64;
    for (ph, n) in [(Phase::QkvProjection, layers), (Phase::OutputProjection, layers), (Phase::FfnGateUp, layers)]
        .into_iter()
        .chain([(Phase::FfnDown, layers), (Phase::Logits, 1), (Phase::Between, 0)])
    {
        assert_eq!(p.phase(ph).pool.dispatches, n * steps, "{ph:?}");
    }
    assert!(p.phase(Phase::Attention).pool.dispatches >= layers * steps);
    for ph in Phase::ALL {
        let time = p.phase(ph).time;
        assert_eq!(time > std::time::Duration::ZERO, ph != Phase::Recurrence, "{ph:?}: {time:?}");
    }
    assert!(p.time() <= wall, "{:?} of phases in {wall:?}", p.time());
    let pool = p.pool();
    assert!(pool.work + pool.wait <= p.time());
    // Each product's weights, once a pass.
    let w = &m.weights;
    let bytes =
        |ts: &mut dyn Iterator<Item = &inferd_engine::model::Tensor>| ts.map(|t| t.bytes().len() as u64).sum::<u64>();
    let qkv = bytes(&mut w.layers.iter().flat_map(|l| l.mixer_matrices().into_iter().take(3)));
    let ffn = bytes(&mut w.layers.iter().flat_map(|l| [&l.w_gate, &l.w_up]));
    assert_eq!(p.phase(Phase::QkvProjection).weight_bytes, qkv * steps);
    assert_eq!(p.phase(Phase::FfnGateUp).weight_bytes, ffn * steps);
    assert_eq!(p.phase(Phase::Logits).weight_bytes, w.output.bytes().len() as u64 * steps);
    assert_eq!(p.phase(Phase::Attention).weight_bytes, 0);
}
