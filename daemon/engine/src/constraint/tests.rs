//! The masker over a real vocabulary (the default model's, SmolLM2's): random logits masked step by step
//! always give output that parses and validates; rows of a speculative step, rollbacks and
//! forks give the masks a fresh parser gives for the same prefix; forbidden emits and early
//! ends are refused.

use super::mask::Masker;
use super::{ResponseFormat, Vocabulary};
use crate::tokenizer::Tokenizer;

const ROOT: u64 = 1;

fn tokenizer() -> Tokenizer {
    let path = crate::paths::default_model().expect("the default model (packaging/fetch-model installs it)");
    crate::model::Model::load(&path).unwrap().tokenizer
}

/// A reproducible stream of logits rows.
struct Rows(u64);

impl Rows {
    fn next(&mut self, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| {
                self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                (self.0 >> 40) as f32 / (1u64 << 24) as f32
            })
            .collect()
    }
}

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}

fn person() -> ResponseFormat {
    ResponseFormat::JsonSchema(serde_json::json!({
        "type": "object",
        "properties": {
            "name": { "type": "string", "maxLength": 6 },
            "age": { "type": "integer", "minimum": 0, "maximum": 120 },
            "tags": { "type": "array", "items": { "enum": ["a", "b"] }, "maxItems": 2 }
        },
        "required": ["name", "age", "tags"],
        "additionalProperties": false
    }))
}

/// Greedy over random logits under the mask until the end-of-sequence token: the output.
/// Tokens in `prefer` win whenever the mask allows them (a walk that must end soon).
fn walk(v: &Vocabulary, tok: &Tokenizer, format: &ResponseFormat, seed: u64, prefer: &[u32]) -> Vec<u32> {
    let g = v.compile(format).unwrap();
    let prompt = [5u32, 6, 7];
    let mut m = Masker::new(&g, ROOT, prompt.len(), &[], 1).unwrap();
    let mut seq = prompt.to_vec();
    let mut rows = Rows(seed);
    let vocab = tok.vocab_size() + 17; // a padded logits row: the tail is always forbidden
    for _ in 0..400 {
        let mut row = rows.next(vocab);
        m.mask(ROOT, &seq, &mut row, vocab).unwrap();
        assert!(row[tok.vocab_size()..].iter().all(|&x| x == f32::NEG_INFINITY));
        for &p in prefer {
            row[p as usize] += 2.0;
        }
        let t = argmax(&row);
        assert!(row[t as usize].is_finite(), "the mask allowed nothing");
        if tok.eos().contains(&t) {
            m.finish(0).unwrap();
            return seq[prompt.len()..].to_vec();
        }
        m.emit(0, t).unwrap();
        seq.push(t);
    }
    panic!("no end after 400 tokens: {:?}", tok.decode(&seq, false));
}

#[test]
fn masked_random_logits_always_give_output_that_validates() {
    let tok = tokenizer();
    let v = Vocabulary::new(&tok).unwrap();
    for seed in 0..6 {
        let out = walk(&v, &tok, &person(), seed, &[]);
        let text = tok.decode(&out, false).unwrap();
        let j: serde_json::Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        let o = j.as_object().unwrap();
        assert_eq!(o.len(), 3, "{text}");
        assert!(o["name"].as_str().unwrap().chars().count() <= 6, "{text}");
        assert!((0..=120).contains(&o["age"].as_i64().unwrap()), "{text}");
        let tags = o["tags"].as_array().unwrap();
        assert!(tags.len() <= 2 && tags.iter().all(|t| t == "a" || t == "b"), "{text}");
        // Special tokens are never text: `<|im_start|>` appears nowhere in the output.
        assert!(out.iter().all(|&t| !tok.is_special(t)), "{text}");
    }
    // Any object: random keys and values, ended soon by preferring quotes and the closing brace.
    let prefer: Vec<u32> = ["\"", "}"].iter().map(|s| tok.encode(s, false).unwrap()[0]).collect();
    let any = walk(&v, &tok, &ResponseFormat::JsonObject, 9, &prefer);
    let text = tok.decode(&any, false).unwrap();
    let j: serde_json::Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
    assert!(j.is_object(), "{text}");
}

/// The mask a fresh parser gives after output `out`, as the set of allowed tokens.
fn fresh_mask(v: &Vocabulary, format: &ResponseFormat, out: &[u32], vocab: usize) -> Vec<bool> {
    let g = v.compile(format).unwrap();
    let mut m = Masker::new(&g, ROOT, 0, &[], 1).unwrap();
    let mut row = vec![0.0; vocab];
    m.mask(ROOT, out, &mut row, vocab).unwrap();
    row.iter().map(|x| x.is_finite()).collect()
}

#[test]
fn speculative_rows_rollbacks_and_forks_mask_as_a_fresh_parser_would() {
    let tok = tokenizer();
    let v = Vocabulary::new(&tok).unwrap();
    let f = person();
    let out = walk(&v, &tok, &f, 3, &[]);
    let vocab = tok.vocab_size();
    let allowed = |row: &[f32]| row.iter().map(|x| x.is_finite()).collect::<Vec<bool>>();
    let g = v.compile(&f).unwrap();
    let mut m = Masker::new(&g, ROOT, 0, &[], 1).unwrap();

    // A speculative step: four rows over out[..k+3], the last three predicting after drafts.
    let k = out.len() / 2;
    let mut rows = vec![0.0; 4 * vocab];
    m.mask(ROOT, &out[..k + 3], &mut rows, vocab).unwrap();
    for (j, row) in rows.chunks(vocab).enumerate() {
        assert_eq!(allowed(row), fresh_mask(&v, &f, &out[..k + j], vocab), "row {j}");
    }
    // Rolled back to k + 1 tokens (two drafts rejected), then on along another path.
    let mut row = vec![0.0; vocab];
    m.mask(ROOT, &out[..k + 1], &mut row, vocab).unwrap();
    assert_eq!(allowed(&row), fresh_mask(&v, &f, &out[..k + 1], vocab));

    // A draft token the grammar forbids: its row is masked, the rows after it are left alone.
    let bad = (0..vocab as u32).find(|&t| !fresh_mask(&v, &f, &out[..k], vocab)[t as usize]).unwrap();
    let mut seq = out[..k].to_vec();
    seq.extend([bad, out[k]]);
    let mut rows = vec![0.0; 3 * vocab];
    m.mask(ROOT, &seq, &mut rows, vocab).unwrap();
    assert_eq!(allowed(&rows[..vocab]), fresh_mask(&v, &f, &out[..k], vocab));
    assert!(rows[vocab..].iter().all(|x| *x == 0.0), "rows after a forbidden token stay unmasked");

    // A fork starts where its parent stands and moves on alone.
    m.mask(ROOT, &out[..k], &mut vec![0.0; vocab], vocab).unwrap();
    m.fork(ROOT, 2);
    let mut row = vec![0.0; vocab];
    m.mask(2, &out[..k + 2], &mut row, vocab).unwrap();
    assert_eq!(allowed(&row), fresh_mask(&v, &f, &out[..k + 2], vocab));
    let mut row = vec![0.0; vocab];
    m.mask(ROOT, &out[..k], &mut row, vocab).unwrap();
    assert_eq!(allowed(&row), fresh_mask(&v, &f, &out[..k], vocab));
    // A sequence the session never constrained (a draft model's) is left alone.
    let mut row = vec![0.0; vocab];
    m.mask(99, &out[..k], &mut row, vocab).unwrap();
    assert!(row.iter().all(|x| *x == 0.0));
}

#[test]
fn forbidden_emits_and_early_ends_are_refused() {
    let tok = tokenizer();
    let v = Vocabulary::new(&tok).unwrap();
    let g = v.compile(&ResponseFormat::JsonObject).unwrap();
    let mut m = Masker::new(&g, ROOT, 0, &[], 2).unwrap();
    let letter = tok.encode("x", false).unwrap()[0];
    let brace = tok.encode("{", false).unwrap()[0];
    let e = m.emit(0, letter).unwrap_err();
    assert!(e.contains("forbids"), "{e}");
    m.emit(1, brace).unwrap();
    let e = m.finish(1).unwrap_err();
    assert!(e.contains("before its output completed"), "{e}");
    // A resumed request whose earlier output no longer fits is refused at once.
    assert!(Masker::new(&g, ROOT, 0, &[letter], 1).is_err());
}

#[test]
fn a_schema_the_engine_cannot_enforce_is_refused_with_the_reason() {
    let tok = tokenizer();
    let v = Vocabulary::new(&tok).unwrap();
    for bad in [
        serde_json::json!({ "type": "no-such-type" }),
        serde_json::json!({ "$ref": "#/$defs/missing" }),
        serde_json::json!({ "type": "integer", "minimum": 5, "maximum": 1 }),
    ] {
        let e = v.compile(&ResponseFormat::JsonSchema(bad.clone())).unwrap_err().to_string();
        assert!(e.starts_with("the response format cannot be enforced: "), "{bad}: {e}");
    }
    let e = v.compile(&ResponseFormat::Lark("start: (".into())).unwrap_err();
    assert!(matches!(e, super::ConstraintError::Compile(_)), "{e}");
}

/// The largest schemas the limits admit compile, and mask their first tokens, on threads with
/// the 2 MiB stack of the runtime's blocking pool and of an engine thread (a 4,300-property
/// object once overflowed it and aborted the daemon); one past a limit is refused unbuilt.
#[test]
fn the_largest_admitted_schemas_compile_and_mask_on_a_small_stack() {
    use super::limits::{MAX_ALTERNATIVES, MAX_DEPTH, MAX_PROPERTIES};
    let tok = tokenizer();
    let v = Vocabulary::new(&tok).unwrap();
    let names: Vec<String> = (0..MAX_PROPERTIES).map(|i| format!("p{i}")).collect();
    let props: serde_json::Map<String, serde_json::Value> =
        names.iter().map(|n| (n.clone(), serde_json::json!({ "type": "string", "maxLength": 3 }))).collect();
    let wide = serde_json::json!({ "type": "object", "properties": props, "required": names });
    let mut deep = serde_json::json!({ "type": "integer" });
    for i in 0..MAX_DEPTH / 2 - 1 {
        deep = if i % 2 == 0 {
            serde_json::json!({ "type": "array", "items": deep, "minItems": 1 })
        } else {
            serde_json::json!({ "type": "object", "properties": { "a": deep }, "required": ["a"] })
        };
    }
    let choices = serde_json::json!({ "enum": (0..MAX_ALTERNATIVES).map(|i| format!("v{i}")).collect::<Vec<_>>() });
    let alternatives = serde_json::json!({ "anyOf": (0..MAX_ALTERNATIVES).map(|i| serde_json::json!({ "const": i })).collect::<Vec<_>>() });
    for (what, schema) in [("wide", &wide), ("deep", &deep), ("enum", &choices), ("anyOf", &alternatives)] {
        let f = ResponseFormat::JsonSchema(schema.clone());
        let t0 = std::time::Instant::now();
        let small = std::thread::Builder::new().stack_size(2 << 20);
        let masked = std::thread::scope(|s| {
            small
                .spawn_scoped(s, || {
                    let g = v.compile(&f).unwrap();
                    let compiled = t0.elapsed();
                    let mut m = Masker::new(&g, ROOT, 3, &[], 1).unwrap();
                    let mut row = vec![0.0f32; tok.vocab_size()];
                    m.mask(ROOT, &[5, 6, 7], &mut row, tok.vocab_size()).unwrap();
                    let allowed = row.iter().filter(|x| x.is_finite()).count();
                    eprintln!("{what}: compiled in {:.2} s, first mask allows {allowed}", compiled.as_secs_f64());
                    allowed
                })
                .unwrap()
                .join()
                .unwrap()
        });
        assert!(masked > 0, "{what}");
    }
    let mut more = wide.clone();
    more["properties"]["one-more"] = serde_json::json!({ "type": "string" });
    let e = v.compile(&ResponseFormat::JsonSchema(more)).unwrap_err().to_string();
    assert!(e.contains("5000 properties"), "{e}");
}
