//! Chat requests at the edges: OpenAI's and Ollama's JSON for messages (text parts, earlier tool
//! calls, tool results), `tools` and `tool_choice`, turned into the engine's [`ChatMessage`]s
//! and [`Tool`]s; the prompt rendered with them; and tool calls written back in each API's
//! shape.

use super::api::ApiError;
use super::Shared;
use inferd_engine::chat::ChatMessage;
use inferd_engine::model::Model;
use inferd_engine::request::Request;
use inferd_engine::template_host::Template;
use inferd_engine::tokenizer::literal::Literals;
use inferd_engine::tools::{Tool, ToolCall, ToolChoice, ToolFormat};
use inferd_engine::vision::media::PromptImage;
use inferd_engine::vision::RgbImage;
use serde_json::{json, Map, Value};
use std::sync::Arc;

/// A chat request's tools: what the model is offered and must do.
#[derive(Clone, Debug)]
pub struct Tools {
    pub tools: Vec<Tool>,
    pub choice: ToolChoice,
    /// More than one call per answer (`parallel_tool_calls`, default true).
    pub parallel: bool,
    pub format: ToolFormat,
}

impl Tools {
    /// The answer may hold calls to parse out.
    pub fn active(&self) -> bool {
        !self.tools.is_empty() && self.choice != ToolChoice::None
    }

    /// `tools`, `tool_choice` and `parallel_tool_calls` of a body (OpenAI's shapes; Ollama's
    /// `tools` is the same list).
    pub fn of(m: &Map<String, Value>, model: &Model) -> Result<Tools, ApiError> {
        let bad = |m: String| ApiError::bad(m, "tools");
        let mut tools = Vec::new();
        // The tools' schemas become one grammar when a call is required: they share its bounds.
        let mut budget = inferd_engine::constraint::limits::SchemaBudget::default();
        match m.get("tools") {
            None | Some(Value::Null) => {}
            Some(Value::Array(list)) => {
                for (i, t) in list.iter().enumerate() {
                    if t.get("type").and_then(Value::as_str) != Some("function") {
                        return Err(bad(format!("tools[{i}].type must be \"function\"")));
                    }
                    let f = t
                        .get("function")
                        .and_then(Value::as_object)
                        .ok_or_else(|| bad(format!("tools[{i}].function must be an object")))?;
                    let name = f.get("name").and_then(Value::as_str).unwrap_or_default();
                    let ok = (1..=64).contains(&name.len())
                        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
                    if !ok {
                        return Err(bad(format!("tools[{i}].function.name must be 1 to 64 letters, digits, _ or -")));
                    }
                    if tools.iter().any(|x: &Tool| x.name == name) {
                        return Err(bad(format!("two tools are named {name:?}")));
                    }
                    let parameters = match f.get("parameters") {
                        None | Some(Value::Null) => json!({ "type": "object", "properties": {} }),
                        Some(p @ Value::Object(_)) => p.clone(),
                        Some(_) => {
                            return Err(bad(format!("tools[{i}].function.parameters must be a JSON schema object")))
                        }
                    };
                    budget.check(&parameters).map_err(|e| bad(format!("tools[{i}].function.parameters: {e}")))?;
                    let description = f.get("description").and_then(Value::as_str).map(str::to_owned);
                    tools.push(Tool { name: name.to_owned(), description, parameters });
                }
            }
            Some(_) => return Err(bad("tools must be an array".into())),
        }
        let bad = |m: String| ApiError::bad(m, "tool_choice");
        let choice = match m.get("tool_choice") {
            None | Some(Value::Null) => ToolChoice::Auto,
            Some(Value::String(s)) => match s.as_str() {
                "auto" => ToolChoice::Auto,
                "none" => ToolChoice::None,
                "required" => ToolChoice::Required,
                _ => return Err(bad(format!("tool_choice must be auto, none, required or a function, not {s:?}"))),
            },
            Some(v) => match v.pointer("/function/name").and_then(Value::as_str) {
                Some(name) if v.get("type").and_then(Value::as_str) == Some("function") => {
                    ToolChoice::Function(name.to_owned())
                }
                _ => return Err(bad("tool_choice must be auto, none, required or {\"type\": \"function\", \"function\": {\"name\": ...}}".into())),
            },
        };
        match &choice {
            ToolChoice::Required | ToolChoice::Function(_) if tools.is_empty() => {
                return Err(bad("tool_choice asks for a call, but the request has no tools".into()))
            }
            ToolChoice::Function(name) if !tools.iter().any(|t| &t.name == name) => {
                return Err(bad(format!("tool_choice names {name:?}, which is not among the tools")))
            }
            _ => {}
        }
        let parallel = match m.get("parallel_tool_calls") {
            None | Some(Value::Null) => true,
            Some(Value::Bool(b)) => *b,
            Some(_) => return Err(ApiError::bad("parallel_tool_calls must be true or false", "parallel_tool_calls")),
        };
        Ok(Tools { tools, choice, parallel, format: ToolFormat::detect(model.chat_template.as_deref()) })
    }

    /// A required or named call shapes the answer through the request's response format.
    pub fn constrain(
        &self,
        req: &mut Request,
        vocab: Option<&inferd_engine::constraint::Vocabulary>,
    ) -> Result<(), ApiError> {
        let Some(v) = vocab else {
            return match self.choice {
                ToolChoice::Required | ToolChoice::Function(_) => Err(ApiError::bad(
                    "this model cannot be made to call a tool (no end-of-sequence token)",
                    "tool_choice",
                )),
                _ => Ok(()),
            };
        };
        if let Some(g) = self.format.grammar(v, &self.tools, &self.choice, self.parallel) {
            if req.response_format.is_some() {
                return Err(ApiError::bad(
                    "response_format and a required tool call cannot both shape the answer",
                    "response_format",
                ));
            }
            req.response_format = Some(g);
        }
        Ok(())
    }
}

/// One message's content: a string, or an array of content parts whose text parts are joined
/// and whose images (`image_url` parts with `data:` URLs) become [`media_marker`]s, their
/// pixels pushed to `images` (other part types are refused by name); `null` or absent (an
/// assistant's) is empty.
fn content(i: usize, v: Option<&Value>, images: &mut Vec<Arc<RgbImage>>) -> Result<String, ApiError> {
    let bad = |what: String| ApiError::bad(format!("messages[{i}]: {what}"), "messages");
    match v {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(c)) => Ok(c.clone()),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for (j, part) in parts.iter().enumerate() {
                match (part.get("type").and_then(Value::as_str), part.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(t)) => text.push_str(t),
                    (Some("text"), None) => return Err(bad(format!("content[{j}] needs a string text"))),
                    (Some("image_url"), _) => {
                        // `{"url": ...}` (OpenAI's shape), or the URL alone (some clients').
                        let url = part.get("image_url").and_then(|u| u.get("url").unwrap_or(u).as_str());
                        let url = url.ok_or_else(|| bad(format!("content[{j}].image_url needs a url")))?;
                        push_image(images, &image_of_url(url).map_err(|e| bad(format!("content[{j}]: {e}")))?)
                            .map_err(|e| bad(format!("content[{j}]: {e}")))?;
                        text.push_str(media_marker());
                    }
                    (Some(other), _) => {
                        return Err(bad(format!("content part type {other:?} is not supported by inferd (text only)")))
                    }
                    (None, _) => return Err(bad(format!("content[{j}] needs a type"))),
                }
            }
            Ok(text)
        }
        Some(_) => Err(bad("content must be a string or an array of content parts".into())),
    }
}

/// The `messages` of a chat body: roles and contents, an assistant's `tool_calls` (OpenAI's
/// arguments are JSON text, Ollama's an object), a tool message's `tool_call_id` and `name`
/// (Ollama's `tool_name`).
pub fn messages(m: &Map<String, Value>) -> Result<Vec<ChatMessage>, ApiError> {
    let list = m
        .get("messages")
        .and_then(Value::as_array)
        .ok_or_else(|| ApiError::bad("messages must be an array", "messages"))?;
    let bad = |i: usize, what: String| ApiError::bad(format!("messages[{i}]: {what}"), "messages");
    let mut out = Vec::with_capacity(list.len());
    for (i, msg) in list.iter().enumerate() {
        let role = msg.get("role").and_then(Value::as_str).ok_or_else(|| bad(i, "needs a string role".into()))?;
        // Only an assistant's message may go without content (it may hold calls instead).
        if role != "assistant" && msg.get("content").is_none_or(Value::is_null) {
            return Err(bad(i, "needs a content: a string or an array of content parts".into()));
        }
        let mut images = Vec::new();
        let mut cm = ChatMessage::new(role, &content(i, msg.get("content"), &mut images)?);
        if let Some(calls) = msg.get("tool_calls").filter(|v| !v.is_null()) {
            let calls = calls.as_array().ok_or_else(|| bad(i, "tool_calls must be an array".into()))?;
            for (j, c) in calls.iter().enumerate() {
                let name = c.pointer("/function/name").and_then(Value::as_str);
                let arguments = match c.pointer("/function/arguments") {
                    Some(Value::String(s)) => Some(s.clone()),
                    Some(o @ Value::Object(_)) => Some(o.to_string()),
                    _ => None,
                };
                let (Some(name), Some(arguments)) = (name, arguments) else {
                    return Err(bad(i, format!("tool_calls[{j}] needs function.name and function.arguments")));
                };
                let id = c.get("id").and_then(Value::as_str).map_or_else(|| format!("call_{i}_{j}"), str::to_owned);
                cm.tool_calls.push(ToolCall { id, name: name.to_owned(), arguments });
            }
        }
        cm.tool_call_id = msg.get("tool_call_id").and_then(Value::as_str).map(str::to_owned);
        cm.name = msg.get("name").or_else(|| msg.get("tool_name")).and_then(Value::as_str).map(str::to_owned);
        // An assistant's reasoning: `reasoning_content` (llama-server, vLLM, DeepSeek),
        // `reasoning` (OpenRouter, vLLM's newer name), Ollama's `thinking`.
        cm.reasoning = ["reasoning_content", "reasoning", "thinking"]
            .iter()
            .find_map(|k| msg.get(*k).and_then(Value::as_str))
            .filter(|r| role == "assistant" && !r.is_empty())
            .map(str::to_owned);
        // Ollama's `images` (base64), before the message's text, as llama.cpp places images
        // that the text does not mark.
        if let Some(list) = msg.get("images").filter(|v| !v.is_null()) {
            let list = list.as_array().ok_or_else(|| bad(i, "images must be an array of base64 strings".into()))?;
            let mut markers = String::new();
            for (j, b64) in list.iter().enumerate() {
                let b64 = b64.as_str().ok_or_else(|| bad(i, format!("images[{j}] must be a base64 string")))?;
                let bytes = base64_bytes(b64).map_err(|e| bad(i, format!("images[{j}]: {e}")))?;
                push_image(&mut images, &bytes).map_err(|e| bad(i, format!("images[{j}]: {e}")))?;
                markers.push_str(media_marker());
            }
            cm.content.insert_str(0, &markers);
        }
        cm.images = images;
        out.push(cm);
    }
    Ok(out)
}

/// The text that stands for an image in a message's content until the prompt is tokenized:
/// random for each daemon process and never shown, so no client can write one.
pub fn media_marker() -> &'static str {
    static MARKER: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    MARKER.get_or_init(|| {
        use std::hash::{BuildHasher, Hasher};
        let word = |salt: u64| {
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u64(salt);
            h.finish()
        };
        format!("<__inferd_image_{:016x}{:016x}__>", word(1), word(2))
    })
}

/// Images one request may hold.
const MAX_IMAGES: usize = 16;

/// Decodes an image file and adds it to a request's images.
fn push_image(images: &mut Vec<Arc<RgbImage>>, bytes: &[u8]) -> Result<(), String> {
    if images.len() >= MAX_IMAGES {
        return Err(format!("a request takes at most {MAX_IMAGES} images"));
    }
    let img = inferd_engine::vision::decode(bytes, inferd_engine::vision::ImageLimits::default())
        .map_err(|e| e.to_string())?;
    images.push(Arc::new(img));
    Ok(())
}

/// The bytes of an image URL: a `data:` URL's (base64); an `http(s)` URL reaches here only
/// where `[server] fetch_images` is off ([`super::image_fetch`] inlines it otherwise).
fn image_of_url(url: &str) -> Result<Vec<u8>, String> {
    if let Some(rest) = url.strip_prefix("data:") {
        let (kind, data) = rest.split_once(',').ok_or("a data: URL needs a comma before its data")?;
        if !kind.ends_with(";base64") {
            return Err("an image data: URL must be base64 (data:image/png;base64,...)".into());
        }
        return base64_bytes(data);
    }
    if url.starts_with("http://") || url.starts_with("https://") {
        return Err("image URLs are not fetched by this daemon ([server] fetch_images is off): send the image as \
             a data: URL"
            .into());
    }
    Err("an image URL must be a data: URL (data:image/png;base64,...)".into())
}

/// Standard base64 (padding optional, whitespace ignored).
fn base64_bytes(s: &str) -> Result<Vec<u8>, String> {
    use base64::Engine as _;
    let clean: String = s.chars().filter(|c| !c.is_ascii_whitespace()).collect();
    base64::engine::general_purpose::STANDARD_NO_PAD
        .decode(clean.trim_end_matches('='))
        .map_err(|e| format!("not base64: {e}"))
}

/// [`encode`], and the images of the messages as they stand in the prompt: each image's
/// markers (the projector's, such as `<start_of_image>` and `<end_of_image>`) around as many
/// positions as the encoder makes tokens, whose ids the engine fills. A model without a
/// projector refuses images.
pub fn encode_with_images(
    sh: &Shared,
    model: &Model,
    messages: &[ChatMessage],
    tools: Option<&Tools>,
    extra: &inferd_engine::chat::Extra,
) -> Result<(Vec<u32>, Vec<PromptImage>), ApiError> {
    let images: Vec<&Arc<RgbImage>> = messages.iter().flat_map(|m| &m.images).collect();
    if images.is_empty() {
        return Ok((encode(sh, model, messages, tools, extra)?, Vec::new()));
    }
    let Some(vision) = &model.vision else {
        return Err(ApiError::bad(
            format!("{} takes no images (no projector is paired with it: [[model]] mmproj)", model.name),
            "messages",
        ));
    };
    let (text, lit) = render(sh, model, messages, tools, extra)?;
    let segments: Vec<&str> = text.split(media_marker()).collect();
    if segments.len() != images.len() + 1 {
        return Err(ApiError::bad(
            format!("the chat template placed {} of the {} images", segments.len() - 1, images.len()),
            "messages",
        ));
    }
    let tok = &model.tokenizer;
    let fail = |e: inferd_engine::tokenizer::TokenizerError| ApiError::bad(e.to_string(), "messages");
    let (begin, end) = vision.markers();
    let mut ids: Vec<u32> = if tok.adds_bos() { tok.bos().into_iter().collect() } else { Vec::new() };
    let mut out = Vec::with_capacity(images.len());
    for (k, seg) in segments.iter().enumerate() {
        ids.extend(lit.encode_bare(tok, seg).map_err(fail)?);
        if let Some(img) = images.get(k) {
            ids.extend(tok.encode_bare(begin, true).map_err(fail)?);
            out.push(PromptImage { at: ids.len(), image: Arc::clone(img), media: None });
            ids.extend(std::iter::repeat_n(0, vision.image_tokens(img)));
            ids.extend(tok.encode_bare(end, true).map_err(fail)?);
        }
    }
    if tok.adds_eos() {
        ids.extend(tok.eos().first());
    }
    Ok((ids, out))
}

/// Chat messages rendered with the model's own template (and the request's tools), as token
/// ids. A template that does not render tools gets them described in a system message, and
/// earlier calls and tool results written as text in the same syntax. What the client wrote
/// (roles, contents, names, calls, tool definitions) is text even where it spells a special
/// token: only the template's own markup is special ([`Literals`]).
/// `extra` variables join the template's context (a thinking switch: [`super::reasoning`]).
/// The template runs in a helper process bounded in memory and time ([`Shared::templates`]).
pub fn encode(
    sh: &Shared,
    model: &Model,
    messages: &[ChatMessage],
    tools: Option<&Tools>,
    extra: &inferd_engine::chat::Extra,
) -> Result<Vec<u32>, ApiError> {
    if messages.iter().any(|m| !m.images.is_empty()) {
        return Err(ApiError::bad(
            "this route takes no images yet (the chat routes of OpenAI, Anthropic and Ollama do)",
            "messages",
        ));
    }
    let (text, lit) = render(sh, model, messages, tools, extra)?;
    lit.encode(&model.tokenizer, &text).map_err(|e| ApiError::bad(e.to_string(), "messages"))
}

/// The prompt [`encode`] would tokenize, as text (llama-server's `/apply-template`).
pub fn prompt_text(
    sh: &Shared,
    model: &Model,
    messages: &[ChatMessage],
    tools: Option<&Tools>,
    extra: &inferd_engine::chat::Extra,
) -> Result<String, ApiError> {
    let (text, lit) = render(sh, model, messages, tools, extra)?;
    // Images as llama.cpp's marker: the daemon's own stays private.
    Ok(lit.reveal(&text).replace(media_marker(), "<__media__>"))
}

/// The chat template's text for the messages, the clients' text in it hidden behind
/// placeholders (so it is never read as special tokens), and what they hide.
fn render(
    sh: &Shared,
    model: &Model,
    messages: &[ChatMessage],
    tools: Option<&Tools>,
    extra: &inferd_engine::chat::Extra,
) -> Result<(String, Literals), ApiError> {
    if messages.is_empty() {
        return Err(ApiError::bad("messages is empty", "messages"));
    }
    let tok = &model.tokenizer;
    let bos = tok.bos().map(|b| tok.token_text(b)).unwrap_or_default();
    let eos = tok.eos().first().map(|&e| tok.token_text(e)).unwrap_or_default();
    let shown: &[Tool] = match tools {
        Some(t) if t.choice != ToolChoice::None => &t.tools,
        _ => &[],
    };
    let mut lit = Literals::default();
    let shown: Vec<Tool> = shown
        .iter()
        .map(|t| Tool {
            name: lit.hide(tok, &t.name),
            description: t.description.as_deref().map(|d| lit.hide(tok, d)),
            parameters: lit.hide_json(tok, &t.parameters),
        })
        .collect();
    let shown = shown.as_slice();
    let format = tools.map_or_else(|| ToolFormat::detect(model.chat_template.as_deref()), |t| t.format);
    let mut msgs: Vec<ChatMessage> = messages
        .iter()
        .map(|m| ChatMessage {
            role: lit.hide(tok, &m.role),
            content: lit.hide(tok, &m.content),
            tool_calls: m
                .tool_calls
                .iter()
                .map(|c| ToolCall {
                    id: lit.hide(tok, &c.id),
                    name: lit.hide(tok, &c.name),
                    arguments: lit.hide(tok, &c.arguments),
                })
                .collect(),
            tool_call_id: m.tool_call_id.as_deref().map(|x| lit.hide(tok, x)),
            name: m.name.as_deref().map(|x| lit.hide(tok, x)),
            reasoning: m.reasoning.as_deref().map(|x| lit.hide(tok, x)),
            images: Vec::new(),
        })
        .collect();
    if !format.native {
        for m in &mut msgs {
            if !m.tool_calls.is_empty() {
                let calls = format.written(&std::mem::take(&mut m.tool_calls));
                m.content = if m.content.is_empty() { calls } else { format!("{}\n{calls}", m.content) };
            }
            if m.role == "tool" {
                m.role = "user".into();
                m.content = format!("<tool_response>\n{}\n</tool_response>", m.content);
            }
        }
        if let Some(prompt) = format.system_prompt(shown).filter(|_| !shown.is_empty()) {
            match msgs.first_mut() {
                Some(first) if first.role == "system" => first.content = format!("{}\n\n{prompt}", first.content),
                _ => msgs.insert(0, ChatMessage::new("system", &prompt)),
            }
        }
    }
    let shown = if format.native { shown } else { &[] };
    let text = sh
        .templates
        .render(Template { source: model.chat_template.as_deref(), bos: &bos, eos: &eos }, &msgs, shown, extra, true)
        .map_err(|e| ApiError::bad(format!("the chat template failed: {e}"), "messages"))?;
    // A template that writes `bos_token` itself, for a vocabulary that adds BOS when it
    // tokenizes (Gemma's): one BOS, not two, as llama.cpp and transformers give (and the same
    // for a closing EOS).
    let text = match text.strip_prefix(bos.as_str()) {
        Some(rest) if tok.adds_bos() && !bos.is_empty() => rest.to_owned(),
        _ => text,
    };
    let text = match text.strip_suffix(eos.as_str()) {
        Some(rest) if tok.adds_eos() && !eos.is_empty() => rest.to_owned(),
        _ => text,
    };
    Ok((text, lit))
}

/// A call as OpenAI writes it in a message (`index` for stream deltas).
pub fn openai_call(c: &ToolCall, index: Option<usize>) -> Value {
    let mut v = json!({ "id": c.id, "type": "function", "function": { "name": c.name, "arguments": c.arguments } });
    if let Some(i) = index {
        v["index"] = json!(i);
    }
    v
}

/// A call as Ollama writes it: the arguments as an object.
pub fn ollama_call(c: &ToolCall) -> Value {
    let args: Value = serde_json::from_str(&c.arguments).unwrap_or_else(|_| json!({}));
    json!({ "function": { "name": c.name, "arguments": args } })
}
