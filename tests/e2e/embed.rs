//! Text embeddings of the default model against llama.cpp's own (its mean pooling, through
//! tests/reference/embeddings.py over the llama-cpp-cffi wheel), on the same token ids: a short
//! text, a sentence, and one longer than a prefill chunk (several forwards). And embedding
//! models whose files name their pooling (last token with an end token appended, CLS), against
//! llama.cpp's tokenization and pooling of the same texts.

use inferd_engine::engine::{Engine, EngineOptions};
use inferd_engine::model::Model;

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| f64::from(*x) * f64::from(*y)).sum();
    let na: f64 = a.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    dot / (na * nb)
}

#[test]
fn embeddings_equal_llama_cpps_mean_pooling() {
    let path = inferd_e2e::default_model();
    let model = Model::load(&path).unwrap();
    let long = "The lighthouse keeper climbed the stairs every night. ".repeat(60);
    let texts = ["Hello", "The cat sat on the mat.", long.as_str()];
    let ids: Vec<Vec<u32>> = texts.iter().map(|t| model.tokenizer.encode(t, false).unwrap()).collect();
    let mut engine = Engine::cpu(&model, &EngineOptions { threads: 2, ..EngineOptions::default() }).unwrap();
    assert!(ids[2].len() > EngineOptions::default().prefill_chunk, "the long text spans several forwards");
    let ours: Vec<Vec<f32>> = ids.iter().map(|t| engine.embed(t).unwrap()).collect();
    assert_eq!(engine.kv.stats().free, engine.kv.stats().total, "embedding holds no block afterwards");
    let dir = inferd_e2e::temp_dir("embed");
    let (input, output) = (dir.join("tokens.json"), dir.join("embeddings.json"));
    std::fs::write(&input, serde_json::to_string(&ids).unwrap()).unwrap();
    inferd_e2e::run_python("reference/embeddings.py", &[path.as_os_str(), input.as_os_str(), output.as_os_str()]);
    let theirs: Vec<Vec<f32>> = serde_json::from_slice(&std::fs::read(&output).unwrap()).unwrap();
    for ((t, a), b) in texts.iter().zip(&ours).zip(&theirs) {
        assert_eq!(a.len(), model.config.hidden);
        let norm: f64 = a.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
        assert!((norm - 1.0).abs() < 1e-5, "normalized: {norm}");
        let c = cosine(a, b);
        let max = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
        eprintln!("{:.20}...: cosine {c:.6}, largest difference {max:.5}", t);
        assert!(c > 0.999 && max < 0.02, "{:.40}: cosine {c}, largest difference {max}", t);
    }
    // And the vectors tell texts apart: each is closer to llama.cpp's own than to another's.
    assert!(cosine(&ours[0], &theirs[1]) < 0.99);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn embedding_models_pool_and_tokenize_as_llama_cpp() {
    // The long text runs in several chunks: CLS pools from the first, last-token from the last.
    let texts = ["Hello", "the cat sat in the hat", &"in the heat ".repeat(15)];
    let opts = EngineOptions { threads: 2, prefill_chunk: 32, ..EngineOptions::default() };
    for (name, pooling) in [("tiny-qwen2-embed-last", "last"), ("tiny-llama-embed-cls", "cls")] {
        let path = crate::reference::tiny_dir().join(format!("{name}.gguf"));
        let model = Model::load(&path).unwrap();
        let mut engine = Engine::cpu(&model, &opts).unwrap();
        let dir = inferd_e2e::temp_dir(name);
        let (input, output) = (dir.join("texts.json"), dir.join("embeddings.json"));
        std::fs::write(&input, serde_json::to_string(&texts).unwrap()).unwrap();
        let pooling = format!("--pooling={pooling}");
        let args = [path.as_os_str(), input.as_os_str(), output.as_os_str(), pooling.as_ref()];
        inferd_e2e::run_python("reference/embeddings.py", &args);
        let theirs: serde_json::Value = serde_json::from_slice(&std::fs::read(&output).unwrap()).unwrap();
        let mut ours = Vec::new();
        for (i, t) in texts.iter().enumerate() {
            let ids = model.tokenizer.encode(t, false).unwrap();
            assert!(i < 2 || ids.len() > 2 * opts.prefill_chunk, "{}", ids.len());
            let want: Vec<u32> =
                theirs["tokens"][i].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
            assert_eq!(ids, want, "{name}: {t:.20}: the vocabulary's BOS / EOS as llama.cpp adds them");
            let a = engine.embed(&ids).unwrap();
            let b: Vec<f32> =
                theirs["embeddings"][i].as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect();
            let c = cosine(&a, &b);
            eprintln!("{name} {t:.20}: cosine {c:.6}");
            assert!(c > 0.9995, "{name}: {t:.20}: cosine {c}");
            ours.push(a);
        }
        // The pooling is the file's: mean pooling would give other vectors.
        let ids = model.tokenizer.encode(texts[1], false).unwrap();
        let mut mean_model = Model::load(&path).unwrap();
        mean_model.config.pooling = inferd_engine::model::config::Pooling::Mean;
        let mut mean = Engine::cpu(&mean_model, &opts).unwrap();
        assert!(cosine(&mean.embed(&ids).unwrap(), &ours[1]) < 0.99, "{name}");
        let _ = std::fs::remove_dir_all(dir);
    }
}
