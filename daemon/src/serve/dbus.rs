//! The D-Bus edge (zbus): `org.inferd.Inference1` at `/org/inferd/Inference1` on the system bus
//! (system mode) or the session bus (user mode). `Generate` and `Chat` return a request object
//! (`/org/inferd/Inference1/request/<n>`, interface `org.inferd.Inference1.Request`) whose
//! `Token`, `Finished` and `Failed` signals go to the calling connection only (unicast, so no
//! other user reads the text); `Complete` answers with the whole text. The caller's uid (bus
//! credentials) counts against the same per-user limit as a socket peer's, and a caller that
//! leaves the bus has its requests cancelled. Options (`a{sv}`) carry the HTTP fields; they
//! convert straight into the typed request and go through the same checks (`dbus_options.rs`,
//! `fields.rs`, [`request`](super::request)). A chat's `tools` and its messages' tool calls
//! take the HTTP edge's path too (a JSON body built from them, `chat.rs`); calls come back as
//! `ToolCall` signals, log-probabilities as `Logprobs` signals before the text they belong to.
//! A remote model's calls go to its upstream and come back as the same signals
//! ([`remote::dbus`](super::remote::dbus)).
//!
//! The introspection data is checked in (`daemon/dbus/org.inferd.Inference1.xml`); a test
//! compares it with what the daemon serves.

use super::answer::{Answer, Answers, Finish};
use super::api::ApiError;
use super::chat::{self, Tools};
use super::config::Mode;
use super::conn::Hangup;
use super::dbus_options::{chat_body, options_request};
use super::remote::dbus::{self as remote, Routed};
use super::request::{self, Scored};
use super::{ModelHandle, Shared};
use inferd_engine::request::Request;
use inferd_engine::sched::RequestId;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use zbus::fdo;
use zbus::message::Header;
use zbus::names::{BusName, UniqueName};
use zbus::object_server::SignalEmitter;
use zbus::zvariant::{ObjectPath, OwnedObjectPath, OwnedValue, Value};
use zbus::{interface, Connection};

pub const NAME: &str = "org.inferd.Inference1";
pub const PATH: &str = "/org/inferd/Inference1";

/// Requests in flight per caller (unique bus name), to cancel when the caller leaves.
pub(crate) type Owners = Arc<Mutex<HashMap<String, Vec<Stop>>>>;

/// How a request in flight is stopped: a local one by its engine, a remote one by ending its
/// forwarding (which closes the upstream's connection).
#[derive(Clone)]
pub(crate) enum Stop {
    Engine(Arc<ModelHandle>, RequestId),
    Upstream(RequestId, Arc<Hangup>),
}

impl Stop {
    fn id(&self) -> RequestId {
        match self {
            Stop::Engine(_, id) | Stop::Upstream(id, _) => *id,
        }
    }

    fn stop(&self) {
        match self {
            Stop::Engine(model, id) => model.engine.cancel(*id),
            Stop::Upstream(_, hangup) => hangup.trip(),
        }
    }
}

pub struct Inference {
    pub(crate) sh: Arc<Shared>,
    pub(crate) owners: Owners,
}

pub(crate) fn failed(e: ApiError) -> fdo::Error {
    match e.status {
        400 | 404 | 413 => fdo::Error::InvalidArgs(e.message),
        403 => fdo::Error::AccessDenied(e.message),
        429 => fdo::Error::LimitsExceeded(e.message),
        _ => fdo::Error::Failed(e.message),
    }
}

/// The uid of a bus connection, from the bus.
pub(crate) async fn caller_uid(conn: &Connection, sender: &UniqueName<'_>) -> fdo::Result<u32> {
    let proxy = fdo::DBusProxy::new(conn).await?;
    proxy.get_connection_unix_user(BusName::Unique(sender.clone())).await
}

/// A call's model, prompt and tools (a chat whose answer may call them).
type Prompt = (Arc<ModelHandle>, Vec<u32>, Option<Tools>, Vec<inferd_engine::vision::media::PromptImage>);

/// A submitted call: its answer, its caller, whether it asked for log-probabilities.
struct Started {
    answers: Answers,
    sender: String,
    logprobs: bool,
}

impl Inference {
    /// Checks and submits a request for `sender`; `prompt` builds the prompt once the request
    /// is known (a chat's tools may shape it). The options, the prompt and the checks are
    /// worked out off the runtime ([`Shared::cpu`]).
    async fn start(
        &self,
        conn: &Connection,
        hdr: &Header<'_>,
        options: HashMap<String, OwnedValue>,
        prompt: impl FnOnce(&Shared, &HashMap<String, OwnedValue>, &mut Request) -> Result<Prompt, ApiError>
            + Send
            + 'static,
    ) -> fdo::Result<Started> {
        let sender = hdr.sender().ok_or_else(|| fdo::Error::Failed("a call without a sender".into()))?.to_owned();
        let uid = caller_uid(conn, &sender).await?;
        let sh = Arc::clone(&self.sh);
        let (p, tools) = self
            .sh
            .cpu(move || {
                let mut req = options_request(&options)?;
                let (handle, ids, tools, images) = prompt(&sh, &options, &mut req)?;
                let mut p = request::prepare(&sh, handle, req, ids)?;
                p.images = images;
                Ok((p, tools))
            })
            .await
            .map_err(failed)?;
        let (logprobs, stop) = (p.logprobs.is_some(), p.stop.clone());
        let sub = request::submit(&self.sh, p, uid, None).map_err(failed)?;
        if let Ok(mut o) = self.owners.lock() {
            o.entry(sender.to_string()).or_default().push(Stop::Engine(Arc::clone(&sub.model), sub.id));
        }
        let answers = Answers::local(sub, 1, stop, tools.as_ref());
        Ok(Started { answers, sender: sender.to_string(), logprobs })
    }

    /// `prompt` as token ids (tool options belong to Chat).
    fn prompt_ids(
        sh: &Shared,
        model: &str,
        prompt: &str,
        options: &HashMap<String, OwnedValue>,
    ) -> Result<Prompt, ApiError> {
        if let Some(k) =
            ["tools", "tool_choice", "parallel_tool_calls", "images"].iter().find(|k| options.contains_key(**k))
        {
            return Err(ApiError::bad(format!("{k} is an option of Chat"), "tools"));
        }
        let h = sh.model(Some(model))?;
        let ids = request::encode_prompt(&h.model, prompt)?;
        Ok((h, ids, None, Vec::new()))
    }

    /// A chat's messages rendered with its tools; a required or named call constrains `req`.
    fn chat_ids(
        sh: &Shared,
        model: &str,
        messages: &[HashMap<String, String>],
        options: &HashMap<String, OwnedValue>,
        req: &mut Request,
    ) -> Result<Prompt, ApiError> {
        let h = sh.model(Some(model))?;
        let body = chat_body(messages, options)?;
        let tools = Tools::of(&body, &h.model)?;
        let (ids, images) =
            chat::encode_with_images(sh, &h.model, &chat::messages(&body)?, Some(&tools), &Default::default())?;
        tools.constrain(req, h.vocabulary.as_deref())?;
        Ok((h, ids, tools.active().then_some(tools), images))
    }

    /// Loads model `model` unless it is loaded, sending the load's progress to the caller as
    /// `LoadProgress` signals while it waits.
    async fn load(&self, conn: &Connection, hdr: &Header<'_>, model: &str) -> fdo::Result<()> {
        let name = Some(model).filter(|m| !m.is_empty());
        let slot = self.sh.models.slot(name).map_err(failed)?;
        let emitter = match hdr.sender() {
            Some(dest) if slot.loaded().is_none() => {
                SignalEmitter::new(conn, PATH).map(|e| e.set_destination(BusName::Unique(dest.to_owned()))).ok()
            }
            _ => None,
        };
        let Some(emitter) = emitter else { return self.sh.load(name, None).await.map_err(failed) };
        let mut watch = slot.progress.subscribe();
        let load = self.sh.load(name, None);
        tokio::pin!(load);
        loop {
            tokio::select! {
                r = &mut load => return r.map_err(failed),
                Ok(()) = watch.changed() => {
                    let p = *watch.borrow_and_update();
                    if p.loading {
                        let _ = Inference::load_progress(&emitter, &slot.name, p.done, p.total).await;
                    }
                }
            }
        }
    }

    /// Exports a request object and streams its signals to `sender` from a task.
    async fn stream(&self, conn: &Connection, started: Started) -> fdo::Result<OwnedObjectPath> {
        let Started { answers, sender, logprobs } = started;
        let model = answers.model().cloned().ok_or_else(|| fdo::Error::Failed("internal error: no model".into()))?;
        let stop = Stop::Engine(model, answers.id().unwrap_or(0));
        let to = sender.clone();
        self.export(conn, stop, sender, move |conn, p| async move { signals(&conn, &p, &to, answers, logprobs).await })
            .await
    }

    /// Exports request object `stop` of `sender` and runs `signals` (which sends its signals)
    /// in a task, removing the object once it is done.
    pub(crate) async fn export<F: std::future::Future<Output = ()> + Send + 'static>(
        &self,
        conn: &Connection,
        stop: Stop,
        sender: String,
        signals: impl FnOnce(Connection, OwnedObjectPath) -> F + Send + 'static,
    ) -> fdo::Result<OwnedObjectPath> {
        let path = OwnedObjectPath::try_from(format!("{PATH}/request/{}", stop.id()))
            .map_err(|e| fdo::Error::Failed(e.to_string()))?;
        let obj = RequestObject { stop, owner: sender.clone() };
        conn.object_server().at(&path, obj).await?;
        let (conn, p, owners) = (conn.clone(), path.clone(), Arc::clone(&self.owners));
        tokio::spawn(async move {
            signals(conn.clone(), p.clone()).await;
            let _ = conn.object_server().remove::<RequestObject, _>(&p).await;
            forget(&owners, &sender, &p);
        });
        Ok(path)
    }
}

/// The prompt of Generate and Complete (text, no tools), for [`Inference::start`].
fn plain_prompt(
    model: &str,
    prompt: &str,
) -> impl FnOnce(&Shared, &HashMap<String, OwnedValue>, &mut Request) -> Result<Prompt, ApiError> + Send + 'static {
    let (model, prompt) = (model.to_owned(), prompt.to_owned());
    move |sh, o, _| Inference::prompt_ids(sh, &model, &prompt, o)
}

/// Drops a finished request from its owner's list.
fn forget(owners: &Owners, sender: &str, path: &ObjectPath<'_>) {
    let id: Option<RequestId> = path.as_str().rsplit('/').next().and_then(|s| s.parse().ok());
    if let Some(id) = id {
        forget_id(owners, sender, id);
    }
}

/// Drops request `id` from its owner's list.
pub(crate) fn forget_id(owners: &Owners, sender: &str, id: RequestId) {
    if let Ok(mut o) = owners.lock() {
        if let Some(list) = o.get_mut(sender) {
            list.retain(|s| s.id() != id);
            if list.is_empty() {
                o.remove(sender);
            }
        }
    }
}

/// Token counts as the `Finished` signal's `usage`.
pub(crate) fn usage(prompt: usize, completion: usize) -> HashMap<&'static str, Value<'static>> {
    HashMap::from([
        ("prompt_tokens", Value::from(prompt as u32)),
        ("completion_tokens", Value::from(completion as u32)),
        ("total_tokens", Value::from((prompt + completion) as u32)),
    ])
}

/// A token's id, text and log-probability, and its alternatives likewise: the `Logprobs`
/// signal's entries.
type LogprobEntry = (u32, String, f64, Vec<(u32, String, f64)>);

fn logprob_entries(model: &inferd_engine::model::Model, lps: &[Scored]) -> Vec<LogprobEntry> {
    let text = |t: u32| model.tokenizer.decode(&[t], false).unwrap_or_default();
    let entry = |sc: &Scored| {
        let top = sc.top.iter().map(|&(t, lp)| (t, text(t), f64::from(lp))).collect();
        (sc.token, text(sc.token), f64::from(sc.logprob), top)
    };
    lps.iter().map(entry).collect()
}

/// An answer as its request object's signals, unicast to the caller `sender`: a piece of text's
/// log-probabilities (when the caller asked) before the text, tool calls as they complete, then
/// `Finished` with the reason and the usage, or `Failed`.
pub(crate) async fn signals(
    conn: &Connection,
    path: &ObjectPath<'_>,
    sender: &str,
    mut answers: Answers,
    logprobs: bool,
) {
    let Ok(dest) = UniqueName::try_from(sender) else { return };
    let Ok(emitter) = SignalEmitter::new(conn, path.to_owned()) else { return };
    let emitter = emitter.set_destination(BusName::Unique(dest));
    let model = answers.model().cloned();
    let mut reason = Finish::Stop;
    while let Some(a) = answers.next().await {
        let sent = match a {
            Answer::Text { text, token, logprobs: lps, .. } => {
                let mut sent = Ok(());
                if let Some(m) = model.as_ref().filter(|_| logprobs && !lps.is_empty()) {
                    sent = RequestObject::logprobs(&emitter, logprob_entries(&m.model, &lps)).await;
                }
                if !text.is_empty() {
                    sent = sent.and(RequestObject::token(&emitter, &text, token.unwrap_or(u32::MAX)).await);
                }
                sent
            }
            Answer::Reasoning { .. } => Ok(()),
            Answer::Call { call, .. } => {
                RequestObject::tool_call(&emitter, &call.id, &call.name, &call.arguments).await
            }
            Answer::Finish { reason: r, .. } => {
                reason = r;
                Ok(())
            }
            Answer::Done(u) => {
                let _ = RequestObject::finished(&emitter, reason.openai(), usage(u.prompt, u.completion)).await;
                return;
            }
            Answer::Failed(e) => {
                let _ = RequestObject::failed(&emitter, &e.message).await;
                return;
            }
        };
        if sent.is_err() {
            return; // the bus connection is gone: dropping the answer cancels the request
        }
    }
}

/// An answer's whole text (`Complete`).
pub(crate) async fn whole_text(answers: Answers) -> fdo::Result<String> {
    let w = answers.whole().await.map_err(|e| fdo::Error::Failed(e.message))?;
    Ok(w.choices.into_iter().map(|c| c.text).collect())
}

#[interface(name = "org.inferd.Inference1")]
impl Inference {
    /// Starts generating from `prompt`; tokens arrive as signals of the returned request object.
    #[zbus(out_args("request"))]
    async fn generate(
        &self,
        #[zbus(header)] hdr: Header<'_>,
        #[zbus(connection)] conn: &Connection,
        model: &str,
        prompt: &str,
        options: HashMap<String, OwnedValue>,
    ) -> fdo::Result<OwnedObjectPath> {
        let model = match self.route(conn, &hdr, model, || remote::completion(prompt, &options)).await? {
            Routed::Remote(fw) => return self.stream_remote(conn, fw).await,
            Routed::Local(m) => m,
        };
        self.load(conn, &hdr, &model).await?;
        let started = self.start(conn, &hdr, options, plain_prompt(&model, prompt)).await?;
        self.stream(conn, started).await
    }

    /// Starts a chat answer to `messages` (each with `role` and `content`; an assistant's may
    /// have `tool_calls`, a tool result `tool_call_id` and `name`).
    #[zbus(out_args("request"))]
    async fn chat(
        &self,
        #[zbus(header)] hdr: Header<'_>,
        #[zbus(connection)] conn: &Connection,
        model: &str,
        messages: Vec<HashMap<String, String>>,
        options: HashMap<String, OwnedValue>,
    ) -> fdo::Result<OwnedObjectPath> {
        let model = match self.route(conn, &hdr, model, || remote::chat(&messages, &options)).await? {
            Routed::Remote(fw) => return self.stream_remote(conn, fw).await,
            Routed::Local(m) => m,
        };
        self.load(conn, &hdr, &model).await?;
        let ids = move |sh: &Shared, o: &HashMap<String, OwnedValue>, req: &mut Request| {
            Inference::chat_ids(sh, &model, &messages, o, req)
        };
        let started = self.start(conn, &hdr, options, ids).await?;
        self.stream(conn, started).await
    }

    /// Generates from `prompt` and answers with the whole text.
    #[zbus(out_args("text"))]
    async fn complete(
        &self,
        #[zbus(header)] hdr: Header<'_>,
        #[zbus(connection)] conn: &Connection,
        model: &str,
        prompt: &str,
        options: HashMap<String, OwnedValue>,
    ) -> fdo::Result<String> {
        let model = match self.route(conn, &hdr, model, || remote::completion(prompt, &options)).await? {
            Routed::Remote(fw) => return self.complete_remote(fw).await,
            Routed::Local(m) => m,
        };
        self.load(conn, &hdr, &model).await?;
        let Started { answers, sender, .. } = self.start(conn, &hdr, options, plain_prompt(&model, prompt)).await?;
        let id = answers.id().unwrap_or(0);
        let result = whole_text(answers).await;
        forget_id(&self.owners, &sender, id);
        result
    }

    #[zbus(out_args("tokens"))]
    async fn tokenize(
        &self,
        #[zbus(header)] hdr: Header<'_>,
        #[zbus(connection)] conn: &Connection,
        model: &str,
        text: &str,
    ) -> fdo::Result<Vec<u32>> {
        if self.sh.remote_named(model).is_some() {
            return Err(fdo::Error::InvalidArgs(format!("{model} is a remote model: its tokenizer is its upstream's")));
        }
        self.load(conn, &hdr, model).await?;
        let h = self.sh.model(Some(model)).map_err(failed)?;
        h.model.tokenizer.encode(text, false).map_err(|e| fdo::Error::InvalidArgs(e.to_string()))
    }

    /// The embeddings of `inputs`: the mean of the model's final hidden states over each text's tokens, L2-normalized.
    #[zbus(out_args("embeddings"))]
    async fn embed(
        &self,
        #[zbus(header)] hdr: Header<'_>,
        #[zbus(connection)] conn: &Connection,
        model: &str,
        inputs: Vec<String>,
    ) -> fdo::Result<Vec<Vec<f64>>> {
        let mut model = model.to_owned();
        if let Some(r) = self.sh.remote_named(&model) {
            let sender = hdr.sender().ok_or_else(|| fdo::Error::Failed("a call without a sender".into()))?;
            let uid = caller_uid(conn, sender).await?;
            match remote::embed(&self.sh, &r, uid, inputs.clone()).await? {
                Ok(v) => return Ok(v),
                Err(fallback) => model = fallback,
            }
        }
        let model = model.as_str();
        self.load(conn, &hdr, model).await?;
        let h = self.sh.model(Some(model)).map_err(failed)?;
        let sender = hdr.sender().ok_or_else(|| fdo::Error::Failed("a call without a sender".into()))?;
        let uid = caller_uid(conn, sender).await?;
        let inputs = inputs.into_iter().map(super::embed::Input::Text).collect();
        let (v, _) = super::embed::embed(&self.sh, &h, inputs, false, uid, None).await.map_err(failed)?;
        Ok(v.into_iter().map(|e| e.into_iter().map(f64::from).collect()).collect())
    }

    /// Loads `model` now (as its first request would), keeping it for `keep_alive` ("5m", "0",
    /// "-1"; empty: the configured one) once idle; `LoadProgress` signals come meanwhile. The
    /// `keep_alive` of a caller `server.manage` does not name is ignored.
    async fn load_model(
        &self,
        #[zbus(header)] hdr: Header<'_>,
        #[zbus(connection)] conn: &Connection,
        model: &str,
        keep_alive: &str,
    ) -> fdo::Result<()> {
        if self.sh.remote_named(model).is_some() {
            return Ok(()); // nothing to load here: its upstream serves it
        }
        let keep = match keep_alive {
            "" => None,
            k => Some(super::models::parse_keep_alive(k).map_err(fdo::Error::InvalidArgs)?),
        };
        // How long a model stays is model management: from anyone else it is ignored.
        let keep = match hdr.sender() {
            Some(s) if self.sh.managers().may(Some(caller_uid(conn, s).await?)) => keep,
            _ => None,
        };
        self.load(conn, &hdr, model).await?;
        self.sh.models.slot(Some(model).filter(|m| !m.is_empty())).map_err(failed)?.set_keep_alive(keep);
        Ok(())
    }

    /// Unloads `model` as soon as no request holds it; answers whether it was loaded. Model
    /// management: refused (AccessDenied) to callers `server.manage` does not name.
    #[zbus(out_args("was_loaded"))]
    async fn unload_model(
        &self,
        #[zbus(header)] hdr: Header<'_>,
        #[zbus(connection)] conn: &Connection,
        model: &str,
    ) -> fdo::Result<bool> {
        let uid = match hdr.sender() {
            Some(s) => Some(caller_uid(conn, s).await?),
            None => None,
        };
        self.sh.managers().check(uid, &format!("unloading {model}")).map_err(failed)?;
        if self.sh.remote_named(model).is_some() {
            return Ok(false);
        }
        self.sh.models.unload(model).map_err(failed)
    }

    /// How far a load this caller waits for has come: bytes of weights read of the total.
    #[zbus(signal)]
    async fn load_progress(emitter: &SignalEmitter<'_>, model: &str, done: u64, total: u64) -> zbus::Result<()>;

    #[zbus(property)]
    async fn models(&self) -> Vec<String> {
        self.sh.rescan_store().await;
        let mut names: Vec<String> = self.sh.models.slots().iter().map(|m| m.name.clone()).collect();
        names.extend(self.sh.remote_models().iter().map(|r| r.name.clone()));
        names
    }

    #[zbus(property)]
    async fn strategies(&self) -> Vec<String> {
        self.sh.registry().names()
    }

    /// Every model the daemon serves, loaded or not, as its file says: `name`, `loaded`,
    /// `source` ("config" or "store"), `path`, `size` (bytes), `file_type`, `architecture`,
    /// `context_length` (trained), `parameters`; a remote model has `name`, `loaded` (false),
    /// `source` ("remote"), `upstream` and `upstream_model`.
    #[zbus(property)]
    async fn model_details(&self) -> Vec<HashMap<String, OwnedValue>> {
        self.sh.rescan_store().await;
        let detail = |slot: &super::models::Slot| {
            let mut d: HashMap<String, OwnedValue> = HashMap::new();
            let mut put = |k: &str, v: Value<'_>| {
                if let Ok(o) = OwnedValue::try_from(v) {
                    d.insert(k.to_owned(), o);
                }
            };
            put("name", Value::from(slot.name.as_str()));
            put("loaded", Value::from(slot.loaded().is_some()));
            let source = if slot.source == super::models::Source::Store { "store" } else { "config" };
            put("source", Value::from(source));
            put("path", Value::from(slot.config.path.display().to_string()));
            if let Some(f) = &slot.facts {
                put("size", Value::from(f.size));
                put("file_type", Value::from(f.file_type.as_str()));
                put("architecture", Value::from(f.architecture.as_str()));
                put("context_length", Value::from(f.context_len));
                put("parameters", Value::from(f.parameters));
            }
            d
        };
        let mut list: Vec<_> = self.sh.models.slots().iter().map(|s| detail(s)).collect();
        for r in self.sh.remote_models() {
            let mut d: HashMap<String, OwnedValue> = HashMap::new();
            let fields = [
                ("name", r.name.as_str()),
                ("source", "remote"),
                ("upstream", r.upstream.as_str()),
                ("upstream_model", r.upstream_model.as_str()),
            ];
            for (k, v) in fields {
                if let Ok(o) = OwnedValue::try_from(Value::from(v)) {
                    d.insert(k.to_owned(), o);
                }
            }
            if let Ok(o) = OwnedValue::try_from(Value::from(false)) {
                d.insert("loaded".to_owned(), o);
            }
            list.push(d);
        }
        list
    }

    #[zbus(property)]
    async fn status(&self) -> HashMap<String, OwnedValue> {
        let mut st: HashMap<String, OwnedValue> = HashMap::new();
        let mut put = |k: &str, v: Value<'_>| {
            if let Ok(o) = OwnedValue::try_from(v) {
                st.insert(k.to_owned(), o);
            }
        };
        let (mut running, mut waiting, mut total, mut free, mut cached) = (0u32, 0u32, 0u32, 0u32, 0u32);
        for m in self.sh.models.loaded() {
            let s = m.monitor.snapshot();
            running += s.running as u32;
            waiting += s.waiting as u32;
            total += s.kv.total as u32;
            free += s.kv.free as u32;
            cached += s.kv.cached as u32;
        }
        put(
            "state",
            Value::from(if self.sh.draining.load(std::sync::atomic::Ordering::Relaxed) { "stopping" } else { "ready" }),
        );
        put("uptime_seconds", Value::from(self.sh.started.elapsed().as_secs_f64()));
        put("running", Value::from(running));
        put("waiting", Value::from(waiting));
        put("kv_blocks_total", Value::from(total));
        put("kv_blocks_free", Value::from(free));
        put("kv_blocks_cached", Value::from(cached));
        st
    }
}

/// One request in flight, as a D-Bus object.
pub struct RequestObject {
    stop: Stop,
    owner: String,
}

#[interface(name = "org.inferd.Inference1.Request")]
impl RequestObject {
    /// Stops the request; only its caller may.
    async fn cancel(&self, #[zbus(header)] hdr: Header<'_>) -> fdo::Result<()> {
        if hdr.sender().map(|s| s.as_str()) != Some(self.owner.as_str()) {
            return Err(fdo::Error::AccessDenied("only the caller that started a request may cancel it".into()));
        }
        self.stop.stop();
        Ok(())
    }

    /// A piece of text and the token that completed it.
    #[zbus(signal)]
    pub(crate) async fn token(emitter: &SignalEmitter<'_>, text: &str, token_id: u32) -> zbus::Result<()>;

    /// The log-probabilities of the tokens whose text the next `Token` signal carries (only
    /// for a request with the `logprobs` option): per token its id, text and log-probability,
    /// and its most probable alternatives likewise (`top_logprobs` of them).
    #[zbus(signal)]
    async fn logprobs(emitter: &SignalEmitter<'_>, tokens: Vec<LogprobEntry>) -> zbus::Result<()>;

    /// A tool call of a chat answer (a chat with `tools`): its id, the function's name and the
    /// arguments as JSON text.
    #[zbus(signal)]
    pub(crate) async fn tool_call(
        emitter: &SignalEmitter<'_>,
        id: &str,
        name: &str,
        arguments: &str,
    ) -> zbus::Result<()>;

    /// The request ended: `reason` is "stop", "length" or "tool_calls"; `usage` has the token
    /// counts.
    #[zbus(signal)]
    pub(crate) async fn finished(
        emitter: &SignalEmitter<'_>,
        reason: &str,
        usage: HashMap<&str, Value<'_>>,
    ) -> zbus::Result<()>;

    #[zbus(signal)]
    pub(crate) async fn failed(emitter: &SignalEmitter<'_>, message: &str) -> zbus::Result<()>;
}

/// Connects to the mode's bus, serves the interface and owns the name; a task cancels the
/// requests of callers that leave the bus.
pub async fn serve(sh: Arc<Shared>, mode: Mode) -> zbus::Result<Connection> {
    let owners: Owners = Arc::default();
    let iface = Inference { sh, owners: Arc::clone(&owners) };
    let builder = match mode {
        Mode::System => zbus::connection::Builder::system()?,
        Mode::User => zbus::connection::Builder::session()?,
    };
    let conn = builder.serve_at(PATH, iface)?.name(NAME)?.build().await?;
    let proxy = fdo::DBusProxy::new(&conn).await?;
    let mut gone = proxy.receive_name_owner_changed().await?;
    tokio::spawn(async move {
        use tokio_stream::StreamExt;
        while let Some(sig) = gone.next().await {
            let Ok(args) = sig.args() else { continue };
            if args.new_owner().is_some() {
                continue;
            }
            let name = args.name().to_string();
            let left = owners.lock().ok().and_then(|mut o| o.remove(&name));
            for stop in left.into_iter().flatten() {
                stop.stop();
            }
        }
    });
    Ok(conn)
}
