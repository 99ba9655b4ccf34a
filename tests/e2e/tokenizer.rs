//! The default model's tokenizer against the independent reference ids (tests/golden), and
//! streaming detokenization.

use inferd_engine::model::Model;
use inferd_engine::tokenizer::stream::StreamDecoder;
use serde_json::Value;

fn model() -> Model {
    Model::load(&inferd_e2e::default_model()).expect("loading the default model")
}

#[test]
fn token_ids_equal_the_reference_tokenizer() {
    let m = model();
    let text = std::fs::read_to_string(inferd_e2e::golden_dir().join("tokenizer-smollm2.json")).unwrap();
    let g: Value = serde_json::from_str(&text).unwrap();
    let cases = g["cases"].as_array().unwrap().iter().chain(g["edge_cases"].as_array().unwrap());
    let mut n = 0;
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let special = case["parse_special"].as_bool().unwrap();
        let want: Vec<u32> = case["ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
        let got = m.tokenizer.encode(text, special).unwrap();
        assert_eq!(got, want, "{}: {text:?}", case["name"]);
        if case["decoded_equals_text"].as_bool() == Some(true) {
            assert_eq!(m.tokenizer.decode(&got, false).unwrap(), text, "{} round trip", case["name"]);
        }
        n += 1;
    }
    assert!(n >= 30);
}

#[test]
fn streaming_never_emits_broken_utf8() {
    let m = model();
    let text = "Crabs 🦀 and thumbs 👍🏽, 日本語のテキスト, naïve café — done.";
    let ids = m.tokenizer.encode(text, false).unwrap();
    assert!(ids.len() > 10);
    let mut dec = StreamDecoder::new(true);
    let mut pieces = Vec::new();
    for &id in &ids {
        pieces.push(dec.push(&m.tokenizer, id).unwrap());
    }
    pieces.push(dec.finish());
    assert!(pieces.iter().all(|p| !p.contains('\u{fffd}')), "{pieces:?}");
    assert_eq!(pieces.concat(), text);
    // Multi-byte characters span several tokens: some pushes must have produced nothing.
    assert!(pieces.iter().any(String::is_empty));
    // Special tokens are skipped in streamed text when asked.
    let chat = m.tokenizer.encode("<|im_start|>user\nHi<|im_end|>", true).unwrap();
    let mut dec = StreamDecoder::new(true);
    let s: String = chat.iter().map(|&id| dec.push(&m.tokenizer, id).unwrap()).collect();
    assert_eq!(s, "user\nHi");
}

#[test]
fn sentencepiece_vocabularies_merge_by_score_and_fall_back_to_bytes() {
    use inferd_engine::model::gguf::Gguf;
    use inferd_engine::model::gguf_writer::{GgufWriter, MetaValue};
    use inferd_engine::model::mmap::Blob;
    use inferd_engine::tokenizer::Tokenizer;
    // A Llama-2-style vocabulary: specials, 256 byte tokens, then scored pieces.
    let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
    let mut types = vec![2, 3, 3];
    let mut scores = vec![0.0f32; 3];
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(6);
        scores.push(0.0);
    }
    let pieces = [
        "▁", "h", "e", "l", "o", "w", "r", "d", "ll", "he", "hell", "hello", "▁hello", "or", "wor", "worl", "world",
        "▁world",
    ];
    for (i, p) in pieces.iter().enumerate() {
        tokens.push(p.to_string());
        types.push(1);
        scores.push(-(i as f32));
    }
    let id = |p: &str| tokens.iter().position(|t| t == p).unwrap() as u32;
    let mut w = GgufWriter::default();
    w.meta("tokenizer.ggml.model", MetaValue::Str("llama".into()))
        .meta("tokenizer.ggml.tokens", MetaValue::StrArray(tokens.clone()))
        .meta("tokenizer.ggml.token_type", MetaValue::I32Array(types))
        .meta("tokenizer.ggml.scores", MetaValue::F32Array(scores))
        .meta("tokenizer.ggml.bos_token_id", MetaValue::U32(1))
        .meta("tokenizer.ggml.eos_token_id", MetaValue::U32(2));
    let g = Gguf::parse(Blob::from_vec(w.to_bytes())).unwrap();
    let tok = Tokenizer::from_gguf(&g).unwrap();
    // SentencePiece models prepend BOS by default and mark word starts with ▁.
    assert_eq!(tok.encode("hello world", false).unwrap(), vec![1, id("▁hello"), id("▁world")]);
    // Characters outside the vocabulary become their UTF-8 bytes.
    let crab = tok.encode("hello 🦀", false).unwrap();
    assert_eq!(crab, vec![1, id("▁hello"), id("▁"), id("<0xF0>"), id("<0x9F>"), id("<0xA6>"), id("<0x80>")]);
    assert_eq!(tok.decode(&crab, true).unwrap(), " hello 🦀");
    assert_eq!(tok.eos(), &[2]);
}

#[test]
fn qwen2_splits_digits_one_by_one_where_llama3_takes_three() {
    use inferd_engine::model::gguf::Gguf;
    use inferd_engine::model::gguf_writer::{GgufWriter, MetaValue};
    use inferd_engine::model::mmap::Blob;
    use inferd_engine::tokenizer::Tokenizer;
    let (mut tokens, mut merges) = inferd_e2e::tiny_vocab();
    tokens.push("12".into());
    merges.push(("1".into(), "2".into()));
    let twelve = (tokens.len() - 1) as u32;
    let tokenizer = |pre: &str| {
        let mut w = GgufWriter::default();
        w.meta("tokenizer.ggml.model", MetaValue::Str("gpt2".into()))
            .meta("tokenizer.ggml.pre", MetaValue::Str(pre.into()))
            .meta("tokenizer.ggml.tokens", MetaValue::StrArray(tokens.clone()))
            .meta(
                "tokenizer.ggml.merges",
                MetaValue::StrArray(merges.iter().map(|(a, b)| format!("{a} {b}")).collect()),
            )
            .meta("tokenizer.ggml.add_bos_token", MetaValue::Bool(false));
        Tokenizer::from_gguf(&Gguf::parse(Blob::from_vec(w.to_bytes())).unwrap()).unwrap()
    };
    let (qwen, llama) = (tokenizer("qwen2"), tokenizer("llama-bpe"));
    let q = qwen.encode("x123", false).unwrap();
    let l = llama.encode("x123", false).unwrap();
    assert!(!q.contains(&twelve), "qwen2 pre-tokenizes each digit alone: {q:?}");
    assert!(l.contains(&twelve), "llama-bpe keeps up to three digits together: {l:?}");
    assert_eq!(qwen.decode(&q, false).unwrap(), "x123");
    assert_eq!(llama.decode(&l, false).unwrap(), "x123");
}

#[test]
fn end_tokens_and_fim_tokens_are_read_as_llama_cpp_reads_them() {
    use inferd_engine::model::gguf::Gguf;
    use inferd_engine::model::gguf_writer::{GgufWriter, MetaValue};
    use inferd_engine::model::mmap::Blob;
    use inferd_engine::tokenizer::Tokenizer;
    let (mut tokens, merges) = inferd_e2e::tiny_vocab();
    // (The tiny vocabulary starts with `<|endoftext|>`, `<|im_start|>`, `<|im_end|>`.)
    let added = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|file_sep|>"];
    tokens.extend(added.iter().map(|t| t.to_string()));
    let id = |t: &str| tokens.iter().position(|a| a == t).unwrap() as u32;
    let tokenizer = |extra: &[(&str, u32)]| {
        let mut w = GgufWriter::default();
        w.meta("tokenizer.ggml.model", MetaValue::Str("gpt2".into()))
            .meta("tokenizer.ggml.pre", MetaValue::Str("qwen2".into()))
            .meta("tokenizer.ggml.tokens", MetaValue::StrArray(tokens.clone()))
            .meta(
                "tokenizer.ggml.merges",
                MetaValue::StrArray(merges.iter().map(|(a, b)| format!("{a} {b}")).collect()),
            )
            .meta("tokenizer.ggml.eos_token_id", MetaValue::U32(id("<|im_end|>")));
        for (k, v) in extra {
            w.meta(k, MetaValue::U32(*v));
        }
        Tokenizer::from_gguf(&Gguf::parse(Blob::from_vec(w.to_bytes())).unwrap()).unwrap()
    };
    // Qwen's converters name `<|im_end|>` alone; `<|endoftext|>` ends a completion and the file
    // separator ends a fill-in-the-middle answer (llama.cpp stops at both).
    let tok = tokenizer(&[]);
    assert_eq!(tok.eos(), [id("<|im_end|>"), id("<|endoftext|>"), id("<|file_sep|>")]);
    let fim = tok.fim().fim().unwrap();
    assert_eq!(
        (fim.prefix, fim.suffix, fim.middle),
        (id("<|fim_prefix|>"), id("<|fim_suffix|>"), id("<|fim_middle|>"))
    );
    // Metadata names win over the known spellings.
    let tok = tokenizer(&[("tokenizer.ggml.fim_mid_token_id", 3)]);
    assert_eq!(tok.fim().middle, Some(3));
}
