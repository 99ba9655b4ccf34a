//! Request fields from either edge into one typed [`Request`]: each edge turns its own values
//! (JSON for HTTP, `a{sv}` variants for D-Bus) into [`Field`]s, and [`build`] reads them by
//! name with the same checks and the same error messages for both.

use super::api::ApiError;
use inferd_engine::constraint::ResponseFormat;
use inferd_engine::request::{Decoder, Request};
use inferd_engine::sched::Priority;
use serde_json::{Map, Value};

/// The request fields both edges take (HTTP ignores other keys, D-Bus refuses them).
pub const FIELDS: [&str; 18] = [
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "decoder",
    "decoder_params",
    "frequency_penalty",
    "presence_penalty",
    "repeat_penalty",
    "repeat_last_n",
    "priority",
    "n",
    "logit_bias",
    "response_format",
];

/// One field's value, as the edge found it.
#[derive(Clone, Debug, PartialEq)]
pub enum Field {
    /// A whole number (negative ones too: the check says what is allowed).
    Int(i128),
    Number(f64),
    Bool(bool),
    Str(String),
    Strs(Vec<String>),
    /// A JSON object's text (`decoder_params`, `response_format`).
    Object(String),
    /// Token ids and biases (`logit_bias`).
    Bias(Vec<(u32, f64)>),
    /// Anything else; named for the error message.
    Other(&'static str),
}

impl Field {
    /// The value as JSON, for a request forwarded to a remote model.
    pub fn to_json(&self) -> Value {
        match self {
            Field::Int(x) => i64::try_from(*x).map_or_else(|_| Value::from(*x as f64), Value::from),
            Field::Number(x) => Value::from(*x),
            Field::Bool(b) => Value::Bool(*b),
            Field::Str(s) => Value::String(s.clone()),
            Field::Strs(v) => Value::from(v.clone()),
            Field::Object(text) => serde_json::from_str(text).unwrap_or_else(|_| Value::String(text.clone())),
            Field::Bias(list) => Value::Object(list.iter().map(|(t, b)| (t.to_string(), Value::from(*b))).collect()),
            Field::Other(_) => Value::Null,
        }
    }
}

fn want(key: &str, what: &str) -> ApiError {
    ApiError::bad(format!("{key} must be {what}"), param(key))
}

/// The field's name as a `'static` str for [`ApiError::param`].
fn param(key: &str) -> &'static str {
    FIELDS.iter().find(|f| **f == key).copied().unwrap_or("options")
}

fn uint(key: &str, v: Field) -> Result<u64, ApiError> {
    match v {
        Field::Int(x) if (0..=i128::from(u64::MAX)).contains(&x) => Ok(x as u64),
        _ => Err(want(key, "a non-negative integer")),
    }
}

fn number(key: &str, v: Field) -> Result<f64, ApiError> {
    match v {
        Field::Int(x) => Ok(x as f64),
        Field::Number(x) => Ok(x),
        _ => Err(want(key, "a number")),
    }
}

/// Builds the request from `fields` (each at most once; unknown names are errors).
pub fn build(fields: impl IntoIterator<Item = (String, Field)>) -> Result<Request, ApiError> {
    let mut r = Request::default();
    let mut decoder: Option<String> = None;
    let mut params: Option<String> = None;
    let mut completion_tokens: Option<u64> = None;
    for (key, v) in fields {
        let k = key.as_str();
        let s = &mut r.sampling;
        match k {
            "max_tokens" => r.max_tokens = Some(uint(k, v)?),
            // OpenAI's newer name for max_tokens.
            "max_completion_tokens" => completion_tokens = Some(uint(k, v)?),
            "n" => r.n = Some(uint(k, v)?),
            "seed" => r.seed = Some(uint(k, v)?),
            "top_k" => s.top_k = Some(uint(k, v)?),
            "temperature" => s.temperature = Some(number(k, v)?),
            "top_p" => s.top_p = Some(number(k, v)?),
            "min_p" => s.min_p = Some(number(k, v)?),
            "frequency_penalty" => s.frequency_penalty = Some(number(k, v)?),
            "presence_penalty" => s.presence_penalty = Some(number(k, v)?),
            "repeat_penalty" => s.repeat_penalty = Some(number(k, v)?),
            "repeat_last_n" => s.repeat_last_n = Some(uint(k, v)?),
            "logit_bias" => match v {
                Field::Bias(b) => s.logit_bias = b,
                _ => return Err(want(k, "an object of token ids and numbers")),
            },
            "stop" => match v {
                Field::Str(x) => r.stop = vec![x],
                Field::Strs(x) => r.stop = x,
                _ => return Err(want(k, "a string or an array of strings")),
            },
            "priority" => match v {
                Field::Str(x) => {
                    r.priority = Priority::parse(&x).ok_or_else(|| want(k, "\"interactive\" or \"background\""))?;
                }
                _ => return Err(want(k, "\"interactive\" or \"background\"")),
            },
            "decoder" => match v {
                Field::Str(x) => decoder = Some(x),
                _ => return Err(want(k, "a string")),
            },
            "decoder_params" => match v {
                Field::Object(x) => params = Some(x),
                _ => return Err(want(k, "a JSON object")),
            },
            "response_format" => match v {
                Field::Object(x) => r.response_format = response_format(&x)?,
                _ => return Err(want(k, "a JSON object")),
            },
            _ => return Err(ApiError::bad(format!("unknown option {k:?} (known: {})", FIELDS.join(", ")), "options")),
        }
    }
    r.decoder = decoder.map(|name| Decoder { name, params });
    match (r.max_tokens, completion_tokens) {
        (Some(a), Some(b)) if a != b => {
            return Err(ApiError::bad(
                format!("max_tokens ({a}) and max_completion_tokens ({b}) disagree: send one"),
                "max_completion_tokens",
            ))
        }
        (None, b) => r.max_tokens = b,
        _ => {}
    }
    Ok(r)
}

/// OpenAI's `response_format` (and llama-server's shorthand, a `schema` beside the type):
/// `text` is free output, `json_object` any JSON object, `json_schema` JSON under
/// `json_schema.schema`. The schema is enforced whether `strict` is true or not (OpenAI
/// enforces it only when strict; following it is never wrong).
pub fn response_format(text: &str) -> Result<Option<ResponseFormat>, ApiError> {
    const P: &str = "response_format";
    let bad = |m: String| ApiError::bad(m, P);
    let v: Value = serde_json::from_str(text).map_err(|e| bad(format!("response_format is not JSON: {e}")))?;
    let o = v.as_object().ok_or_else(|| bad("response_format must be an object".into()))?;
    let schema_of = |s: &Value| match s {
        Value::Object(_) => Ok(ResponseFormat::JsonSchema(s.clone())),
        _ => Err(bad("the JSON schema must be an object".into())),
    };
    let kind = o.get("type").and_then(Value::as_str).unwrap_or_default();
    let allowed: &[&str] = match kind {
        "text" => &["type"],
        "json_object" | "json_schema" => &["type", "schema", "json_schema"],
        _ => return Err(bad(format!("response_format.type must be text, json_object or json_schema, not {kind:?}"))),
    };
    if let Some(k) = o.keys().find(|k| !allowed.contains(&k.as_str())) {
        return Err(bad(format!("response_format.{k} is not supported with type {kind}")));
    }
    match (kind, o.get("schema"), o.get("json_schema")) {
        ("text", _, _) => Ok(None),
        ("json_object", None, None) => Ok(Some(ResponseFormat::JsonObject)),
        (_, Some(s), None) => schema_of(s).map(Some),
        ("json_schema", None, Some(Value::Object(js))) => {
            for (k, v) in js {
                let ok = match k.as_str() {
                    "name" | "description" => v.is_string(),
                    "strict" => v.is_boolean() || v.is_null(),
                    "schema" => true,
                    _ => return Err(bad(format!("response_format.json_schema.{k} is not supported"))),
                };
                if !ok {
                    return Err(bad(format!("response_format.json_schema.{k} has the wrong type")));
                }
            }
            let s = js.get("schema").ok_or_else(|| bad("response_format.json_schema.schema is missing".into()))?;
            schema_of(s).map(Some)
        }
        ("json_schema", None, _) => Err(bad("response_format.json_schema must be an object with a schema".into())),
        _ => Err(bad("response_format has both schema and json_schema: send one".into())),
    }
}

/// The request fields of a completion or chat body, typed (the route's own keys are read by
/// the route: `model`, `prompt` or `messages`, `stream`, `stream_options`).
pub fn typed(m: &Map<String, Value>) -> Result<Request, ApiError> {
    let mut fields = Vec::new();
    for key in FIELDS {
        let Some(v) = m.get(key).filter(|v| !v.is_null()) else { continue };
        let f = match v {
            Value::Number(x) => match (x.as_i64(), x.as_u64()) {
                (Some(i), _) => Field::Int(i.into()),
                (None, Some(u)) => Field::Int(u.into()),
                _ => Field::Number(x.as_f64().unwrap_or(f64::NAN)),
            },
            Value::Bool(b) => Field::Bool(*b),
            // decoder_params may come as the object's JSON text too.
            Value::String(t) if key == "decoder_params" => Field::Object(t.clone()),
            Value::String(t) => Field::Str(t.clone()),
            Value::Array(a) => match a.iter().map(|x| x.as_str().map(str::to_owned)).collect::<Option<Vec<_>>>() {
                Some(strs) => Field::Strs(strs),
                None => Field::Other("an array"),
            },
            Value::Object(o) if key == "logit_bias" => Field::Bias(
                o.iter()
                    .map(|(t, b)| match (t.parse::<u32>(), b.as_f64()) {
                        (Ok(t), Some(b)) => Ok((t, b)),
                        _ => Err(ApiError::bad("logit_bias maps token ids to numbers", "logit_bias")),
                    })
                    .collect::<Result<_, _>>()?,
            ),
            Value::Object(o) => Field::Object(Value::Object(o.clone()).to_string()),
            Value::Null => continue,
        };
        fields.push((key.to_owned(), f));
    }
    build(fields)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_become_a_typed_request_with_one_message_per_mistake() {
        let f = |k: &str, v: Field| (k.to_string(), v);
        let r = build([
            f("max_tokens", Field::Int(8)),
            f("temperature", Field::Int(1)),
            f("stop", Field::Str("\n".into())),
            f("priority", Field::Str("background".into())),
            f("logit_bias", Field::Bias(vec![(3, -1.5)])),
        ])
        .unwrap();
        assert_eq!(r.max_tokens, Some(8));
        assert_eq!(r.sampling.temperature, Some(1.0));
        assert_eq!(r.stop, vec!["\n"]);
        assert_eq!(r.priority, Priority::Background);
        assert_eq!(r.sampling.logit_bias, vec![(3, -1.5)]);
        let rf = |t: &str| build([f("response_format", Field::Object(t.into()))]).unwrap().response_format;
        assert_eq!(rf(r#"{"type": "text"}"#), None);
        assert_eq!(rf(r#"{"type": "json_object"}"#), Some(ResponseFormat::JsonObject));
        let schema = serde_json::json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let want = Some(ResponseFormat::JsonSchema(schema.clone()));
        let openai =
            serde_json::json!({"type": "json_schema", "json_schema": {"name": "a", "strict": true, "schema": schema}});
        assert_eq!(rf(&openai.to_string()), want);
        assert_eq!(rf(&serde_json::json!({"type": "json_object", "schema": schema}).to_string()), want);
        assert_eq!(build([f("max_completion_tokens", Field::Int(5))]).unwrap().max_tokens, Some(5));
        let both = [f("max_tokens", Field::Int(5)), f("max_completion_tokens", Field::Int(5))];
        assert_eq!(build(both).unwrap().max_tokens, Some(5));
        let e = build([f("max_tokens", Field::Int(5)), f("max_completion_tokens", Field::Int(6))]).unwrap_err();
        assert!(e.message.contains("disagree"), "{}", e.message);
        for (field, message) in [
            (f("max_tokens", Field::Int(-1)), "max_tokens must be a non-negative integer"),
            (f("max_tokens", Field::Number(1.5)), "max_tokens must be a non-negative integer"),
            (f("top_p", Field::Str("high".into())), "top_p must be a number"),
            (f("stop", Field::Other("an integer")), "stop must be a string or an array of strings"),
            (f("priority", Field::Str("urgent".into())), "priority must be \"interactive\" or \"background\""),
            (f("decoder_params", Field::Str("{}".into())), "decoder_params must be a JSON object"),
            (f("colour", Field::Bool(true)), "unknown option \"colour\""),
            (f("response_format", Field::Str("json".into())), "response_format must be a JSON object"),
            (f("response_format", Field::Object(r#"{"type": "xml"}"#.into())), "response_format.type must be"),
            (
                f("response_format", Field::Object(r#"{"type": "json_schema"}"#.into())),
                "response_format.json_schema must",
            ),
            (
                f("response_format", Field::Object(r#"{"type": "json_schema", "json_schema": {"schema": 3}}"#.into())),
                "the JSON schema must be an object",
            ),
            (
                f("response_format", Field::Object(r#"{"type": "json_object", "grammar": "x"}"#.into())),
                "response_format.grammar is not supported",
            ),
        ] {
            let e = build([field.clone()]).unwrap_err();
            assert!(e.message.starts_with(message), "{field:?}: {}", e.message);
            assert_eq!(e.status, 400);
        }
    }
}
