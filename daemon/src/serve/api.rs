//! What every edge of the service shares and nothing of the service's own: the error a request
//! is refused with ([`ApiError`], which each dialect writes in its own shape) and the reading of
//! a JSON body ([`object`], [`model_field`]). A leaf: it imports no other module of `serve`, so
//! the dialects (OpenAI's, Ollama's, Anthropic's, the Responses API, llama-server's `/infill`,
//! D-Bus) depend on it rather than on each other.

use serde_json::{Map, Value};

/// A request refused, with the HTTP status that fits.
#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
    pub param: Option<&'static str>,
}

impl ApiError {
    pub fn bad(message: impl Into<String>, param: &'static str) -> ApiError {
        ApiError { status: 400, message: message.into(), param: Some(param) }
    }
    pub fn new(status: u16, message: impl Into<String>, param: Option<&'static str>) -> ApiError {
        ApiError { status, message: message.into(), param }
    }
    /// The OpenAI error type for the status.
    pub fn kind(&self) -> &'static str {
        match self.status {
            400 | 404 | 413 => "invalid_request_error",
            429 => "rate_limit_error",
            _ => "server_error",
        }
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

/// A request body as a JSON object, or why it is not one.
/// The body as a JSON object, or the 400 that says why not.
pub fn object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    let text = std::str::from_utf8(body).map_err(|_| ApiError::bad("the request body is not valid UTF-8", "body"))?;
    match serde_json::from_str::<Value>(text) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(ApiError::bad("the request body must be a JSON object", "body")),
        Err(e) => Err(ApiError::bad(format!("malformed JSON: {e}"), "body")),
    }
}

pub fn model_field(m: &Map<String, Value>) -> Result<Option<&str>, ApiError> {
    match m.get("model") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(ApiError::bad("model must be a string", "model")),
    }
}
