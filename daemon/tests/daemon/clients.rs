//! Clients nobody here wrote or that users run: the official OpenAI and Ollama Python clients
//! (chat, structured output, tools, embeddings), inferctl.

use super::*;

/// Runs `tests/python/SCRIPT` (the official clients; tests/run installs them) against the
/// daemon's socket and parses the JSON it prints.
pub(super) fn python_client(d: &Daemon, script: &str) -> Value {
    python_client_with(d, script, &[])
}

/// [`python_client`] with more arguments after the socket.
pub(super) fn python_client_with(d: &Daemon, script: &str, args: &[&str]) -> Value {
    let pylib = test_pythonpath();
    let path = format!("{}/../tests/python/{script}", env!("CARGO_MANIFEST_DIR"));
    let out = Command::new("python3").arg(&path).arg(&d.socket).args(args).env("PYTHONPATH", &pylib).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{script} (tests/run installs its packages into {pylib}):\n{stderr}");
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn the_official_openai_python_client_works_unchanged() {
    let dir = scratch("openai");
    let d = Daemon::start(&dir, "", &[]);
    let v = python_client(&d, "openai_client.py");
    assert_eq!(v["models"][0], "SmolLM2-135M-Instruct.Q4_1");
    assert_eq!(v["completion"], " Paris.\n");
    assert_eq!(v["completion_stream"], " Paris.\n");
    assert!(v["chat"].as_str().unwrap().contains("Paris"), "{v}");
    assert_eq!(v["chat"], v["chat_stream"]);
    assert_eq!(v["bad_status"], 400);
    assert_eq!(v["chat_parts"], v["chat"], "text content parts are the string content");
    let u = &v["unbounded"];
    assert!(
        u["finish"] == "stop" && u["tokens"].as_u64().unwrap() > 16,
        "no max_tokens runs to the end of the turn: {u}"
    );
    assert!(u["text"].as_str().unwrap().contains("evaporation"), "{u}");
    assert_eq!(v["max_completion_tokens"], serde_json::json!({ "finish": "length", "tokens": 5 }));
    let su = &v["stream_usage"];
    assert!(su["last_choices"] == 0 && su["tokens"] == 5 && !su["text"].as_str().unwrap().is_empty(), "{su}");
    let st = &v["speculative_t0"];
    assert_eq!(st["speculative"], st["greedy"], "speculative decoding at temperature 0 is greedy");
    assert_eq!(v["user_ok"], "length");
    let lp = &v["logprobs"];
    let values: Vec<f64> = lp["values"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
    assert!(values.len() == 5 && values.iter().all(|x| *x <= 0.0 && *x > -30.0), "{lp}");
    let joined: String = lp["tokens"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
    assert_eq!(joined, lp["text"].as_str().unwrap(), "the tokens spell the text");
    assert_eq!(v["logprobs_stream"], lp["values"], "streamed logprobs are the whole answer's");
    let cl = &v["completion_logprobs"];
    assert_eq!(cl["tokens"].as_array().unwrap().len(), 3, "{cl}");
    assert_eq!(
        cl["tokens"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect::<String>(),
        cl["text"].as_str().unwrap()
    );
    top_logprobs(&v["top_logprobs"]);
    let refused = &v["refused"];
    for (name, says) in [
        ("functions", "functions is not supported by inferd yet (the deprecated functions API; send tools)"),
        ("response_format", "response_format.type must be text, json_object or json_schema"),
        ("image_url", "image URLs are not fetched by this daemon ([server] fetch_images is off)"),
        ("colour", "colour is not supported by inferd"),
        ("stream_options", "stream_options is only allowed when stream is true"),
        ("top_logprobs_alone", "top_logprobs needs logprobs: true"),
        ("top_logprobs_21", "top_logprobs must be an integer from 0 to 20"),
    ] {
        let r = &refused[name];
        assert!(r[0] == 400 && r[1].as_str().unwrap().contains(says), "{name}: {r}");
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// Checks what the OpenAI client read of `top_logprobs` (tests/python/openai_client.py): five
/// alternatives per token, most probable first, of one distribution with the token's own
/// log-probability; greedy's token is its first alternative; speculative decoding at
/// temperature 0 reports greedy decoding's numbers; streaming reports what the whole answer does.
fn top_logprobs(v: &serde_json::Value) {
    let num = |x: &serde_json::Value| x.as_f64().unwrap();
    for name in ["greedy", "speculative", "nucleus", "min_p", "beam", "greedy_stream"] {
        let content = v[name]["content"].as_array().unwrap();
        assert_eq!(content.len(), 12, "{name}: {v}");
        for e in content {
            let top = e["top"].as_array().unwrap();
            assert_eq!(top.len(), 5, "{name}: {e}");
            let lps: Vec<f64> = top.iter().map(|a| num(&a[1])).collect();
            assert!(lps.windows(2).all(|w| w[0] >= w[1]) && lps[0] <= 0.0, "{name}: sorted: {e}");
            assert!(lps.iter().map(|x| x.exp()).sum::<f64>() <= 1.0 + 1e-4, "{name}: one distribution: {e}");
            // A token among its alternatives has the same log-probability there.
            if let Some(a) = top.iter().find(|a| a[0] == e["token"]) {
                assert!((num(&a[1]) - num(&e["logprob"])).abs() < 1e-6, "{name}: {e}");
            } else {
                assert!(num(&e["logprob"]) <= lps[4] + 1e-6, "{name}: a token less likely than every alternative: {e}");
            }
            if name.starts_with("greedy") || name == "speculative" {
                assert_eq!(top[0][0], e["token"], "{name}: greedy takes the most probable token: {e}");
            }
        }
    }
    let (g, s) = (v["greedy"]["content"].as_array().unwrap(), v["speculative"]["content"].as_array().unwrap());
    for (a, b) in g.iter().zip(s) {
        assert_eq!(a["token"], b["token"]);
        assert!((num(&a["logprob"]) - num(&b["logprob"])).abs() < 1e-3, "speculative at temperature 0: {a} {b}");
    }
    assert_eq!(v["greedy_stream"]["content"], v["greedy"]["content"], "streamed as whole");
    let c = &v["completion"];
    let tops = c["top"].as_array().unwrap();
    assert_eq!(tops.len(), 3, "{c}");
    for (i, t) in tops.iter().enumerate() {
        let t = t.as_object().unwrap();
        assert!(!t.is_empty() && t.len() <= 3, "{c}");
        let best = t.values().map(num).fold(f64::NEG_INFINITY, f64::max);
        assert!((best - num(&c["values"][i])).abs() < 1e-6, "greedy's token is the most probable: {c}");
    }
}

/// Structured output through the official clients (tests/python/structured.py): a corpus of
/// real-world JSON schemas, streamed and whole, through every strategy, through the OpenAI
/// client's `parse` and Ollama's `format`; each answer checked by the jsonschema package.
#[test]
fn structured_output_validates_through_the_official_clients() {
    let dir = scratch("structured");
    let d = Daemon::start(&dir, "", &[]);
    let v = python_client(&d, "structured.py");
    let corpus = v["corpus"].as_array().unwrap();
    assert_eq!(corpus.len(), 11, "{v}");
    for entry in corpus {
        let tries = entry["tries"].as_array().unwrap();
        let last = tries.last().unwrap();
        assert_eq!(last["finish"], "stop", "{}: no answer ended in {} tries: {entry}", entry["name"], tries.len());
        for t in tries.iter().filter(|t| t["finish"] == "stop") {
            assert!(t["error"].is_null(), "{}: {t}", entry["name"]);
        }
    }
    let stream = &v["stream"];
    assert!(stream["finish"] == "stop" && stream["error"].is_null(), "{stream}");
    for (name, s) in v["strategies"].as_object().unwrap() {
        assert!(s["finish"] == "stop" && s["error"].is_null(), "{name}: {s}");
    }
    assert_eq!(v["strategies"].as_object().unwrap().len(), 4);
    assert_eq!(v["strategies"]["speculative"]["text"], stream["text"], "speculative at temperature 0 is greedy");
    assert_eq!(v["parse"], serde_json::json!({ "type": "Owner", "pets": 2, "finish": "stop" }));
    let tries = v["json_object"].as_array().unwrap();
    assert_eq!(tries.last().unwrap()["finish"], "stop", "json_object: no answer ended: {tries:?}");
    for t in tries.iter().filter(|t| t["finish"] == "stop") {
        assert_eq!(t["is_object"], true, "json_object: {t}");
    }
    let u = &v["unenforceable"];
    assert!(u["status"] == 400 && u["param"] == "response_format", "{u}");
    assert!(u["message"].as_str().unwrap().contains("minimum (5) is greater than maximum (1)"), "{u}");
    let os = &v["ollama_schema"];
    assert!(os["error"].is_null() && os["done_reason"] == "stop", "{os}");
    let tries = v["ollama_json"].as_array().unwrap();
    assert_eq!(tries.last().unwrap()["done_reason"], "stop", "ollama json: no answer ended: {tries:?}");
    for t in tries.iter().filter(|t| t["done_reason"] == "stop") {
        assert_eq!(t["is_object"], true, "ollama json: {t}");
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// Tool calling through the official clients (tests/python/tools.py) on the default model,
/// whose template has no tools (the Hermes syntax described in a system message): required and
/// named calls whole and streamed, their arguments checked against the tool's schema by the
/// jsonschema package, the result sent back, refusals, and Ollama's tools.
#[test]
fn tool_calls_round_trip_through_the_official_clients() {
    let dir = scratch("tools");
    let d = Daemon::start(&dir, "", &[]);
    let v = python_client(&d, "tools.py");
    for (case, tool) in [("required", None), ("named", Some("get_time"))] {
        let r = &v[case];
        assert!(r["finish"] == "tool_calls" && r["content"].is_null(), "{case}: {r}");
        let calls = r["calls"].as_array().unwrap();
        assert!(!calls.is_empty(), "{case}: {r}");
        for c in calls {
            assert!(c["error"].is_null() && c["type"] == "function", "{case}: {c}");
            assert!(c["id"].as_str().unwrap().starts_with("call_"), "{c}");
            if let Some(t) = tool {
                assert_eq!(c["name"], t, "{case}: {c}");
            }
        }
    }
    let whole: Vec<Value> = v["required"]["calls"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| serde_json::json!({ "name": c["name"], "arguments": c["arguments"] }))
        .collect();
    assert_eq!(v["stream"]["calls"], Value::Array(whole), "streamed deltas give the same calls");
    assert_eq!(v["stream"]["finish"], "tool_calls");
    let rt = &v["round_trip"];
    assert!(rt["finish"] == "stop" && rt["calls"] == 0, "{rt}");
    // The tool's result is in the prompt the model saw: the same conversation with an empty
    // result is that many tokens shorter (what the 135M model then says of it depends on
    // rounding: it may quote the weather or echo the call).
    let (with, without) = (rt["prompt_tokens"].as_u64().unwrap(), rt["prompt_tokens_empty_result"].as_u64().unwrap());
    assert!(with >= without + 10, "the tool's result reached the model: {rt}");
    assert!(!rt["content"].as_str().unwrap_or_default().is_empty(), "{rt}");
    let auto = &v["auto"];
    assert!(auto["calls"].as_array().unwrap().iter().all(|c| c["error"].is_null()), "{auto}");
    assert!(!auto["content"].as_str().unwrap_or_default().is_empty() || auto["finish"] == "tool_calls", "{auto}");
    for (name, says) in [
        ("unknown_tool", "tool_choice names \"nope\", which is not among the tools"),
        ("no_tools", "the request has no tools"),
        ("bad_tool", "tools[0].function.name must be"),
        ("with_response_format", "cannot both shape the answer"),
    ] {
        let r = &v["refused"][name];
        assert!(r[0] == 400 && r[1].as_str().unwrap().contains(says), "{name}: {r}");
    }
    let oa = &v["ollama_auto"];
    assert!(oa["calls"].as_array().unwrap().iter().all(|c| c["name"] == "get_weather"), "{oa}");
    let ort = &v["ollama_round_trip"];
    assert!(ort["done_reason"] == "stop" && ort["content"].as_str().unwrap().contains("sunny"), "{ort}");
    let _ = std::fs::remove_dir_all(dir);
}

/// Anthropic's Messages API through the official `anthropic` client
/// (tests/python/anthropic_client.py) on the default model: a message whole and streamed gives
/// the OpenAI chat route's answer to the same conversation (one answer pipeline), with the
/// SDK's event sequence; stop sequences, max_tokens, a prefill and `output_config.format` as
/// Anthropic defines them; a
/// forced call whole and streamed as a `tool_use` block whose input validates, and its result
/// sent back; count_tokens counts the prompt each message was answered from; errors in
/// Anthropic's shape.
#[test]
fn the_official_anthropic_client_works_unchanged() {
    let dir = scratch("anthropic");
    let d = Daemon::start(&dir, "", &[]);
    let v = python_client(&d, "anthropic_client.py");
    let (w, oa) = (&v["whole"], &v["openai"]);
    assert!(w["id"].as_str().unwrap().starts_with("msg_") && w["type"] == "message" && w["role"] == "assistant", "{w}");
    assert_eq!(w["model"], "SmolLM2-135M-Instruct.Q4_1");
    assert_eq!(w["text"], oa["text"], "the same answer as the chat route: {v}");
    assert_eq!(w["blocks"], serde_json::json!(["text"]));
    let reason = if oa["finish"] == "length" { "max_tokens" } else { "end_turn" };
    assert_eq!(w["stop_reason"], reason, "{v}");
    assert_eq!((&w["input_tokens"], &w["output_tokens"]), (&oa["prompt_tokens"], &oa["completion_tokens"]));
    let s = &v["stream"];
    assert_eq!((&s["text"], &s["stop_reason"]), (&w["text"], &w["stop_reason"]), "streamed as whole: {v}");
    assert_eq!((&s["input_tokens"], &s["output_tokens"]), (&w["input_tokens"], &w["output_tokens"]));
    let events: Vec<&str> = s["events"].as_array().unwrap().iter().map(|e| e.as_str().unwrap()).collect();
    let first = ["message_start", "content_block_start", "content_block_delta"];
    assert_eq!(&events[..3], &first, "{events:?}");
    assert_eq!(&events[events.len() - 3..], &["content_block_stop", "message_delta", "message_stop"], "{events:?}");
    let ss = &v["stop_sequence"];
    let stop = ss["stop"].as_str().unwrap();
    let text = w["text"].as_str().unwrap();
    assert_eq!(ss["text"].as_str().unwrap(), &text[..text.find(stop).unwrap()], "{ss}");
    assert_eq!((&ss["stop_reason"], &ss["stop_sequence"]), (&Value::from("stop_sequence"), &Value::from(stop)));
    assert_eq!(v["max_tokens"], serde_json::json!({ "stop_reason": "max_tokens", "output_tokens": 3 }));
    let p = &v["prefill"];
    assert_eq!(p["input_tokens"], p["counted"], "{p}");
    assert!(p["counted"].as_u64().unwrap() >= p["counted_without"].as_u64().unwrap() + 5, "{p}");
    assert!(p["text"].as_str().unwrap().contains("Paris"), "the answer goes on from the prefill: {p}");
    assert_eq!(v["count_tokens"], w["input_tokens"]);
    assert!(v["structured"]["error"].is_null(), "output_config.format shapes the answer: {}", v["structured"]);
    let t = &v["tool"];
    assert_eq!(t["stop_reason"], "tool_use", "{t}");
    assert_eq!(t["input_tokens"], t["counted"], "count_tokens counts the tools too: {t}");
    let uses = t["uses"].as_array().unwrap();
    assert!(!uses.is_empty(), "{t}");
    for u in uses {
        assert!(u["name"] == "get_weather" && u["error"].is_null() && !u["id"].as_str().unwrap().is_empty(), "{u}");
    }
    assert!(t["blocks"].as_array().unwrap().iter().all(|b| b == "tool_use"), "a call is no text: {t}");
    let ts = &v["tool_stream"];
    assert_eq!(ts["stop_reason"], "tool_use");
    let whole: Vec<Value> =
        uses.iter().map(|u| serde_json::json!({ "name": u["name"], "input": u["input"] })).collect();
    assert_eq!(ts["uses"], Value::Array(whole), "streamed input_json_delta gives the same calls");
    assert!(ts["events"].as_array().unwrap().iter().any(|e| e == "input_json"), "{ts}");
    let rt = &v["round_trip"];
    assert_eq!(rt["blocks"], serde_json::json!(["text"]), "{rt}");
    assert!(rt["stop_reason"] == "end_turn" || rt["stop_reason"] == "max_tokens", "{rt}");
    let (with, without) = (rt["input_tokens"].as_u64().unwrap(), rt["input_tokens_empty_result"].as_u64().unwrap());
    assert!(with >= without + 10, "the tool's result reached the model: {rt}");
    let e = &v["errors"];
    assert_eq!(
        (&e["unknown_model"]["status"], &e["unknown_model"]["type"]),
        (&Value::from(404), &Value::from("not_found_error")),
        "{e}"
    );
    assert_eq!(
        (&e["image"]["status"], &e["image"]["type"]),
        (&Value::from(400), &Value::from("invalid_request_error"))
    );
    assert!(e["image"]["message"].as_str().unwrap().contains("the image cannot be decoded"), "{e}");
    assert!(e["server_tool"]["message"].as_str().unwrap().contains("web_search_20250305"), "{e}");
    let _ = std::fs::remove_dir_all(dir);
}

/// OpenAI's Responses API through the official `openai` client
/// (tests/python/responses_client.py) on the default model: a response whole and streamed is
/// the chat route's answer to the same conversation, and the SDK accumulates the streamed
/// events into it; `max_output_tokens` makes it incomplete; a JSON schema shapes it; a second
/// turn through `previous_response_id` is the chat route's answer to both turns written out;
/// stored responses are retrieved and deleted, `store: false` keeps none; a forced function
/// call whole and streamed, its output sent back. Stored responses are the user's own: another
/// user (`nobody`, over loopback TCP) can neither read nor delete one, and the files are the
/// daemon's alone.
#[test]
fn the_official_openai_client_speaks_the_responses_api() {
    let dir = scratch("responses");
    let port = super::remote::free_port();
    let d = Daemon::start(&dir, &format!("[server]\ntcp = \"127.0.0.1:{port}\"\n"), &[]);
    let v = python_client(&d, "responses_client.py");
    let (w, c) = (&v["whole"], &v["chat"]);
    assert!(w["id"].as_str().unwrap().starts_with("resp_") && w["object"] == "response", "{w}");
    assert!(!w["text"].as_str().unwrap().is_empty(), "{v}");
    assert_eq!(w["text"], c["text"], "the chat route's answer: {v}");
    assert_eq!((&w["input_tokens"], &w["output_tokens"]), (&c["prompt_tokens"], &c["completion_tokens"]), "{v}");
    assert_eq!(w["items"], serde_json::json!(["message"]));
    assert_eq!(w["status"], if c["finish"] == "length" { "incomplete" } else { "completed" }, "{v}");
    let s = &v["stream"];
    assert_eq!((&s["text"], &s["status"], &s["output_tokens"]), (&w["text"], &w["status"], &w["output_tokens"]), "{v}");
    let events: Vec<&str> = s["events"].as_array().unwrap().iter().map(|e| e.as_str().unwrap()).collect();
    assert_eq!(
        &events[..4],
        ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    );
    assert!(
        events.contains(&"response.output_text.delta") && events.contains(&"response.output_text.done"),
        "{events:?}"
    );
    let last = if s["status"] == "completed" { "response.completed" } else { "response.incomplete" };
    assert_eq!(events.last(), Some(&last), "{events:?}");
    let m = &v["max_output_tokens"];
    assert!(m["status"] == "incomplete" && m["incomplete"] == "max_output_tokens" && m["output_tokens"] == 3, "{m}");
    assert!(v["structured"]["error"].is_null(), "text.format shapes the answer: {}", v["structured"]);
    let cv = &v["conversation"];
    assert_eq!(cv["previous"], cv["first"]["id"]);
    assert!(!cv["second"]["text"].as_str().unwrap().is_empty(), "{cv}");
    assert_eq!(cv["second"]["text"], cv["chat"]["text"], "the stored turn came first: {cv}");
    assert_eq!(cv["second"]["input_tokens"], cv["chat"]["prompt_tokens"], "{cv}");
    assert_eq!(
        v["retrieved"],
        serde_json::json!({ "id": cv["first"]["id"], "text": cv["first"]["text"], "status": cv["first"]["status"] })
    );
    assert_eq!(v["not_stored"], serde_json::json!({ "retrieve": 404, "continue": 404 }));
    assert_eq!(v["deleted"], serde_json::json!({ "retrieve": 404, "again": 404 }));
    let t = &v["tool"];
    let calls = t["calls"].as_array().unwrap();
    assert!(!calls.is_empty() && t["items"].as_array().unwrap().iter().all(|i| i == "function_call"), "{t}");
    for c in calls {
        assert!(
            c["name"] == "get_weather" && c["error"].is_null() && c["call_id"].as_str().unwrap().starts_with("call_"),
            "{c}"
        );
    }
    let whole: Vec<Value> =
        calls.iter().map(|c| serde_json::json!({ "name": c["name"], "arguments": c["arguments"] })).collect();
    assert_eq!(v["tool_stream"]["calls"], Value::Array(whole), "streamed as whole: {v}");
    let rt = &v["round_trip"];
    assert_eq!(rt["items"], serde_json::json!(["message"]), "{rt}");
    let (with, without) = (rt["input_tokens"].as_u64().unwrap(), rt["input_tokens_empty_result"].as_u64().unwrap());
    assert!(with >= without + 10, "the call's output reached the model: {rt}");
    let r = &v["refused"];
    assert!(r["web_search"][0] == 400 && r["web_search"][1].as_str().unwrap().contains("web_search tools"), "{r}");
    // An input_image goes where a chat image part goes: undecodable bytes are a 400 saying so.
    assert!(r["image"][0] == 400 && r["image"][1].as_str().unwrap().contains("not an image"), "{r}");
    assert_eq!(r["unknown_previous"][0], 404, "{r}");

    // Another user's stored response is not there for them.
    let id = v["kept"].as_str().unwrap();
    let path = format!("/v1/responses/{id}");
    assert_eq!(d.http("GET", &path, "").0, 200);
    if root_or_skip() {
        for method in ["GET", "DELETE"] {
            let req = format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
            let (st, out) = super::hostile::tcp_exchange_as(65534, port, &req);
            assert_eq!(st, 404, "{method} as nobody: {out}");
        }
        assert_eq!(d.http("GET", &path, "").0, 200, "still kept for its owner");
        let users = dir.join("inferd/responses");
        let mode = std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(users.join("0")).unwrap().permissions());
        assert_eq!(mode & 0o777, 0o700);
        assert!(users.join("0").join(format!("{id}.json")).exists());
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// Embeddings through the official clients (tests/python/embeddings.py): the OpenAI client's
/// default base64 equals floats, token ids equal their text, Ollama's equal OpenAI's, similar
/// sentences are closer than unrelated ones (the numerics against llama.cpp are
/// tests/e2e/embed.rs's).
/// Tool calls of models whose templates write them in the Llama 3.1 convention (a bare JSON
/// object with "parameters") and the Mistral one (`[TOOL_CALLS]` and a list, 9-character
/// ids): the syntax is detected from the template (tests/templates/, set as `chat_template`),
/// the required call is constrained in it and parsed back into `tool_calls`, whole and
/// streamed, and the call with its result renders through the template for the answer.
#[test]
fn tool_calls_in_the_llama3_and_mistral_conventions_of_native_templates() {
    for (name, file) in [("llama3", "llama3-tools.jinja"), ("mistral", "mistral-tools.jinja")] {
        let dir = scratch(&format!("syntax-{name}"));
        let template = format!("{}/../tests/templates/{file}", env!("CARGO_MANIFEST_DIR"));
        let cfg = format!("[[model]]\npath = \"{}\"\nchat_template = \"{template}\"\n", model());
        let d = Daemon::start(&dir, &cfg, &[]);
        // Apps show tool features by Ollama's capabilities: a template that renders tools has them.
        let (_, show) = d.http("POST", "/api/show", "{}");
        let caps: Value = serde_json::from_str::<Value>(&show).unwrap()["capabilities"].clone();
        assert_eq!(caps, serde_json::json!(["completion", "tools"]), "{name}: {show}");
        let v = python_client(&d, "tool_syntaxes.py");
        let whole = &v["whole"];
        assert_eq!(whole["finish"], "tool_calls", "{name}: {v}");
        let calls = whole["calls"].as_array().unwrap();
        assert_eq!(calls.len(), 1, "{name}: {v}");
        assert_eq!(calls[0]["name"], "get_weather");
        let args: Value = serde_json::from_str(calls[0]["arguments"].as_str().unwrap()).unwrap();
        assert!(args["city"].is_string() && args.as_object().unwrap().len() == 1, "{name}: {args}");
        let id = calls[0]["id"].as_str().unwrap();
        if name == "mistral" {
            assert!(id.len() == 9 && id.bytes().all(|b| b.is_ascii_alphanumeric()), "Mistral's ids: {id}");
        }
        assert!(whole["content"].is_null() || whole["content"] == "", "{name}: the call is no content: {v}");
        let stream = &v["stream"];
        assert_eq!(stream["finish"], "tool_calls", "{name}: {v}");
        assert_eq!(stream["calls"][0]["name"], calls[0]["name"]);
        assert_eq!(stream["calls"][0]["arguments"], calls[0]["arguments"], "{name}: streamed as whole");
        // The call and its result render through the template (the prompt grows by them); what
        // this small model answers after them is its own affair.
        let answer = &v["answer"];
        assert!(answer["finish"] == "stop" || answer["finish"] == "length", "{name}: {v}");
        let grown = answer["prompt_tokens"].as_u64().unwrap() - whole["prompt_tokens"].as_u64().unwrap();
        assert!(grown >= 12, "{name}: the call and its result added {grown} tokens: {v}");
        drop(d);
        let _ = std::fs::remove_dir_all(dir);
    }
}

#[test]
fn embeddings_through_the_official_clients() {
    let dir = scratch("embeddings");
    let d = Daemon::start(&dir, "", &[]);
    let v = python_client(&d, "embeddings.py");
    let vecs = |x: &Value| -> Vec<Vec<f64>> {
        x.as_array()
            .unwrap()
            .iter()
            .map(|e| e.as_array().unwrap().iter().map(|f| f.as_f64().unwrap()).collect())
            .collect()
    };
    let all = vecs(&v["default"]);
    assert_eq!(all.len(), 3);
    for e in &all {
        assert_eq!(e.len(), 576, "SmolLM2's hidden size");
        let norm: f64 = e.iter().map(|x| x * x).sum::<f64>().sqrt();
        assert!((norm - 1.0).abs() < 1e-4, "{norm}");
    }
    let close = |a: &[f64], b: &[f64]| a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-6);
    assert!(close(&all[0], &vecs(&serde_json::json!([v["float"]]))[0]), "base64 decodes to the floats");
    assert!(close(&vecs(&serde_json::json!([v["hello_ids"]]))[0], &vecs(&serde_json::json!([v["hello_text"]]))[0]));
    let ollama = vecs(&v["ollama"]);
    assert!(all.iter().zip(&ollama).all(|(a, b)| close(a, b)), "Ollama's embed gives the same vectors");
    assert!(close(&vecs(&serde_json::json!([v["ollama_legacy"]]))[0], &all[0]), "and its legacy /api/embeddings");
    assert_eq!(v["usage"], v["ollama_count"]);
    let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f64>();
    assert!(dot(&all[0], &all[1]) > dot(&all[0], &all[2]) + 0.1, "the two cat sentences are the closest");
    assert_eq!(v["object"], serde_json::json!(["list", "embedding", 0]));
    for (name, says) in [
        ("dimensions", "dimensions must be 576"),
        ("empty", "input is empty"),
        ("format", "encoding_format must be float or base64"),
    ] {
        let r = &v["refused"][name];
        assert!(r[0] == 400 && r[1].as_str().unwrap().contains(says), "{name}: {r}");
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn the_official_ollama_python_client_works_unchanged() {
    let dir = scratch("ollama");
    let d = Daemon::start(&dir, "", &[]);
    let v = python_client(&d, "ollama_client.py");
    assert_eq!(v["tags"], serde_json::json!(["SmolLM2-135M-Instruct.Q4_1:latest"]));
    let details = &v["details"];
    assert!(details["family"] == "llama" && details["format"] == "gguf", "{v}");
    let size = details["parameter_size"].as_str().unwrap();
    let millions: f64 = size.strip_suffix('M').unwrap().parse().unwrap();
    assert!((134.0..136.0).contains(&millions), "SmolLM2-135M's weights: {size}");
    assert_eq!(details["quantization_level"], "Q4_1");
    assert_eq!(v["version"], inferd::serve::ollama::OLLAMA_API_VERSION);
    assert_eq!(
        v["show"],
        serde_json::json!({ "capabilities": ["completion"], "family": "llama", "has_template": true, "context_length": 8192 })
    );
    assert_eq!(v["ps"], v["tags"]);
    let chat = &v["chat"];
    assert!(chat["content"].as_str().unwrap().contains("Paris") && chat["done"] == true, "{chat}");
    assert!(chat["role"] == "assistant" && chat["done_reason"] == "stop", "{chat}");
    assert!(chat["eval_count"].as_u64().unwrap() > 0 && chat["prompt_eval_count"].as_u64().unwrap() > 5, "{chat}");
    let stream = &v["chat_stream"];
    assert_eq!(stream["content"], chat["content"], "streamed and whole answers agree");
    assert!(
        stream["chunks"].as_u64().unwrap() > 2 && stream["last_done"] == true && stream["others_done"] == false,
        "{stream}"
    );
    let raw = &v["generate_raw"];
    assert_eq!(raw["response"], " Paris.\n", "the raw prompt is not templated: as /v1/completions");
    assert!(raw["done_reason"] == "length" && raw["eval_count"] == 3, "{raw}");
    assert_eq!(
        raw["context"],
        raw["prompt_eval_count"].as_u64().unwrap() + 3,
        "the context holds the prompt and the answer"
    );
    assert_eq!(v["generate_context"]["done_reason"], "length");
    assert!(!v["generate_context"]["response"].as_str().unwrap().is_empty(), "{v}");
    assert_eq!(v["generate_stream"], chat["content"], "generate templates the prompt as chat does");
    assert_eq!(v["load"], "load");
    assert_eq!(v["untagged"], chat["content"]);
    let refused = &v["refused"];
    for (name, status, says) in [
        ("format", 400, "the response format cannot be enforced: Unsatisfiable schema"),
        ("images", 400, "images[0]: not an image in a supported format (PNG, JPEG, WebP, GIF)"),
        ("mirostat", 400, "options.mirostat is not supported"),
        ("unknown_model", 404, "unknown model"),
    ] {
        let r = &refused[name];
        assert!(r[0] == status && r[1].as_str().unwrap().contains(says), "{name}: {r}");
    }
    let _ = std::fs::remove_dir_all(dir);
}

pub(crate) fn inferctl(socket: &Path, args: &[&str], stdin: &str) -> (bool, String, String) {
    // inferctl is another package of the workspace: its binary lies beside inferd's (tests/run
    // builds the whole workspace first).
    let mut child = Command::new(Path::new(env!("CARGO_BIN_EXE_inferd")).with_file_name("inferctl"))
        .arg("--socket")
        .arg(socket)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(stdin.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn inferctl_talks_to_the_daemon_and_says_when_it_cannot() {
    let dir = scratch("inferctl");
    let d = Daemon::start(&dir, "", &[]);
    let (ok, out, err) = inferctl(&d.socket, &["status"], "");
    assert!(ok, "{err}");
    assert!(
        out.contains("inferd: ready")
            && out.contains("model SmolLM2-135M-Instruct.Q4_1")
            && out.contains("KV blocks 0 used of")
            && out.contains("  on cpu ("),
        "{out}"
    );
    let (_, out, _) = inferctl(&d.socket, &["models"], "");
    let head = "NAME\tSTATE\tSIZE\tTYPE\tARCH\tCONTEXT\tROLES\n";
    assert_eq!(out, format!("{head}SmolLM2-135M-Instruct.Q4_1\tloaded\t93.8MiB\tQ4_1\tllama\t8192\ttarget\n"));
    let (_, out, _) = inferctl(&d.socket, &["plugins"], "");
    assert!(out.lines().any(|l| l.starts_with("greedy\tinferd-greedy")), "{out}");
    let (_, out, _) = inferctl(&d.socket, &["tokenize", "Hello 12 world"], "");
    assert_eq!(out, "[19556,216,33,34,905]\n");
    // generate streams what the HTTP API answers.
    let (ok, out, err) = inferctl(&d.socket, &["generate", "--max-tokens", "3", "The capital of France is"], "");
    assert!(ok, "{err}");
    assert_eq!(out, " Paris.\n\n");
    let (ok, out, _) = inferctl(
        &d.socket,
        &["generate", "--chat", "--max-tokens", "40", "What is the capital of France? Answer in one word."],
        "",
    );
    assert!(ok && out.contains("Paris"), "{out}");
    let (ok, _, err) = inferctl(&d.socket, &["generate", "--decoder", "nope", "hi"], "");
    assert!(!ok && err.contains("404") && err.contains("unknown decoding strategy"), "{err}");
    // chat keeps the conversation: the second turn's prompt holds the first turn.
    let prompt_tokens = || d.status()["models"][0]["tokens"]["prompt"].as_u64().unwrap();
    let p0 = prompt_tokens();
    let (ok, out, err) = inferctl(&d.socket, &["chat", "--max-tokens", "8"], "My name is Ana.\n");
    assert!(ok && out.lines().count() == 1, "{out}{err}");
    let first_turn = prompt_tokens() - p0;
    let p1 = prompt_tokens();
    let (ok, out, _) = inferctl(&d.socket, &["chat", "--max-tokens", "8"], "My name is Ana.\nWhat is my name?\n");
    assert!(ok && out.lines().count() == 2, "{out}");
    let both_turns = prompt_tokens() - p1;
    assert!(
        both_turns - first_turn > first_turn + 4,
        "the second turn's prompt ({}) holds the first turn ({first_turn}) and its answer",
        both_turns - first_turn
    );
    // unload: the model leaves memory once idle; the next request loads it again.
    let (ok, out, err) = inferctl(&d.socket, &["unload", "SmolLM2-135M-Instruct.Q4_1"], "");
    assert!(ok && out == "SmolLM2-135M-Instruct.Q4_1: unloading once idle\n", "{out}{err}");
    wait_for("the unload", Duration::from_secs(10), || {
        inferctl(&d.socket, &["models"], "").1
            == format!("{head}SmolLM2-135M-Instruct.Q4_1\tnot-loaded\t93.8MiB\tQ4_1\tllama\t8192\t\n")
    });
    let (_, out, _) = inferctl(&d.socket, &["status"], "");
    assert!(out.contains("model SmolLM2-135M-Instruct.Q4_1: not loaded (loads so far: 1)"), "{out}");
    // The load shows as a progress bar (the SSE comments before the first token).
    let (ok, out, err) = inferctl(&d.socket, &["generate", "--max-tokens", "3", "The capital of France is"], "");
    assert!(ok && out == " Paris.\n\n", "{out}");
    assert!(err.contains("SmolLM2-135M-Instruct.Q4_1 [####") && err.contains("100%  93.8 of 93.8 MiB"), "{err}");
    // load: the same bar, for a model loaded ahead of its requests.
    let (ok, out, _) = inferctl(&d.socket, &["unload", "SmolLM2-135M-Instruct.Q4_1"], "");
    assert!(ok, "{out}");
    wait_for("the unload", Duration::from_secs(10), || d.status()["models"][0]["loaded"] == false);
    let (ok, out, err) = inferctl(&d.socket, &["load", "SmolLM2-135M-Instruct.Q4_1", "--keep-alive", "-1"], "");
    assert!(ok && out == "SmolLM2-135M-Instruct.Q4_1: loaded\n" && err.contains("100%"), "{out}{err}");
    assert_eq!(d.status()["models"][0]["keep_alive_seconds"], -1);
    let (ok, _, err) = inferctl(&d.socket, &["load", "nope"], "");
    assert!(!ok && err.contains("404") && err.contains("unknown model"), "{err}");
    // Clear messages when there is no daemon.
    let (ok, _, err) = inferctl(&dir.join("none.sock"), &["status"], "");
    assert!(!ok && err.contains("inferd is not running") && err.contains("none.sock"), "{err}");
    let stale = dir.join("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
    let (ok, _, err) = inferctl(&stale, &["status"], "");
    assert!(!ok && err.contains("nothing is listening"), "{err}");
    drop(d);
    let _ = std::fs::remove_dir_all(dir);
}
