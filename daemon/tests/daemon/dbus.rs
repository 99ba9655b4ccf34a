//! D-Bus on a private `dbus-daemon`: a zbus client, `gdbus` and `busctl`; unicast signals and
//! the checked-in introspection XML.

use super::*;

/// A session `dbus-daemon` for one test, stopped when dropped.
pub(crate) struct Bus {
    child: Child,
    pub(crate) address: String,
}

impl Bus {
    /// Waits until the daemon owns its name on this bus.
    pub(crate) fn wait_for_name(&self) {
        wait_for("the bus name", Duration::from_secs(20), || {
            Command::new("busctl")
                .arg(format!("--address={}", self.address))
                .args(["status", "org.inferd.Inference1"])
                .output()
                .is_ok_and(|o| o.status.success())
        });
    }

    pub(crate) fn start(dir: &Path) -> Bus {
        let path = dir.join("bus");
        let address = format!("unix:path={}", path.display());
        let child = Command::new("dbus-daemon")
            .args(["--session", "--nofork", "--nopidfile", &format!("--address={address}")])
            .spawn()
            .expect("dbus-daemon (apt-get install dbus)");
        wait_for("the bus", Duration::from_secs(10), || UnixStream::connect(&path).is_ok());
        Bus { child, address }
    }
}

impl Drop for Bus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The lines of `<interface name="NAME">` … `</interface>` in introspection XML, trimmed.
fn interface_xml(xml: &str, name: &str) -> Vec<String> {
    let lines: Vec<String> = xml.lines().map(|l| l.trim().to_owned()).filter(|l| !l.is_empty()).collect();
    let start = lines
        .iter()
        .position(|l| *l == format!("<interface name=\"{name}\">"))
        .unwrap_or_else(|| panic!("no interface {name} in:\n{xml}"));
    let len = lines[start..].iter().position(|l| l == "</interface>").unwrap();
    lines[start..=start + len].to_vec()
}

#[test]
fn dbus_generate_complete_properties_unicast_and_introspection() {
    use zbus::zvariant::{OwnedObjectPath, Value as V};
    let dir = scratch("dbus");
    let bus = Bus::start(&dir);
    let d = Daemon::start(&dir, "", &[("DBUS_SESSION_BUS_ADDRESS", &bus.address)]);
    let busctl = |args: &[&str]| -> String {
        let out = Command::new("busctl")
            .arg(format!("--address={}", bus.address))
            .args(args)
            .output()
            .expect("busctl (apt-get install systemd)");
        assert!(out.status.success(), "busctl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    bus.wait_for_name();
    // An independent client: gdbus for Complete, busctl for properties and Tokenize.
    let out = Command::new("gdbus")
        .args([
            "call",
            "--session",
            "--dest",
            "org.inferd.Inference1",
            "--object-path",
            "/org/inferd/Inference1",
            "--method",
            "org.inferd.Inference1.Complete",
            "",
            "The capital of France is",
            "{'max_tokens': <uint32 3>, 'temperature': <0.0>}",
        ])
        .env("DBUS_SESSION_BUS_ADDRESS", &bus.address)
        .output()
        .expect("gdbus (apt-get install libglib2.0-bin)");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        r"(' Paris.\n',)",
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The request's sampling fields reach a named strategy: speculative decoding at temperature
    // 0 gives greedy decoding's text.
    let complete = |options: &str| {
        let out = Command::new("gdbus")
            .args(["call", "--session", "--dest", "org.inferd.Inference1", "--object-path", "/org/inferd/Inference1"])
            .args(["--method", "org.inferd.Inference1.Complete", "", "Once upon a time, in a small village,", options])
            .env("DBUS_SESSION_BUS_ADDRESS", &bus.address)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let greedy = complete("{'max_tokens': <uint32 40>, 'temperature': <0.0>}");
    let speculative = complete("{'max_tokens': <uint32 40>, 'temperature': <0.0>, 'decoder': <'speculative'>}");
    assert!(greedy.len() > 60, "{greedy}");
    assert_eq!(speculative, greedy);
    // A response format as JSON text: the answer follows the schema.
    let schema = r#"{"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"], "additionalProperties": false}}}"#;
    let json =
        complete(&format!("{{'max_tokens': <uint32 40>, 'temperature': <0.0>, 'response_format': <'{schema}'>}}"));
    let text = json.trim().trim_start_matches("('").trim_end_matches("',)");
    let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{json}: {e}"));
    assert!(v["city"] == "Paris" || v["city"] == "Rome", "{v}");
    // Embed: one normalized vector of the hidden size per input.
    let out = busctl(&[
        "call",
        "org.inferd.Inference1",
        "/org/inferd/Inference1",
        "org.inferd.Inference1",
        "Embed",
        "sas",
        "",
        "2",
        "Hello",
        "Hi there",
    ]);
    let words: Vec<&str> = out.split_whitespace().collect();
    assert_eq!(&words[..3], ["aad", "2", "576"], "{out}");
    let first: Vec<f64> = words[3..3 + 576].iter().map(|w| w.parse().unwrap()).collect();
    let norm: f64 = first.iter().map(|x| x * x).sum::<f64>().sqrt();
    assert!((norm - 1.0).abs() < 1e-4, "{norm}");
    assert_eq!(
        busctl(&["get-property", "org.inferd.Inference1", "/org/inferd/Inference1", "org.inferd.Inference1", "Models"])
            .trim(),
        r#"as 1 "SmolLM2-135M-Instruct.Q4_1""#
    );
    assert!(busctl(&[
        "get-property",
        "org.inferd.Inference1",
        "/org/inferd/Inference1",
        "org.inferd.Inference1",
        "Strategies"
    ])
    .contains("\"greedy\""));
    assert!(busctl(&[
        "get-property",
        "org.inferd.Inference1",
        "/org/inferd/Inference1",
        "org.inferd.Inference1",
        "Status"
    ])
    .contains("\"state\" s \"ready\""));
    assert_eq!(
        busctl(&[
            "call",
            "org.inferd.Inference1",
            "/org/inferd/Inference1",
            "org.inferd.Inference1",
            "Tokenize",
            "ss",
            "",
            "Hello 12 world"
        ])
        .trim(),
        "au 5 19556 216 33 34 905"
    );
    let bad = Command::new("busctl")
        .arg(format!("--address={}", bus.address))
        .args([
            "call",
            "org.inferd.Inference1",
            "/org/inferd/Inference1",
            "org.inferd.Inference1",
            "Complete",
            "ssa{sv}",
            "",
            "hi",
            "1",
            "temperature",
            "d",
            "9",
        ])
        .output()
        .unwrap();
    assert!(
        !bad.status.success() && String::from_utf8_lossy(&bad.stderr).contains("temperature must be between 0 and 2"),
        "{}",
        String::from_utf8_lossy(&bad.stderr)
    );

    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        use tokio_stream::StreamExt;
        let connect =
            || async { zbus::connection::Builder::address(bus.address.as_str()).unwrap().build().await.unwrap() };
        let caller = connect().await;
        let other = connect().await;
        // Another connection asks for every Request signal: it must get none of the caller's.
        zbus::fdo::DBusProxy::new(&other)
            .await
            .unwrap()
            .add_match_rule(
                zbus::MatchRule::try_from("type='signal',interface='org.inferd.Inference1.Request'").unwrap(),
            )
            .await
            .unwrap();
        let mut snoop = zbus::MessageStream::from(&other);
        let opts = std::collections::HashMap::from([("max_tokens", V::U32(8)), ("temperature", V::F64(0.0))]);
        let heard = signals(&caller, "Generate", &("", "The capital of France is", &opts)).await;
        assert!(heard.path.starts_with("/org/inferd/Inference1/request/"), "{}", heard.path);
        assert_eq!(heard.completion_tokens, 8);
        let (text, ids, reason) = (heard.text, heard.ids, heard.reason);
        let (_, body) = d.http(
            "POST",
            "/v1/completions",
            r#"{"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}"#,
        );
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(text, v["choices"][0]["text"].as_str().unwrap(), "the same text as over HTTP");
        assert_eq!(reason, "length");
        assert!(!ids.is_empty());
        while let Ok(Some(Ok(msg))) = tokio::time::timeout(Duration::from_millis(300), snoop.next()).await {
            let h = msg.header();
            assert!(
                !(h.message_type() == zbus::message::Type::Signal
                    && h.interface().is_some_and(|i| i.as_str() == "org.inferd.Inference1.Request")),
                "another connection received the caller's signal {:?}",
                h.member()
            );
        }

        // The introspection data the daemon serves is the checked-in XML, for both interfaces.
        let long = std::collections::HashMap::from([("max_tokens", V::U32(3000)), ("temperature", V::F64(0.0))]);
        let reply = caller
            .call_method(
                Some("org.inferd.Inference1"),
                "/org/inferd/Inference1",
                Some("org.inferd.Inference1"),
                "Generate",
                &("", "Once upon a time", &long),
            )
            .await
            .unwrap();
        let req: OwnedObjectPath = reply.body().deserialize().unwrap();
        let checked_in =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/dbus/org.inferd.Inference1.xml")).unwrap();
        let introspect = |p: String| {
            let c = caller.clone();
            async move {
                let r = c
                    .call_method(
                        Some("org.inferd.Inference1"),
                        p.as_str(),
                        Some("org.freedesktop.DBus.Introspectable"),
                        "Introspect",
                        &(),
                    )
                    .await
                    .unwrap();
                r.body().deserialize::<String>().unwrap()
            }
        };
        let root = introspect("/org/inferd/Inference1".into()).await;
        let obj = introspect(req.to_string()).await;
        assert_eq!(
            interface_xml(&root, "org.inferd.Inference1"),
            interface_xml(&checked_in, "org.inferd.Inference1"),
            "served:\n{root}"
        );
        assert_eq!(
            interface_xml(&obj, "org.inferd.Inference1.Request"),
            interface_xml(&checked_in, "org.inferd.Inference1.Request"),
            "served:\n{obj}"
        );
        // Only the caller may cancel its request; Cancel stops it.
        let denied = other
            .call_method(
                Some("org.inferd.Inference1"),
                req.as_str(),
                Some("org.inferd.Inference1.Request"),
                "Cancel",
                &(),
            )
            .await;
        assert!(denied.is_err());
        caller
            .call_method(
                Some("org.inferd.Inference1"),
                req.as_str(),
                Some("org.inferd.Inference1.Request"),
                "Cancel",
                &(),
            )
            .await
            .unwrap();
        wait_for("the cancelled request", Duration::from_secs(20), || {
            d.status()["models"][0]["requests"]["running"] == 0
        });

        // A caller that leaves the bus has its requests cancelled.
        let leaver = connect().await;
        leaver
            .call_method(
                Some("org.inferd.Inference1"),
                "/org/inferd/Inference1",
                Some("org.inferd.Inference1"),
                "Generate",
                &("", "Once upon a time", &long),
            )
            .await
            .unwrap();
        wait_for("the leaver's request to run", Duration::from_secs(20), || {
            d.status()["models"][0]["requests"]["running"] == 1
        });
        let uid = std::fs::metadata("/proc/self").map(|m| std::os::unix::fs::MetadataExt::uid(&m)).unwrap();
        assert_eq!(
            d.status()["requests_per_user"][uid.to_string()],
            1,
            "a D-Bus caller's uid counts like a socket peer's"
        );
        let cancelled = d.status()["models"][0]["requests"]["cancelled"].as_u64().unwrap();
        drop(leaver);
        wait_for("the leaver's request to be cancelled", Duration::from_secs(20), || {
            d.status()["models"][0]["requests"]["cancelled"].as_u64().unwrap() > cancelled
        });
        assert_eq!(d.status()["models"][0]["requests"]["running"], 0);
    });
    drop(d);
    drop(bus);
    let _ = std::fs::remove_dir_all(dir);
}

/// A `Logprobs` signal's entry: a token's id, text and log-probability, and its alternatives.
pub(crate) type Entry = (u32, String, f64, Vec<(u32, String, f64)>);

/// What the caller heard of one request: its object, text and token ids, `Logprobs` entries,
/// `ToolCall`s, the reason and the completion tokens `Finished` reported.
#[derive(Default)]
pub(crate) struct Heard {
    pub(crate) path: String,
    pub(crate) text: String,
    pub(crate) ids: Vec<u32>,
    pub(crate) logprobs: Vec<Entry>,
    pub(crate) calls: Vec<(String, String, String)>,
    pub(crate) reason: String,
    pub(crate) completion_tokens: u32,
}

/// Calls `method` (Generate or Chat) with `body` and collects the request's signals until
/// `Finished`.
pub(crate) async fn signals<B>(caller: &zbus::Connection, method: &str, body: &B) -> Heard
where
    B: serde::Serialize + zbus::zvariant::DynamicType,
{
    use tokio_stream::StreamExt;
    let mut stream = zbus::MessageStream::from(caller);
    let reply = caller
        .call_method(
            Some("org.inferd.Inference1"),
            "/org/inferd/Inference1",
            Some("org.inferd.Inference1"),
            method,
            body,
        )
        .await
        .unwrap();
    let path: zbus::zvariant::OwnedObjectPath = reply.body().deserialize().unwrap();
    let mut heard = Heard { path: path.to_string(), ..Heard::default() };
    let t0 = Instant::now();
    while heard.reason.is_empty() {
        assert!(t0.elapsed() < Duration::from_secs(60), "no Finished signal");
        let Ok(Some(Ok(msg))) = tokio::time::timeout(Duration::from_secs(30), stream.next()).await else { continue };
        let h = msg.header();
        if h.message_type() != zbus::message::Type::Signal || h.path().map(|p| p.as_str()) != Some(path.as_str()) {
            continue;
        }
        match h.member().map(|m| m.as_str()) {
            Some("Token") => {
                let (t, id): (String, u32) = msg.body().deserialize().unwrap();
                heard.text.push_str(&t);
                heard.ids.push(id);
            }
            Some("Logprobs") => heard.logprobs.extend(msg.body().deserialize::<(Vec<_>,)>().unwrap().0),
            Some("ToolCall") => heard.calls.push(msg.body().deserialize().unwrap()),
            Some("Finished") => {
                let (r, usage): (String, std::collections::HashMap<String, zbus::zvariant::OwnedValue>) =
                    msg.body().deserialize().unwrap();
                heard.completion_tokens = u32::try_from(&usage["completion_tokens"]).unwrap();
                heard.reason = r;
            }
            Some("Failed") => panic!("failed: {:?}", msg.body().deserialize::<String>()),
            _ => {}
        }
    }
    heard
}

/// [`signals`] of a `Chat` call.
async fn chat_signals(
    caller: &zbus::Connection,
    messages: &[std::collections::HashMap<&str, &str>],
    options: &std::collections::HashMap<&str, zbus::zvariant::Value<'_>>,
) -> Heard {
    signals(caller, "Chat", &("", messages, options)).await
}

/// Chat over D-Bus with the options of the OpenAI API: `logprobs` / `top_logprobs` arrive as
/// `Logprobs` signals with HTTP's numbers; `tools` with a named `tool_choice` give a
/// `ToolCall` signal whose arguments follow the tool's schema, and a tool result goes back
/// into the conversation.
#[test]
fn dbus_chat_reports_logprobs_and_tool_calls() {
    use std::collections::HashMap;
    use zbus::zvariant::Value as V;
    let dir = scratch("dbus-tools");
    let bus = Bus::start(&dir);
    let d = Daemon::start(&dir, "", &[("DBUS_SESSION_BUS_ADDRESS", &bus.address)]);
    bus.wait_for_name();
    let question = HashMap::from([("role", "user"), ("content", "What is the capital of France?")]);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let caller = zbus::connection::Builder::address(bus.address.as_str()).unwrap().build().await.unwrap();
        let opts = HashMap::from([
            ("max_tokens", V::U32(6)),
            ("temperature", V::F64(0.0)),
            ("logprobs", V::Bool(true)),
            ("top_logprobs", V::U32(3)),
        ]);
        let heard = chat_signals(&caller, std::slice::from_ref(&question), &opts).await;
        let (_, body) = d.http(
            "POST",
            "/v1/chat/completions",
            r#"{"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 6,
                "temperature": 0, "logprobs": true, "top_logprobs": 3}"#,
        );
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(heard.text, v["choices"][0]["message"]["content"].as_str().unwrap());
        let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
        assert_eq!(heard.logprobs.len(), content.len(), "one entry per token");
        for ((_, text, lp, top), want) in heard.logprobs.iter().zip(content) {
            assert_eq!(text, want["token"].as_str().unwrap());
            assert!((lp - want["logprob"].as_f64().unwrap()).abs() < 1e-6);
            let alts: Vec<&str> = top.iter().map(|a| a.1.as_str()).collect();
            let want_alts: Vec<&str> =
                want["top_logprobs"].as_array().unwrap().iter().map(|a| a["token"].as_str().unwrap()).collect();
            assert_eq!(alts, want_alts);
        }
        // No logprobs option, no Logprobs signal.
        let plain = HashMap::from([("max_tokens", V::U32(4)), ("temperature", V::F64(0.0))]);
        assert!(chat_signals(&caller, std::slice::from_ref(&question), &plain).await.logprobs.is_empty());

        // A named tool: the call comes as a ToolCall signal, the request ends with "tool_calls".
        let tools = r#"[{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"], "additionalProperties": false}}}]"#;
        let choice = r#"{"type": "function", "function": {"name": "get_weather"}}"#;
        let ask = HashMap::from([("role", "user"), ("content", "What is the weather in Paris?")]);
        let opts = HashMap::from([
            ("max_tokens", V::U32(100)),
            ("temperature", V::F64(0.0)),
            ("tools", V::from(tools)),
            ("tool_choice", V::from(choice)),
            ("parallel_tool_calls", V::Bool(false)),
        ]);
        let heard = chat_signals(&caller, std::slice::from_ref(&ask), &opts).await;
        assert_eq!(heard.reason, "tool_calls", "{}", heard.text);
        assert_eq!(heard.calls.len(), 1);
        let (id, name, arguments) = &heard.calls[0];
        assert_eq!(name, "get_weather");
        let args: Value = serde_json::from_str(arguments).unwrap();
        assert!(args["city"].is_string() && args.as_object().unwrap().len() == 1, "{args}");
        // The call and its result go back: the model answers in text.
        let calls = format!(
            r#"[{{"id": "{id}", "type": "function", "function": {{"name": "get_weather", "arguments": {}}}}}]"#,
            serde_json::to_string(arguments).unwrap()
        );
        let history = [
            ask.clone(),
            HashMap::from([("role", "assistant"), ("content", ""), ("tool_calls", calls.as_str())]),
            HashMap::from([("role", "tool"), ("content", "18 degrees and sunny"), ("tool_call_id", id.as_str())]),
        ];
        let opts = HashMap::from([("max_tokens", V::U32(30)), ("temperature", V::F64(0.0)), ("tools", V::from(tools))]);
        let answer = chat_signals(&caller, &history, &opts).await;
        assert!(answer.reason == "stop" || answer.reason == "length" || answer.reason == "tool_calls");
        assert!(!answer.text.is_empty() || !answer.calls.is_empty());
        // Tool options belong to Chat; a message key nobody reads is refused by name.
        let refused = caller
            .call_method(
                Some("org.inferd.Inference1"),
                "/org/inferd/Inference1",
                Some("org.inferd.Inference1"),
                "Generate",
                &("", "hi", &HashMap::from([("tools", V::from(tools))])),
            )
            .await
            .unwrap_err();
        assert!(refused.to_string().contains("tools is an option of Chat"), "{refused}");
        let odd = [HashMap::from([("role", "user"), ("content", "hi"), ("colour", "blue")])];
        let refused = caller
            .call_method(
                Some("org.inferd.Inference1"),
                "/org/inferd/Inference1",
                Some("org.inferd.Inference1"),
                "Chat",
                &("", &odd[..], &HashMap::<&str, V>::new()),
            )
            .await
            .unwrap_err();
        assert!(refused.to_string().contains("unknown key \"colour\""), "{refused}");
    });
    drop(d);
    drop(bus);
    let _ = std::fs::remove_dir_all(dir);
}

/// The LoadProgress signals `stream` has received (until none comes for a while).
async fn load_progress(stream: &mut zbus::MessageStream) -> Vec<(String, u64, u64)> {
    use tokio_stream::StreamExt;
    let mut out = Vec::new();
    while let Ok(Some(Ok(m))) = tokio::time::timeout(Duration::from_millis(300), stream.next()).await {
        if m.header().member().map(|m| m.as_str()) == Some("LoadProgress") {
            out.push(m.body().deserialize().unwrap());
        }
    }
    out
}

/// UnloadModel and LoadModel; a caller waiting for a load hears its progress as LoadProgress
/// signals (it alone), whether it asked for the load or for a completion of a cold model.
#[test]
fn dbus_loads_and_unloads_models_with_progress_to_the_caller() {
    let dir = scratch("dbus-load");
    let bus = Bus::start(&dir);
    let d = Daemon::start(&dir, "", &[("DBUS_SESSION_BUS_ADDRESS", &bus.address)]);
    bus.wait_for_name();
    let name = "SmolLM2-135M-Instruct.Q4_1";
    let size = std::fs::metadata(model()).unwrap().len();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let connect =
            || async { zbus::connection::Builder::address(bus.address.as_str()).unwrap().build().await.unwrap() };
        let (caller, other) = (connect().await, connect().await);
        const IFACE: &str = "org.inferd.Inference1";
        let call = |c: &zbus::Connection, method: &'static str, body: (&'static str, &'static str)| {
            let c = c.clone();
            async move { c.call_method(Some(IFACE), "/org/inferd/Inference1", Some(IFACE), method, &body).await }
        };
        let unload = |c: &zbus::Connection| {
            let c = c.clone();
            async move {
                let r =
                    c.call_method(Some(IFACE), "/org/inferd/Inference1", Some(IFACE), "UnloadModel", &(name,)).await;
                r.unwrap().body().deserialize::<bool>().unwrap()
            }
        };
        // Every model with what its file says, loaded or not.
        let details = |c: &zbus::Connection| {
            let c = c.clone();
            async move {
                let props = Some("org.freedesktop.DBus.Properties");
                let r = c.call_method(Some(IFACE), "/org/inferd/Inference1", props, "Get", &(IFACE, "ModelDetails"));
                let v: zbus::zvariant::OwnedValue = r.await.unwrap().body().deserialize().unwrap();
                Vec::<std::collections::HashMap<String, zbus::zvariant::OwnedValue>>::try_from(v).unwrap()
            }
        };
        let m = details(&caller).await;
        assert_eq!(m.len(), 1);
        let text = |k: &str| String::try_from(m[0][k].clone()).unwrap();
        assert!(text("name") == name && text("file_type") == "Q4_1" && text("architecture") == "llama");
        assert_eq!(u64::try_from(&m[0]["size"]).unwrap(), size);
        assert_eq!(u64::try_from(&m[0]["context_length"]).unwrap(), 8192);
        assert!(bool::try_from(&m[0]["loaded"]).unwrap());
        assert!(unload(&caller).await, "it was loaded");
        wait_for("the unload", Duration::from_secs(10), || d.status()["models"][0]["loaded"] == false);
        assert!(!bool::try_from(&details(&caller).await[0]["loaded"]).unwrap());
        let (mut mine, mut theirs) = (zbus::MessageStream::from(&caller), zbus::MessageStream::from(&other));
        call(&caller, "LoadModel", ("", "-1")).await.unwrap();
        let p = load_progress(&mut mine).await;
        assert!(p.len() >= 2, "{p:?}");
        assert!(p.iter().all(|(m, _, t)| m == name && *t == size), "{p:?}");
        assert!(p.windows(2).all(|w| w[0].1 <= w[1].1), "progress only grows: {p:?}");
        assert_eq!(p.last().unwrap().1, size, "{p:?}");
        assert!(load_progress(&mut theirs).await.is_empty(), "unicast to the caller");
        let s = d.status();
        assert!(s["models"][0]["loaded"] == true && s["models"][0]["keep_alive_seconds"] == -1, "{s}");
        unload(&caller).await;
        wait_for("the unload", Duration::from_secs(10), || d.status()["models"][0]["loaded"] == false);
        // A completion of a cold model: the progress, then the text.
        let opts = std::collections::HashMap::from([
            ("max_tokens", zbus::zvariant::Value::U32(3)),
            ("temperature", zbus::zvariant::Value::F64(0.0)),
        ]);
        let body = (name, "The capital of France is", &opts);
        let r = caller.call_method(Some(IFACE), "/org/inferd/Inference1", Some(IFACE), "Complete", &body).await;
        assert_eq!(r.unwrap().body().deserialize::<String>().unwrap(), " Paris.\n");
        assert_eq!(load_progress(&mut mine).await.last().map(|x| x.1), Some(size));
        let refused = call(&caller, "LoadModel", ("nope", "")).await.unwrap_err();
        assert!(refused.to_string().contains("unknown model"), "{refused}");
        let refused = call(&caller, "LoadModel", ("", "soon")).await.unwrap_err();
        assert!(refused.to_string().contains("not a duration"), "{refused}");
    });
    drop(d);
    drop(bus);
    let _ = std::fs::remove_dir_all(dir);
}

/// `Complete` on the default model: the whole text, or the daemon's error.
pub(crate) async fn complete(
    conn: &zbus::Connection,
    prompt: &str,
    options: std::collections::HashMap<String, zbus::zvariant::Value<'_>>,
) -> zbus::Result<String> {
    let iface = Some("org.inferd.Inference1");
    let r = conn.call_method(iface, "/org/inferd/Inference1", iface, "Complete", &("", prompt, &options)).await?;
    r.body().deserialize::<String>()
}

/// A D-Bus option dictionary from a JSON object: strings, booleans, integers (u32 when they
/// fit, else i64), floats, arrays of strings; anything else as its JSON text.
fn options_of(v: &Value) -> std::collections::HashMap<String, zbus::zvariant::Value<'static>> {
    use zbus::zvariant::Value as V;
    let one = |x: &Value| -> V<'static> {
        match x {
            Value::String(s) => V::from(s.clone()),
            Value::Bool(b) => V::Bool(*b),
            Value::Number(n) => match (n.as_u64(), n.as_i64(), n.as_f64()) {
                (Some(u), _, _) if u <= u64::from(u32::MAX) => V::U32(u as u32),
                (_, Some(i), _) => V::I64(i),
                (_, _, Some(f)) => V::F64(f),
                _ => V::from(n.to_string()),
            },
            Value::Array(a) if a.iter().all(Value::is_string) => {
                V::from(a.iter().map(|s| s.as_str().unwrap_or("").to_string()).collect::<Vec<String>>())
            }
            other => V::from(other.to_string()),
        }
    };
    v.as_object().map(|o| o.iter().map(|(k, x)| (k.clone(), one(x))).collect()).unwrap_or_default()
}

/// Mutated option dictionaries (`tests/fuzz/corpus/dbus_options`: every option, typed as
/// clients send them, and mistyped) on Complete: each call is answered, text or a D-Bus error,
/// and the daemon serves on.
#[test]
fn fuzzed_dbus_options_get_answers() {
    use inferd_e2e::fuzz;
    let dir = scratch("fuzz-dbus");
    let bus = Bus::start(&dir);
    let d = Daemon::start(&dir, "[limits]\nmax_tokens = 4\n", &[("DBUS_SESSION_BUS_ADDRESS", &bus.address)]);
    bus.wait_for_name();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let conn =
        rt.block_on(async { zbus::connection::Builder::address(bus.address.as_str()).unwrap().build().await.unwrap() });
    let (ok, refused, unparsed) = (std::cell::Cell::new(0), std::cell::Cell::new(0), std::cell::Cell::new(0));
    let dict: &[&[u8]] = &[b"\"decoder\"", b"\"beam\"", b"\"n\"", b"\"grammar\"", b"\"tools\""];
    let report = fuzz::run(
        "dbus_options",
        &fuzz::corpus("dbus_options"),
        dict,
        fuzz::execs(1500),
        &dir.join("crashes"),
        |input| {
            let Ok(v) = serde_json::from_slice::<Value>(input) else {
                unparsed.set(unparsed.get() + 1);
                return;
            };
            let call = complete(&conn, "Hi", options_of(&v));
            match rt.block_on(async { tokio::time::timeout(Duration::from_secs(30), call).await }) {
                Ok(Ok(_)) => ok.set(ok.get() + 1),
                Ok(Err(zbus::Error::MethodError(..))) => refused.set(refused.get() + 1),
                Ok(Err(e)) => panic!("{v}: not a D-Bus error reply: {e}"),
                Err(_) => panic!("{v}: no answer in 30 s"),
            }
        },
    );
    eprintln!(
        "dbus options: {} answered, {} refused with an error, {} inputs not JSON",
        ok.get(),
        refused.get(),
        unparsed.get()
    );
    assert!(report.crashes.is_empty(), "{:?}", report.crashes);
    assert!(ok.get() > 0 && refused.get() > 0);
    wait_for("every request done", Duration::from_secs(10), || d.status()["models"][0]["requests"]["running"] == 0);
    drop(d);
    drop(bus);
    let _ = std::fs::remove_dir_all(dir);
}
