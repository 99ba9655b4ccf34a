//! D-Bus call options (`a{sv}`) as request fields: the D-Bus types map straight onto
//! [`Field`]s and go through the same checks as the HTTP fields (`fields.rs`); a chat's
//! messages, tool options and images (file descriptors) become the JSON body the HTTP edge
//! reads (`chat.rs`).

use super::api::ApiError;
use super::fields::{self, Field};
use inferd_engine::plugin::session::MAX_TOP_LOGPROBS;
use inferd_engine::request::Request;
use serde_json::{Map, Value as Json};
use std::collections::HashMap;
use zbus::zvariant::{OwnedValue, Value};

/// An `a{sv}` option as a request [`Field`]: the D-Bus types map straight onto the fields'
/// (integers, doubles, strings, string arrays); `decoder_params`, `logit_bias` and
/// `response_format` travel as JSON text, as the interface documents.
pub(crate) fn option_field(key: &str, v: &Value<'_>) -> Result<Field, ApiError> {
    Ok(match v {
        Value::Value(inner) => return option_field(key, inner),
        Value::Bool(b) => Field::Bool(*b),
        Value::U8(x) => Field::Int((*x).into()),
        Value::I16(x) => Field::Int((*x).into()),
        Value::U16(x) => Field::Int((*x).into()),
        Value::I32(x) => Field::Int((*x).into()),
        Value::U32(x) => Field::Int((*x).into()),
        Value::I64(x) => Field::Int((*x).into()),
        Value::U64(x) => Field::Int((*x).into()),
        Value::F64(x) => Field::Number(*x),
        Value::Str(s) if key == "decoder_params" || key == "response_format" => Field::Object(s.to_string()),
        Value::Str(s) if key == "logit_bias" => {
            let bias: HashMap<String, f64> = serde_json::from_str(s)
                .map_err(|e| ApiError::bad(format!("logit_bias is not a JSON object of numbers: {e}"), "logit_bias"))?;
            let mut list = bias
                .into_iter()
                .map(|(t, b)| t.parse::<u32>().map(|t| (t, b)))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|_| ApiError::bad("logit_bias maps token ids to numbers", "logit_bias"))?;
            list.sort_by_key(|e| e.0);
            Field::Bias(list)
        }
        Value::Str(s) => Field::Str(s.to_string()),
        Value::Array(a) => {
            match a.iter().map(|x| if let Value::Str(s) = x { Some(s.to_string()) } else { None }).collect() {
                Some(strs) => Field::Strs(strs),
                None => Field::Other("an array"),
            }
        }
        _ => Field::Other("another type"),
    })
}

/// Options that are no request field: log-probabilities, and a chat's tools and images.
pub(crate) const CALL_OPTIONS: [&str; 6] =
    ["logprobs", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls", "images"];

/// The `a{sv}` options of a call as a typed request, checked like the HTTP fields.
pub(crate) fn options_request(options: &HashMap<String, OwnedValue>) -> Result<Request, ApiError> {
    let fields = options
        .iter()
        .filter(|(k, _)| !CALL_OPTIONS.contains(&k.as_str()))
        .map(|(k, v)| option_field(k, v).map(|f| (k.clone(), f)))
        .collect::<Result<Vec<_>, _>>()?;
    let mut req = fields::build(fields)?;
    if req.n.is_some_and(|n| n != 1) {
        return Err(ApiError::bad("over D-Bus a request has one choice (n = 1)", "n"));
    }
    let get = |k: &str| options.get(k).map(|v| option_field(k, v)).transpose();
    let top = match get("top_logprobs")? {
        None => None,
        Some(Field::Int(k)) if (0..=i128::from(MAX_TOP_LOGPROBS)).contains(&k) => Some(k as u32),
        Some(_) => {
            let why = format!("top_logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}");
            return Err(ApiError::bad(why, "top_logprobs"));
        }
    };
    req.logprobs = match (get("logprobs")?, top) {
        (Some(Field::Bool(true)), k) => Some(k.unwrap_or(0)),
        (None | Some(Field::Bool(false)), Some(k)) if k > 0 => {
            return Err(ApiError::bad("top_logprobs needs logprobs: true", "top_logprobs"))
        }
        (None | Some(Field::Bool(false)), _) => None,
        (Some(_), _) => return Err(ApiError::bad("logprobs must be a boolean", "logprobs")),
    };
    Ok(req)
}

/// A chat call as the JSON body the HTTP edge reads: each message's `role`, `content`,
/// `tool_calls` (JSON text), `tool_call_id` and `name`; the options `tools` (JSON text),
/// `tool_choice` ("auto", "none", "required" or JSON text naming a function),
/// `parallel_tool_calls` and `images` ([`images`]: each message's images as `data:` URL
/// content parts before its text).
pub(crate) fn chat_body(
    messages: &[HashMap<String, String>],
    options: &HashMap<String, OwnedValue>,
) -> Result<Map<String, Json>, ApiError> {
    let mut list = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        let mut msg = Map::new();
        for (k, v) in m {
            let value = match k.as_str() {
                "role" | "content" | "tool_call_id" | "name" => Json::String(v.clone()),
                "tool_calls" => serde_json::from_str(v)
                    .map_err(|e| ApiError::bad(format!("messages[{i}].tool_calls is not JSON: {e}"), "messages"))?,
                _ => return Err(ApiError::bad(format!("messages[{i}] has an unknown key {k:?}"), "messages")),
            };
            msg.insert(k.clone(), value);
        }
        list.push(Json::Object(msg));
    }
    for (i, bytes) in options.get("images").map(|v| images(v, list.len())).transpose()?.unwrap_or_default() {
        use base64::Engine as _;
        let url = format!("data:image/png;base64,{}", base64::engine::general_purpose::STANDARD.encode(bytes));
        let part = serde_json::json!({ "type": "image_url", "image_url": { "url": url } });
        let msg = &mut list[i];
        match msg.get_mut("content") {
            Some(Json::Array(parts)) => parts.insert(parts.iter().filter(|p| p["type"] == "image_url").count(), part),
            other => {
                let text = other.and_then(|t| t.as_str()).unwrap_or_default().to_string();
                msg["content"] = serde_json::json!([part, { "type": "text", "text": text }]);
            }
        }
    }
    let mut body = Map::new();
    body.insert("messages".into(), Json::Array(list));
    for key in ["tools", "tool_choice", "parallel_tool_calls"] {
        let Some(v) = options.get(key) else { continue };
        let json = match option_field(key, v)? {
            Field::Bool(b) if key == "parallel_tool_calls" => Json::Bool(b),
            Field::Str(s) if key == "tool_choice" && !s.trim_start().starts_with('{') => Json::String(s),
            Field::Str(s) if key != "parallel_tool_calls" => {
                serde_json::from_str(&s).map_err(|e| ApiError::bad(format!("{key} is not JSON: {e}"), "tools"))?
            }
            _ => return Err(ApiError::bad(format!("{key} has the wrong type"), "tools")),
        };
        body.insert(key.into(), json);
    }
    Ok(body)
}

/// A chat's `images` option, `a(uh)`: for each image the index of its message and a file
/// descriptor holding it (a regular file opened for reading or a memfd, so a sandboxed app
/// passes pixels without a path), read from its start as it stands when the call arrives, at
/// most the decoder's byte limit. Pipes and sockets are refused: reading one could wait
/// forever.
fn images(v: &Value<'_>, messages: usize) -> Result<Vec<(usize, Vec<u8>)>, ApiError> {
    use std::os::fd::AsFd;
    use std::os::unix::fs::FileExt;
    let bad = |what: String| ApiError::bad(format!("images: {what}"), "images");
    let v = if let Value::Value(inner) = v { inner.as_ref() } else { v };
    let Value::Array(list) = v else { return Err(bad("must be an array of (message index, file descriptor)".into())) };
    let max = inferd_engine::vision::ImageLimits::default().max_bytes;
    let mut out = Vec::with_capacity(list.len());
    for (j, item) in list.iter().enumerate() {
        let pair = match item {
            Value::Structure(s) => s.fields(),
            _ => return Err(bad(format!("[{j}] must be a (message index, file descriptor) pair"))),
        };
        let (i, fd) = match pair {
            [Value::U32(i), Value::Fd(fd)] => (*i as usize, fd),
            _ => return Err(bad(format!("[{j}] must be a (u, h) pair"))),
        };
        if i >= messages {
            return Err(bad(format!("[{j}] names message {i} of {messages}")));
        }
        let file = fd
            .as_fd()
            .try_clone_to_owned()
            .map(std::fs::File::from)
            .map_err(|e| bad(format!("[{j}]: the file descriptor: {e}")))?;
        let meta = file.metadata().map_err(|e| bad(format!("[{j}]: {e}")))?;
        if !meta.is_file() {
            return Err(bad(format!("[{j}] is no file or memfd (reading a pipe or socket could block)")));
        }
        if meta.len() > max as u64 {
            return Err(bad(format!("[{j}] is {} bytes, over the limit of {max}", meta.len())));
        }
        let mut bytes = vec![0u8; meta.len() as usize];
        let mut at = 0;
        while at < bytes.len() {
            match file.read_at(&mut bytes[at..], at as u64) {
                Ok(0) => break,
                Ok(n) => at += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(bad(format!("[{j}]: reading it: {e}"))),
            }
        }
        bytes.truncate(at);
        out.push((i, bytes));
    }
    Ok(out)
}
