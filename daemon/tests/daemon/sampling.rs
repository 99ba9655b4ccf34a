//! Sampling options that llama.cpp implements, checked against llama-server on the default
//! model: the repetition penalty (Ollama's `repeat_penalty`, which its clients send at 1.1 by
//! default, and `repeat_last_n`) gives llama-server's greedy answer through Ollama's route and
//! OpenAI's.

use super::remote::{free_port, llama_server, spawn_llama_server, tcp_http};
use super::*;

#[test]
fn the_repetition_penalty_is_llama_cpps() {
    let Some(bin) = llama_server() else {
        eprintln!("skipped: no llama-server (tests/build-llama-server builds one)");
        return;
    };
    let dir = scratch("repeat-penalty");
    let port = free_port();
    let server = spawn_llama_server(&bin, &model(), port, &dir, &[]);
    let d = Daemon::start(&dir, "", &[]);
    // A prompt whose plain answer repeats its own words ("blue", twice "a bit of a
    // blue-geek"), which each penalty changes from the first token on, and whose 16-token
    // answers have no near-ties for the numerics of any of the kernel tables (scalar, AVX2,
    // AVX-512; each checked) to split differently from llama.cpp's. (24 tokens of the earlier
    // "quick brown fox" prompt came within 0.03 nats of a tie that the tables split three ways.)
    let prompt = "My favourite colours are red, green and blue. My favourite colour is";
    let json = |s: &str| -> Value { serde_json::from_str(s).unwrap_or_else(|e| panic!("{e}: {s}")) };
    let theirs = |penalty: f64, last_n: i64| -> String {
        let body = serde_json::json!({ "prompt": prompt, "n_predict": 16, "temperature": 0,
            "repeat_penalty": penalty, "repeat_last_n": last_n });
        let (st, out) = tcp_http(port, "POST", "/completion", &body.to_string());
        assert_eq!(st, 200, "{out}");
        json(&out)["content"].as_str().unwrap().to_owned()
    };
    let ollama = |penalty: f64, last_n: i64| -> String {
        let body = serde_json::json!({ "prompt": prompt, "raw": true, "stream": false, "options": {
            "temperature": 0, "num_predict": 16, "repeat_penalty": penalty, "repeat_last_n": last_n } });
        let (st, out) = d.http("POST", "/api/generate", &body.to_string());
        assert_eq!(st, 200, "{out}");
        json(&out)["response"].as_str().unwrap().to_owned()
    };
    let plain = theirs(1.0, 64);
    assert_eq!(ollama(1.0, 64), plain);
    for (penalty, last_n) in [(1.5, 64), (1.3, 8), (1.2, 4096)] {
        let want = theirs(penalty, last_n);
        assert_eq!(ollama(penalty, last_n), want, "Ollama's route, repeat_penalty {penalty} over {last_n}");
        let body = serde_json::json!({ "prompt": prompt, "max_tokens": 16, "temperature": 0,
            "repeat_penalty": penalty, "repeat_last_n": last_n });
        let (st, out) = d.http("POST", "/v1/completions", &body.to_string());
        assert_eq!(st, 200, "{out}");
        assert_eq!(json(&out)["choices"][0]["text"], want.as_str(), "OpenAI's route, {penalty} over {last_n}");
    }
    // Ollama's -1 is the whole context (which 4096 tokens hold here).
    assert_eq!(ollama(1.2, -1), theirs(1.2, 4096));
    assert_ne!(theirs(1.5, 64), plain, "the penalty changes this answer");
    // A strategy that cannot honour it refuses it by name.
    let (st, out) =
        d.http("POST", "/v1/completions", r#"{"prompt": "Hi", "decoder": "greedy", "repeat_penalty": 1.3}"#);
    assert!(st == 400 && out.contains("repeat_penalty"), "{st} {out}");
    drop(server);
    let _ = std::fs::remove_dir_all(dir);
}

/// Every API names a decoding strategy the way the OpenAI routes do (`decoder` and
/// `decoder_params`; Ollama's in `options`): beam search through each is counted under its
/// name, and speculative decoding at temperature 0 answers as greedy; a strategy that does not
/// exist is a 404 naming it (as an unknown model is).
#[test]
fn every_api_names_a_decoding_strategy() {
    let dir = scratch("decoder-apis");
    let d = Daemon::start(&dir, "", &[]);
    let question = r#"[{"role": "user", "content": "Name a colour."}]"#;
    // At temperature 0 unless `bare` (beam search and greedy take no temperature).
    let bodies = |decoder: &str, params: &str, bare: bool| {
        let t = if bare { "" } else { r#", "temperature": 0"# };
        let ask = format!(r#""decoder": "{decoder}", "decoder_params": {params}{t}"#);
        [
            ("/v1/chat/completions", format!(r#"{{"messages": {question}, "max_tokens": 8, {ask}}}"#)),
            (
                "/api/chat",
                format!(r#"{{"messages": {question}, "stream": false, "options": {{"num_predict": 8, {ask}}}}}"#),
            ),
            ("/v1/messages", format!(r#"{{"messages": {question}, "max_tokens": 8, {ask}}}"#)),
            ("/v1/responses", format!(r#"{{"input": {question}, "max_output_tokens": 8, {ask}}}"#)),
        ]
    };
    let text = |route: &str, v: &Value| -> String {
        match route {
            "/v1/chat/completions" => v["choices"][0]["message"]["content"].as_str().unwrap().to_owned(),
            "/api/chat" => v["message"]["content"].as_str().unwrap().to_owned(),
            "/v1/messages" => v["content"][0]["text"].as_str().unwrap().to_owned(),
            _ => v["output"][0]["content"][0]["text"].as_str().unwrap().to_owned(),
        }
    };
    let beams = || -> f64 {
        let (_, m) = d.http("GET", "/metrics", "");
        m.lines()
            .filter(|l| {
                l.starts_with("inferd_strategy_requests_total") && l.contains("strategy=\"beam\",outcome=\"finished\"")
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    for (i, ((route, beam), ((_, spec), (_, greedy)))) in bodies("beam", r#"{"beam_width": 2}"#, true)
        .into_iter()
        .zip(
            bodies("speculative", r#"{"drafter": "prompt-lookup"}"#, false)
                .into_iter()
                .zip(bodies("greedy", "{}", true)),
        )
        .enumerate()
    {
        let (st, b) = d.http("POST", route, &beam);
        assert_eq!(st, 200, "{route}: {b}");
        // Counted when the request retires, which may be just after its answer went out.
        wait_for("the beam search count", Duration::from_secs(10), || beams() == (i + 1) as f64);
        let (st, s) = d.http("POST", route, &spec);
        assert_eq!(st, 200, "{route}: {s}");
        let (st, g) = d.http("POST", route, &greedy);
        assert_eq!(st, 200, "{route}: {g}");
        assert_eq!(text(route, &json(&s)), text(route, &json(&g)), "{route}: speculative at temperature 0 is greedy");
    }
    for (route, body) in bodies("no-such-strategy", "{}", false) {
        let (st, b) = d.http("POST", route, &body);
        assert!(st == 404 && b.contains("no-such-strategy"), "{route}: {st} {b}");
    }
    drop(d);
    let _ = std::fs::remove_dir_all(dir);
}
