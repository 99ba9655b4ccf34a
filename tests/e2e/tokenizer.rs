//! The default model's tokenizer against the independent reference ids (tests/golden), and
//! streaming detokenization.

use inferd::model::Model;
use inferd::tokenizer::stream::StreamDecoder;
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
