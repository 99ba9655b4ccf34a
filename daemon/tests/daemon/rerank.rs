//! Reranking (`/v1/rerank` and its other spellings) on tiny rerankers of Qwen3's form (rank
//! pooling, a yes/no head; written by `tests/reference/tiny_models.py rerankers`, one with a
//! `rerank` prompt template and one without), checked against llama-server `--reranking` on
//! the same files: the same prompt tokens, the same scores and order, in llama-server's,
//! Jina's, Cohere's and TEI's shapes; through a remote model too; and the refusals.

use super::remote::{free_port, llama_server, spawn_llama_server, tcp_http};
use super::*;

/// The two tiny rerankers, written into `dir`: (with a template, without).
fn tiny_rerankers(dir: &Path) -> (PathBuf, PathBuf) {
    tiny_models("rerankers", dir);
    (dir.join("tiny-qwen3-rerank.gguf"), dir.join("tiny-qwen3-rerank-bare.gguf"))
}

/// `(index, score)` of each result of a Jina/llama-server answer (`score_key`) or a TEI one.
fn ranked(v: &Value, score_key: &str) -> Vec<(u64, f64)> {
    let results = v.get("results").unwrap_or(v).as_array().unwrap_or_else(|| panic!("no results: {v}"));
    results.iter().map(|r| (r["index"].as_u64().unwrap(), r[score_key].as_f64().unwrap())).collect()
}

/// The same documents in the same order, with scores (probabilities) whose log-odds are as
/// close as the tiny models' logits are to llama.cpp's (`tests/e2e/reference.rs`: random
/// weights make them ill-conditioned; the head's own matrix is Q8_0, which llama.cpp
/// multiplies with a Q8_0-quantized state where this computes in f32).
fn same(ours: &[(u64, f64)], theirs: &[(u64, f64)], what: &str) {
    const TINY_LOGIT_TOL: f64 = 0.25;
    let logit = |p: f64| (p / (1.0 - p)).ln();
    assert_eq!(ours.len(), theirs.len(), "{what}: {ours:?} vs {theirs:?}");
    for (o, t) in ours.iter().zip(theirs) {
        let close = (logit(o.1) - logit(t.1)).abs() <= TINY_LOGIT_TOL;
        assert!(o.0 == t.0 && close, "{what}: {ours:?} vs llama-server's {theirs:?}");
    }
}

#[test]
fn rerank_scores_are_llama_servers() {
    let Some(bin) = llama_server() else {
        eprintln!("skipped: no llama-server (tests/build-llama-server builds one)");
        return;
    };
    let dir = scratch("rerank");
    let (templated, bare) = tiny_rerankers(&dir);
    let port = free_port();
    let cfg = format!(
        "[[model]]\nname = \"rr\"\npath = \"{}\"\n[[model]]\nname = \"rr-bare\"\npath = \"{}\"\n\
         [[model]]\nname = \"smol\"\npath = \"{}\"\n\
         [[model]]\nname = \"cpp-rr\"\nupstream = \"http://127.0.0.1:{port}/v1\"\nupstream_model = \"rr\"\n",
        templated.display(),
        bare.display(),
        model()
    );
    let d = Daemon::start(&dir, &cfg, &[]);
    let query = "the cat";
    let docs = ["a cat sat on the mat", "dogs bark loudly at night", "the the cat", "xyz", "The Cat."];
    let body = |model: &str, extra: &str| {
        format!(
            r#"{{"model": "{model}", "query": "{query}", "documents": {}{extra}}}"#,
            serde_json::to_string(&docs).unwrap()
        )
    };
    for (file, name) in [(&templated, "rr"), (&bare, "rr-bare")] {
        let server = spawn_llama_server(&bin, file.to_str().unwrap(), port, &dir, &["--reranking"]);
        let (st, theirs) = tcp_http(port, "POST", "/v1/rerank", &body(name, ""));
        assert_eq!(st, 200, "{theirs}");
        let theirs = json(&theirs);
        let (st, ours) = d.http("POST", "/v1/rerank", &body(name, ""));
        assert_eq!(st, 200, "{ours}");
        let ours = json(&ours);
        same(&ranked(&ours, "relevance_score"), &ranked(&theirs, "relevance_score"), name);
        // The same prompts, token for token in number.
        assert_eq!(ours["usage"]["prompt_tokens"], theirs["usage"]["prompt_tokens"], "{name}: {ours} {theirs}");
        assert!(ours["model"] == name && ours["object"] == "list", "{ours}");
        let scores: Vec<f64> = ranked(&ours, "relevance_score").iter().map(|r| r.1).collect();
        assert!(scores.windows(2).all(|w| w[0] >= w[1]) && scores[0] - scores[scores.len() - 1] > 0.05, "{scores:?}");

        // top_n, documents given back (Jina's and Cohere's `return_documents`, Cohere's
        // `{"text"}` documents), and llama-server's other spellings.
        let (_, top) = tcp_http(port, "POST", "/rerank", &body(name, r#", "top_n": 2"#));
        let cohere = format!(
            r#"{{"model": "{name}", "query": "{query}", "documents": {}, "top_n": 2, "return_documents": true}}"#,
            serde_json::to_string(&docs.iter().map(|t| serde_json::json!({ "text": t })).collect::<Vec<_>>()).unwrap()
        );
        for path in ["/rerank", "/v1/reranking", "/reranking"] {
            let (st, ours) = d.http("POST", path, &cohere);
            assert_eq!(st, 200, "{path}: {ours}");
            let ours = json(&ours);
            same(&ranked(&ours, "relevance_score"), &ranked(&json(&top), "relevance_score"), path);
            for r in ours["results"].as_array().unwrap() {
                assert_eq!(r["document"]["text"], docs[r["index"].as_u64().unwrap() as usize], "{ours}");
            }
        }
        // Hugging Face TEI's shape.
        let tei =
            format!(r#"{{"model": "{name}", "query": "{query}", "texts": ["a cat", "dogs"], "return_text": true}}"#);
        let (_, theirs) = tcp_http(port, "POST", "/rerank", &tei);
        let (st, ours) = d.http("POST", "/rerank", &tei);
        assert_eq!(st, 200, "{ours}");
        let (ours, theirs) = (json(&ours), json(&theirs));
        same(&ranked(&ours, "score"), &ranked(&theirs, "score"), "TEI");
        assert_eq!(ours[0]["text"], theirs[0]["text"], "{ours}");

        if name == "rr" {
            // A remote model's rerank is its upstream's.
            let (st, via) = d.http("POST", "/v1/rerank", &body("cpp-rr", ""));
            assert_eq!(st, 200, "{via}");
            same(
                &ranked(&json(&via), "relevance_score"),
                &ranked(&theirs_of(port, &body(name, "")), "relevance_score"),
                "remote",
            );
        }
        drop(server);
    }

    // What is no rerank is refused by name: a model that is no reranker, a reranker asked for
    // embeddings, bodies without what a rerank needs.
    let (st, b) = d.http("POST", "/v1/rerank", &body("smol", ""));
    assert!(st == 400 && b.contains("smol is not a reranker"), "{st} {b}");
    let (st, b) = d.http("POST", "/v1/embeddings", r#"{"model": "rr", "input": "the cat"}"#);
    assert!(st == 400 && b.contains("rr is a reranker"), "{st} {b}");
    for (bad, names) in [
        (r#"{"model": "rr", "documents": ["a"]}"#, "query"),
        (r#"{"model": "rr", "query": "q", "documents": []}"#, "documents"),
        (r#"{"model": "rr", "query": "q", "documents": ["a"], "top_n": -1}"#, "top_n"),
    ] {
        let (st, b) = d.http("POST", "/v1/rerank", bad);
        assert!(st == 400 && b.contains(names), "{bad}: {st} {b}");
    }
    // A document longer than the context is a 413 naming it, and the engine serves on.
    let long = format!(r#"{{"model": "rr", "query": "q", "documents": ["a", "{}"]}}"#, "cat ".repeat(400));
    let (st, b) = d.http("POST", "/v1/rerank", &long);
    assert!(st == 413 && b.contains("document 1 with the query is"), "{st} {b}");
    let (st, b) = d.http("POST", "/v1/rerank", &body("rr", ""));
    assert_eq!(st, 200, "{b}");
    drop(d);
    let _ = std::fs::remove_dir_all(dir);
}

fn theirs_of(port: u16, body: &str) -> Value {
    let (st, b) = tcp_http(port, "POST", "/v1/rerank", body);
    assert_eq!(st, 200, "{b}");
    json(&b)
}
