//! `[server] fetch_images`: image URLs (`http://`, `https://`) in a request's content fetched
//! by the daemon before the request is read, each replaced by what arrived (a `data:` URL, or
//! an Anthropic base64 source). Off by default, since the daemon would then fetch, from the
//! machine's place on the network, for whoever can reach its socket; a URL then gets a 400
//! that names the setting.
//!
//! Where: OpenAI chat `image_url` parts (`{"url": ...}` or the URL itself), the Responses
//! API's `input_image` (`image_url`) and Anthropic `image` blocks with a `url` source, under
//! `messages` and `input`. Each fetch is bounded: the decoder's byte limit (checked against
//! `Content-Length` and again as the body arrives), 30 seconds, 5 redirects, at most
//! [`MAX_URLS`] per request; an answer other than 200 is a 400 naming the URL.

use super::api::ApiError;
use super::Shared;
use base64::Engine as _;
use serde_json::{json, Value};
use std::time::Duration;

/// The most image URLs one request may have fetched (the chat edge takes 16 images).
const MAX_URLS: usize = 16;

/// `body` with its image URLs fetched and inlined where `server.fetch_images` allows it;
/// unchanged otherwise (the chat edge refuses the URLs by name).
pub async fn inline(sh: &Shared, body: axum::body::Bytes) -> Result<axum::body::Bytes, ApiError> {
    let has_url = |b: &[u8]| b.windows(7).any(|w| w == b"http://" || w == b"https:/");
    if !sh.fetch_images() || !has_url(&body) {
        return Ok(body);
    }
    let Ok(mut v) = serde_json::from_slice::<Value>(&body) else { return Ok(body) };
    let mut urls = Vec::new();
    for key in ["messages", "input"] {
        if let Some(x) = v.get(key) {
            collect(x, &mut urls);
        }
    }
    if urls.is_empty() {
        return Ok(body);
    }
    if urls.len() > MAX_URLS {
        return Err(ApiError::bad(format!("a request has at most {MAX_URLS} image URLs fetched"), "messages"));
    }
    let client = client()?;
    let max = inferd_engine::vision::ImageLimits::default().max_bytes;
    let mut fetched = Vec::with_capacity(urls.len());
    for u in &urls {
        fetched.push(fetch(&client, u, max).await?);
    }
    let mut it = fetched.into_iter();
    for key in ["messages", "input"] {
        if let Some(x) = v.get_mut(key) {
            replace(x, &mut it);
        }
    }
    Ok(serde_json::to_vec(&v).map_err(|e| ApiError::new(500, e.to_string(), None))?.into())
}

/// Whether `s` is a URL to fetch.
fn remote(s: &str) -> bool {
    s.starts_with("http://") || s.starts_with("https://")
}

/// The place of an image URL in a content part, if `o` is one: the field holding it.
enum Slot {
    /// `image_url: "URL"` (Responses' `input_image`).
    Plain,
    /// `image_url: {"url": "URL"}` (OpenAI chat).
    Nested,
    /// `{"type": "url", "url": "URL"}` (an Anthropic image source).
    Source,
}

fn slot(o: &serde_json::Map<String, Value>) -> Option<(Slot, &str)> {
    match o.get("image_url") {
        Some(Value::String(u)) if remote(u) => return Some((Slot::Plain, u)),
        Some(Value::Object(n)) => match n.get("url") {
            Some(Value::String(u)) if remote(u) => return Some((Slot::Nested, u)),
            _ => {}
        },
        _ => {}
    }
    match (o.get("type"), o.get("url")) {
        (Some(Value::String(t)), Some(Value::String(u))) if t == "url" && remote(u) => Some((Slot::Source, u)),
        _ => None,
    }
}

/// Every image URL under `v`, in document order.
fn collect(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::Object(o) => match slot(o) {
            Some((_, u)) => out.push(u.to_string()),
            None => o.values().for_each(|x| collect(x, out)),
        },
        Value::Array(a) => a.iter().for_each(|x| collect(x, out)),
        _ => {}
    }
}

/// Each image URL under `v` replaced by the next fetched image (`(media type, bytes)`), in the
/// order [`collect`] found them.
fn replace(v: &mut Value, images: &mut impl Iterator<Item = (String, Vec<u8>)>) {
    match v {
        Value::Object(o) => {
            let Some((kind, _)) = slot(o) else {
                return o.values_mut().for_each(|x| replace(x, images));
            };
            let Some((media, bytes)) = images.next() else { return };
            let data = base64::engine::general_purpose::STANDARD.encode(bytes);
            let url = format!("data:{media};base64,{data}");
            match kind {
                Slot::Plain => {
                    o.insert("image_url".into(), json!(url));
                }
                Slot::Nested => {
                    if let Some(Value::Object(n)) = o.get_mut("image_url") {
                        n.insert("url".into(), json!(url));
                    }
                }
                Slot::Source => {
                    o.clear();
                    o.extend([
                        ("type".into(), json!("base64")),
                        ("media_type".into(), json!(media)),
                        ("data".into(), json!(data)),
                    ]);
                }
            }
        }
        Value::Array(a) => a.iter_mut().for_each(|x| replace(x, images)),
        _ => {}
    }
}

fn client() -> Result<reqwest::Client, ApiError> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::builder()
        .user_agent(concat!("inferd/", env!("CARGO_PKG_VERSION")))
        .connect_timeout(Duration::from_secs(10))
        .timeout(Duration::from_secs(30))
        .redirect(reqwest::redirect::Policy::limited(5))
        .build()
        .map_err(|e| ApiError::new(500, format!("an HTTP client for images: {e}"), None))
}

/// One image: its media type (the answer's, else `image/png`; the decoder reads the bytes for
/// the format) and its bytes, at most `max` of them.
async fn fetch(client: &reqwest::Client, url: &str, max: usize) -> Result<(String, Vec<u8>), ApiError> {
    let bad = |what: String| ApiError::bad(format!("fetching the image {url}: {what}"), "messages");
    let mut resp = client.get(url).send().await.map_err(|e| bad(e.to_string()))?;
    if resp.status() != reqwest::StatusCode::OK {
        return Err(bad(format!("the server answered {}", resp.status())));
    }
    let over = |n: u64| bad(format!("the image is {n} bytes or more, over the limit of {max}"));
    if let Some(n) = resp.content_length().filter(|&n| n > max as u64) {
        return Err(over(n));
    }
    let media = resp
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|t| t.split(';').next().unwrap_or(t).trim().to_string())
        .filter(|t| t.starts_with("image/"))
        .unwrap_or_else(|| "image/png".into());
    let mut bytes = Vec::new();
    while let Some(chunk) = resp.chunk().await.map_err(|e| bad(e.to_string()))? {
        bytes.extend_from_slice(&chunk);
        if bytes.len() > max {
            return Err(over(bytes.len() as u64));
        }
    }
    Ok((media, bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_form_of_image_url_is_found_and_replaced_in_order() {
        let mut v = json!({ "messages": [
            { "role": "user", "content": [
                { "type": "image_url", "image_url": { "url": "http://a/1.png" } },
                { "type": "input_image", "image_url": "https://a/2.png" },
                { "type": "image", "source": { "type": "url", "url": "http://a/3.png" } },
                { "type": "image_url", "image_url": { "url": "data:image/png;base64,AA==" } },
                { "type": "text", "text": "see http://a/4.png" },
            ] },
        ] });
        let mut urls = Vec::new();
        collect(&v, &mut urls);
        assert_eq!(urls, ["http://a/1.png", "https://a/2.png", "http://a/3.png"]);
        let mut images = (1..=3).map(|i| ("image/png".to_string(), vec![i as u8]));
        replace(&mut v, &mut images);
        let c = &v["messages"][0]["content"];
        assert_eq!(c[0]["image_url"]["url"], "data:image/png;base64,AQ==");
        assert_eq!(c[1]["image_url"], "data:image/png;base64,Ag==");
        assert_eq!(c[2]["source"], json!({ "type": "base64", "media_type": "image/png", "data": "Aw==" }));
        assert_eq!(c[3]["image_url"]["url"], "data:image/png;base64,AA==", "a data: URL stays");
        assert_eq!(c[4]["text"], "see http://a/4.png", "text is text");
    }
}
