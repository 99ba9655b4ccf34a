//! What a model file says that the loader does not understand is an error that names it: a
//! metadata key, a RoPE scaling type, a bias, a tensor nobody reads. The file's model would
//! otherwise run with different numbers and no word about it.

use inferd_e2e::{temp_dir, write_tiny_gguf, write_tiny_gguf_with, write_tiny_hf, TinySpec};
use inferd_engine::model::gguf_writer::MetaValue;
use inferd_engine::model::Model;
use inferd_kernels::DType;

fn gguf_error(name: &str, extra: impl FnOnce(&mut inferd_engine::model::gguf_writer::GgufWriter)) -> String {
    let dir = temp_dir(name);
    let path = write_tiny_gguf_with(&dir.join("m.gguf"), &TinySpec::default(), DType::F32, DType::F32, extra);
    Model::load(&path).map(|_| ()).expect_err("the file loaded").to_string()
}

#[test]
fn gguf_content_the_loader_does_not_understand_is_named() {
    let dir = temp_dir("understood");
    assert!(Model::load(&write_tiny_gguf(&dir.join("m.gguf"), &TinySpec::default(), DType::F32, DType::F32)).is_ok());
    // Keys that change nothing are fine.
    let ok = write_tiny_gguf_with(&dir.join("ok.gguf"), &TinySpec::default(), DType::F32, DType::F32, |w| {
        w.meta("llama.rope.scaling.type", MetaValue::Str("none".into()));
        w.meta("llama.attention.key_length", MetaValue::U32(16));
        w.meta("llama.expert_count", MetaValue::U32(0));
    });
    Model::load(&ok).unwrap();
    // YaRN loads (tests/e2e/reference.rs); its DeepSeek variant and unknown types do not.
    let yarn = |w: &mut inferd_engine::model::gguf_writer::GgufWriter| {
        w.meta("llama.rope.scaling.type", MetaValue::Str("yarn".into()));
        w.meta("llama.rope.scaling.factor", MetaValue::F32(4.0));
    };
    Model::load(&write_tiny_gguf_with(&dir.join("yarn.gguf"), &TinySpec::default(), DType::F32, DType::F32, yarn))
        .unwrap();
    let e = gguf_error("rope-yarn-log", |w| {
        yarn(w);
        w.meta("llama.rope.scaling.yarn_log_multiplier", MetaValue::F32(0.1));
    });
    assert!(e.contains("llama.rope.scaling.yarn_log_multiplier"), "{e}");
    let e = gguf_error("rope-dynamic", |w| {
        w.meta("llama.rope.scaling.type", MetaValue::Str("dynamic".into()));
    });
    assert!(e.contains("llama.rope.scaling.type") && e.contains("dynamic"), "{e}");
    let e = gguf_error("moe", |w| {
        w.meta("llama.expert_count", MetaValue::U32(8));
    });
    assert!(e.contains("llama.expert_count"), "{e}");
    // Embedding models: a pooling type is read; a reranker's head and bidirectional attention
    // are named.
    let cls = write_tiny_gguf_with(&dir.join("cls.gguf"), &TinySpec::default(), DType::F32, DType::F32, |w| {
        w.meta("llama.pooling_type", MetaValue::U32(2));
        w.meta("llama.attention.causal", MetaValue::Bool(true));
    });
    let cls = Model::load(&cls).unwrap();
    assert_eq!(cls.config.pooling, inferd_engine::model::config::Pooling::Cls);
    let e = gguf_error("rank", |w| {
        w.meta("llama.pooling_type", MetaValue::U32(4));
    });
    assert!(e.contains("rank pooling"), "{e}");
    let e = gguf_error("bidirectional", |w| {
        w.meta("llama.attention.causal", MetaValue::Bool(false));
    });
    assert!(e.contains("llama.attention.causal = false"), "{e}");
    let e = gguf_error("unknown-key", |w| {
        w.meta("llama.attention.logit_softcapping", MetaValue::U32(30));
    });
    assert!(e.contains("llama.attention.logit_softcapping"), "{e}");
    // Llama 3.1's RoPE factors are read: one per rotated pair, so a wrong count is named.
    let e = gguf_error("rope-freqs", |w| {
        w.tensor("rope_freqs.weight", DType::F32, &[5], &[1.0; 5]);
    });
    assert!(e.contains("rope_freqs.weight"), "{e}");
    // A bias nobody reads.
    let e = gguf_error("bias", |w| {
        w.tensor("blk.0.attn_q.bias", DType::F32, &[64], &[0.5; 64]);
    });
    assert!(e.contains("blk.0.attn_q.bias") && e.contains("not used"), "{e}");
}

#[test]
fn config_json_fields_the_loader_does_not_understand_are_named() {
    let dir = temp_dir("hf-understood");
    let path = write_tiny_hf(&dir.join("hf"), &TinySpec::default(), safetensors::Dtype::F32);
    Model::load(&path).unwrap();
    let config: serde_json::Value = serde_json::from_slice(&std::fs::read(path.join("config.json")).unwrap()).unwrap();
    let with = |key: &str, value: serde_json::Value| {
        let mut c = config.clone();
        c[key] = value;
        std::fs::write(path.join("config.json"), c.to_string()).unwrap();
        Model::load(&path).map(|_| ()).map_err(|e| e.to_string())
    };
    // Fields that change nothing at inference load.
    with("torch_dtype", "bfloat16".into()).unwrap();
    with("rope_scaling", serde_json::Value::Null).unwrap();
    with("attention_bias", false.into()).unwrap();
    for (key, value) in [
        ("rope_scaling", serde_json::json!({"rope_type": "dynamic", "factor": 2.0})),
        // DeepSeek's YaRN magnitude terms.
        ("rope_scaling", serde_json::json!({"rope_type": "yarn", "factor": 4.0, "mscale_all_dim": 1.0})),
        ("rope_scaling", serde_json::json!({"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]})),
        ("attention_bias", true.into()),
        ("hidden_act", "gelu".into()),
        ("sliding_window", 4096.into()),
    ] {
        let e = with(key, value).expect_err(key);
        assert!(e.contains(key), "{key}: {e}");
    }
}

#[test]
fn a_backend_refuses_an_architecture_it_does_not_run_by_name() {
    use inferd_engine::engine::{Engine, EngineOptions};
    let dir = temp_dir("arch-refused");
    let mut m =
        Model::load(&write_tiny_gguf(&dir.join("m.gguf"), &TinySpec::default(), DType::F32, DType::F32)).unwrap();
    assert_eq!(m.arch.name, "llama");
    assert!(!m.arch.tied_output, "the tiny model has its own output projection");
    Engine::cpu(&m, &EngineOptions::default()).unwrap();
    m.arch.layers[1].window = Some(0);
    let e = Engine::cpu(&m, &EngineOptions::default()).map(|_| ()).unwrap_err().to_string();
    assert!(e.contains("sliding window of zero"), "{e}");
}
