//! A soak: socket and D-Bus clients at once for `INFERD_SOAK_SECS` seconds (20 in the suite;
//! `tests/bench/soak` runs ten minutes), in a KV cache small enough that requests are preempted
//! and recomputed: whole and streamed answers, greedy, beam search, speculative decoding,
//! n = 2 sampled with a seed, chat, background priority, streams whose clients leave after the
//! first chunk, prompts longer than the cache. Every answer that comes is the text the same
//! request gets alone; every refusal is an explicit status; at the end every KV block is free
//! or cached, no user holds a place, and the daemon's memory stopped growing after warm-up.

use super::dbus::Bus;
use super::*;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// The requests the clients send: (route, body without `stream`, streamable).
fn kinds() -> Vec<(&'static str, Value, bool)> {
    use serde_json::json;
    let p = ["The capital of France is", "Once upon a time, in a small village,", "The three primary colors are"];
    vec![
        ("/v1/completions", json!({"prompt": p[0], "max_tokens": 24, "temperature": 0}), true),
        (
            "/v1/completions",
            json!({"prompt": p[1], "max_tokens": 24, "temperature": 0, "priority": "background"}),
            true,
        ),
        (
            "/v1/completions",
            json!({"prompt": p[2], "max_tokens": 12, "decoder": "beam", "decoder_params": {"beam_width": 3}}),
            false,
        ),
        (
            "/v1/completions",
            json!({"prompt": p[1], "max_tokens": 24, "decoder": "speculative", "decoder_params": {"drafter": "model", "temperature": 0}}),
            true,
        ),
        ("/v1/completions", json!({"prompt": p[2], "max_tokens": 16, "n": 2, "temperature": 0.8, "seed": 11}), false),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Name a fruit."}], "max_tokens": 16, "temperature": 0}),
            true,
        ),
    ]
}

/// The text of every choice of an answer, whole (`choices[i].text` or `.message.content`) or
/// streamed (SSE chunks, in order per choice).
fn texts(body: &str, streamed: bool) -> Option<Vec<String>> {
    let mut out: Vec<String> = Vec::new();
    let mut put = |c: &Value| {
        let i = c["index"].as_u64().unwrap_or(0) as usize;
        if out.len() <= i {
            out.resize(i + 1, String::new());
        }
        let t =
            c["text"].as_str().or_else(|| c["delta"]["content"].as_str()).or_else(|| c["message"]["content"].as_str());
        out[i].push_str(t.unwrap_or(""));
    };
    if !streamed {
        let v: Value = serde_json::from_str(body).ok()?;
        v["choices"].as_array()?.iter().for_each(&mut put);
        return Some(out);
    }
    let mut done = false;
    for line in body.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if line == "[DONE]" {
            done = true;
            break;
        }
        let v: Value = serde_json::from_str(line).ok()?;
        if v.get("error").is_some() {
            return None;
        }
        v["choices"].as_array()?.iter().for_each(&mut put);
    }
    done.then_some(out)
}

fn with_stream(body: &Value, stream: bool) -> String {
    let mut b = body.clone();
    b["stream"] = Value::Bool(stream);
    b.to_string()
}

#[derive(Debug, Default)]
struct Tally {
    same: u64,
    refused: std::collections::BTreeMap<u16, u64>,
    left: u64,
    too_long: u64,
    dbus_same: u64,
    dbus_refused: u64,
    wrong: Vec<String>,
}

#[test]
fn a_soak_of_mixed_clients_loses_nothing_and_leaks_nothing() {
    let secs: u64 = std::env::var("INFERD_SOAK_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(20);
    let dir = scratch("soak");
    let bus = Bus::start(&dir);
    let m = model();
    let cfg = format!(
        "[limits]\nmax_requests_per_user = 12\n\n[[model]]\npath = \"{m}\"\nkv_cache_mib = 3\ndraft = \"{m}\"\n"
    );
    let d = Daemon::start(&dir, &cfg, &[("DBUS_SESSION_BUS_ADDRESS", &bus.address)]);
    bus.wait_for_name();
    // Each request alone first: the texts every later answer must equal.
    let kinds = kinds();
    let alone: Vec<Vec<String>> = kinds
        .iter()
        .map(|(route, body, _)| {
            let (st, out) = d.http("POST", route, &with_stream(body, false));
            assert_eq!(st, 200, "{out}");
            texts(&out, false).unwrap()
        })
        .collect();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let conn =
        rt.block_on(async { zbus::connection::Builder::address(bus.address.as_str()).unwrap().build().await.unwrap() });
    let complete = |conn: &zbus::Connection| {
        let opts = std::collections::HashMap::from([
            ("max_tokens".to_string(), zbus::zvariant::Value::U32(20)),
            ("temperature".to_string(), zbus::zvariant::Value::F64(0.0)),
        ]);
        rt.block_on(super::dbus::complete(conn, "The capital of France is", opts))
    };
    let dbus_alone = complete(&conn).unwrap();
    let long = serde_json::json!({ "prompt": "word ".repeat(2000), "max_tokens": 8 }).to_string();

    let stop = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Mutex::new(Tally::default()));
    let pid = d.child.id();
    let rss = Arc::new(Mutex::new(Vec::new()));
    let sampler = {
        let (stop, rss) = (Arc::clone(&stop), Arc::clone(&rss));
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                rss.lock().unwrap().push(rss_mib(pid));
                std::thread::sleep(Duration::from_millis(500));
            }
        })
    };
    let clients: Vec<_> = (0..4u64)
        .map(|c| {
            let (stop, tally, socket) = (Arc::clone(&stop), Arc::clone(&tally), d.socket.clone());
            let (kinds, alone, long) = (kinds.clone(), alone.clone(), long.clone());
            std::thread::spawn(move || {
                let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ (c + 1);
                let mut next = move |n: u64| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x % n
                };
                while !stop.load(Ordering::Relaxed) {
                    let k = next(kinds.len() as u64) as usize;
                    let (route, body, streamable) = &kinds[k];
                    match next(10) {
                        // A stream whose client leaves after the first chunk.
                        0 | 1 if *streamable => {
                            let b = with_stream(body, true);
                            let mut s = UnixStream::connect(&socket).unwrap();
                            write!(s, "POST {route} HTTP/1.1\r\nHost: inferd\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{b}", b.len()).unwrap();
                            let mut buf = [0u8; 512];
                            let _ = s.read(&mut buf);
                            drop(s);
                            tally.lock().unwrap().left += 1;
                        }
                        2 => {
                            let (st, out) = http(&socket, "POST", "/v1/completions", &long);
                            let mut t = tally.lock().unwrap();
                            if st == 413 {
                                t.too_long += 1;
                            } else {
                                t.wrong.push(format!("a prompt longer than the cache: {st} {out}"));
                            }
                        }
                        op => {
                            let streamed = *streamable && op % 2 == 0;
                            let (st, out) = http(&socket, "POST", route, &with_stream(body, streamed));
                            let mut t = tally.lock().unwrap();
                            match (st, texts(&out, streamed)) {
                                (200, Some(got)) if got == alone[k] => t.same += 1,
                                (429 | 503, _) => *t.refused.entry(st).or_default() += 1,
                                _ => t.wrong.push(format!("{route} {body} stream {streamed}: {st} {out} (alone: {:?})", alone[k])),
                            }
                        }
                    }
                }
            })
        })
        .collect();
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(secs) {
        let r = complete(&conn);
        let mut t = tally.lock().unwrap();
        match r {
            Ok(text) if text == dbus_alone => t.dbus_same += 1,
            Ok(text) => t.wrong.push(format!("D-Bus Complete: {text:?}, alone {dbus_alone:?}")),
            Err(e) if e.to_string().contains("in flight") || e.to_string().contains("shutting") => t.dbus_refused += 1,
            Err(e) => t.wrong.push(format!("D-Bus Complete failed: {e}")),
        }
    }
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.join().unwrap();
    }
    sampler.join().unwrap();
    let idle = Instant::now();
    wait_for("the engine to go idle with every block back", Duration::from_secs(30), || {
        let s = d.status();
        if idle.elapsed() > Duration::from_secs(25) {
            eprintln!("{}", s["models"][0]);
        }
        let m = &s["models"][0];
        let (r, kv) = (&m["requests"], &m["kv_blocks"]);
        r["running"] == 0
            && r["waiting"] == 0
            && kv["free"] == kv["total"] // (free counts the cached blocks, which are evictable)
            && s["requests_per_user"].as_object().unwrap().is_empty()
    });
    let s = d.status();
    let t = tally.lock().unwrap();
    let rss = rss.lock().unwrap();
    let q = rss.len() / 4;
    let mean = |w: &[u64]| w.iter().sum::<u64>() as f64 / w.len().max(1) as f64;
    let (warm, end) = (mean(&rss[q..2 * q]), mean(&rss[3 * q..]));
    eprintln!(
        "soak {secs} s: {} answers equal to alone, {} D-Bus equal, refused {:?} (+{} on D-Bus), {} streams left early, {} too long; preempted {}, cancelled {}; RSS {:.0} MiB after warm-up, {:.0} MiB at the end (max {} MiB)",
        t.same,
        t.dbus_same,
        t.refused,
        t.dbus_refused,
        t.left,
        t.too_long,
        s["models"][0]["requests"]["preempted"],
        s["models"][0]["requests"]["cancelled"],
        warm,
        end,
        rss.iter().max().unwrap_or(&0)
    );
    assert!(t.wrong.is_empty(), "{} wrong answers; the first: {}", t.wrong.len(), t.wrong[0]);
    assert!(t.same > 0 && t.dbus_same > 0 && t.left > 0 && t.too_long > 0);
    assert!(end - warm < 24.0, "RSS grew from {warm:.0} to {end:.0} MiB after warm-up");
    drop(d);
    drop(bus);
    let _ = std::fs::remove_dir_all(dir);
}
