//! Remote models: a `[[model]]` served by another inferd over loopback TCP, reached through the
//! front daemon's socket with the same answers, limits and cancellation, and an unreachable
//! upstream that is an explicit error.

use super::*;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn text(body: &str) -> String {
    let v: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"));
    v["choices"][0]["text"].as_str().or(v["choices"][0]["message"]["content"].as_str()).unwrap().to_owned()
}

fn in_flight(d: &Daemon) -> u64 {
    d.status()["requests_per_user"].as_object().unwrap().values().filter_map(Value::as_u64).sum()
}

#[test]
fn a_remote_model_answers_as_its_upstream_does_and_cancels_there() {
    let port = free_port();
    let up = Daemon::start(&scratch("remote-upstream"), &format!("[server]\ntcp = \"127.0.0.1:{port}\"\n"), &[]);
    let up_name = up.status()["models"][0]["name"].as_str().unwrap().to_owned();
    let dead = free_port();
    let front = Daemon::start(
        &scratch("remote-front"),
        &format!(
            "[[model]]\nname = \"far\"\nupstream = \"http://127.0.0.1:{port}/v1/\"\nupstream_model = \"{up_name}\"\n\n\
             [[model]]\nname = \"gone\"\nupstream = \"http://127.0.0.1:{dead}/v1\"\n\n\
             [[model]]\nname = \"spare\"\nupstream = \"http://127.0.0.1:{dead}/v1\"\nfallback = \"{up_name}\"\n\n\
             [[model]]\npath = \"{}\"\n\n[limits]\nmax_requests_per_user = 2\n",
            model()
        ),
        &[],
    );
    let models: Value = serde_json::from_str(&front.http("GET", "/v1/models", "").1).unwrap();
    let far = models["data"].as_array().unwrap().iter().find(|m| m["id"] == "far").expect("far is listed");
    assert_eq!((far["remote"].as_bool(), far["owned_by"].as_str()), (Some(true), Some("remote")));

    // The same answer as the upstream's own, whole and streamed, completion and chat.
    let completion = |model: &str| {
        format!(r#"{{"model": "{model}", "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}}"#)
    };
    let (code, direct) = up.http("POST", "/v1/completions", &completion(&up_name));
    assert_eq!(code, 200, "{direct}");
    let (code, via) = front.http("POST", "/v1/completions", &completion("far"));
    assert_eq!(code, 200, "{via}");
    assert_eq!(text(&via), text(&direct));
    let chat = |model: &str| {
        format!(
            r#"{{"model": "{model}", "messages": [{{"role": "user", "content": "Name a colour."}}], "max_tokens": 10, "temperature": 0, "stream": true}}"#
        )
    };
    let (_, direct) = up.http("POST", "/v1/chat/completions", &chat(&up_name));
    let (code, via) = front.http("POST", "/v1/chat/completions", &chat("far"));
    assert_eq!(code, 200, "{via}");
    let deltas = |body: &str| -> String {
        body.lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter(|l| *l != "[DONE]")
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter_map(|v| v["choices"][0]["delta"]["content"].as_str().map(str::to_owned))
            .collect()
    };
    assert!(!deltas(&direct).is_empty());
    assert_eq!(deltas(&via), deltas(&direct));
    assert!(via.contains("data: [DONE]"));

    // A client that leaves mid-stream cancels the upstream's request.
    let long = r#"{"model": "far", "prompt": "Count from one to one thousand: one, two, three,", "max_tokens": 3000, "temperature": 0, "stream": true}"#;
    let mut s = open_stream(&front.socket, long);
    let mut first = [0u8; 64];
    s.read_exact(&mut first).unwrap();
    assert_eq!(in_flight(&up), 1);
    drop(s);
    let t0 = Instant::now();
    wait_for("the upstream to cancel", Duration::from_secs(5), || in_flight(&up) == 0);
    eprintln!("remote: the upstream freed the request {:?} after the client left", t0.elapsed());
    wait_for("the front to free the user's place", Duration::from_secs(5), || in_flight(&front) == 0);

    // The per-user limit counts remote requests too.
    let held = [open_stream(&front.socket, long), open_stream(&front.socket, long)];
    let (code, body) = front.http("POST", "/v1/completions", &completion("far"));
    assert_eq!(code, 429, "{body}");
    drop(held);
    wait_for("the held places to come back", Duration::from_secs(5), || in_flight(&front) == 0);

    // An upstream nobody listens on is a 502 that says so, at once.
    let t0 = Instant::now();
    let (code, body) = front.http("POST", "/v1/completions", &completion("gone"));
    assert_eq!(code, 502, "{body}");
    assert!(body.contains(&format!("127.0.0.1:{dead}")), "{body}");
    assert!(t0.elapsed() < Duration::from_secs(5));
    // With a fallback, the local model answers while the upstream is down.
    let (code, body) = front.http("POST", "/v1/completions", &completion("spare"));
    assert_eq!(code, 200, "{body}");
    assert_eq!(text(&body), text(&front.http("POST", "/v1/completions", &completion(&up_name)).1));
    // Per remote model in /metrics: requests, errors, time to the upstream's answer.
    let metrics = front.http("GET", "/metrics", "").1;
    for line in ["inferd_upstream_requests_total{model=\"gone\"} 1", "inferd_upstream_errors_total{model=\"gone\"} 1"] {
        assert!(metrics.contains(line), "{line} in {metrics}");
    }
    assert!(metrics.contains("inferd_upstream_response_seconds_count{model=\"far\"} 5"), "{metrics}");
    assert!(metrics.contains("inferd_upstream_fallbacks_total{model=\"spare\"} 1"), "{metrics}");
    // The local model is served beside them.
    assert_eq!(front.http("POST", "/v1/completions", &completion(&up_name)).0, 200);
}
