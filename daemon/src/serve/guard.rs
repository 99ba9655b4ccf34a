//! What the loopback TCP listener lets through. Unlike the Unix socket, any web page the
//! user's browser shows can reach it: by DNS rebinding (a page's own name resolved to
//! 127.0.0.1) or by a cross-site "simple request" (a form post with `text/plain`). So a request
//! must name a loopback host (or a configured one, `server.tcp_hosts`) in `Host`; one with an
//! `Origin` must come from a configured origin (`server.cors_origins`, which CORS then answers
//! for, preflights included); a request with a body must say `application/json` (which a
//! browser cannot send cross-site without a preflight); and with `server.tcp_key_file`, it
//! must carry `Authorization: Bearer KEY`.

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;
use std::path::Path;
use std::sync::Arc;

/// The TCP listener's rules.
#[derive(Debug)]
pub struct Guard {
    hosts: Vec<String>,
    origins: Vec<String>,
    key: Option<String>,
}

impl Guard {
    /// The rules from the config; the key file must be readable and hold a key.
    pub fn new(hosts: &[String], origins: &[String], key_file: Option<&Path>) -> anyhow::Result<Guard> {
        let key = match key_file {
            None => None,
            Some(p) => {
                let text = std::fs::read_to_string(p)
                    .map_err(|e| anyhow::anyhow!("server.tcp_key_file {}: {e}", p.display()))?;
                let key = text.trim().to_owned();
                if key.is_empty() {
                    anyhow::bail!("server.tcp_key_file {} holds no key", p.display());
                }
                Some(key)
            }
        };
        let origins = origins.iter().map(|o| o.trim_end_matches('/').to_ascii_lowercase()).collect();
        Ok(Guard { hosts: hosts.iter().map(|h| h.to_ascii_lowercase()).collect(), origins, key })
    }

    /// CORS for the configured origins (none: no cross-origin reads at all).
    pub fn cors(&self) -> tower_http::cors::CorsLayer {
        let origins: Vec<HeaderValue> = self.origins.iter().filter_map(|o| HeaderValue::from_str(o).ok()).collect();
        tower_http::cors::CorsLayer::new()
            .allow_origin(origins)
            .allow_methods([Method::GET, Method::POST, Method::DELETE])
            .allow_headers([header::CONTENT_TYPE, header::AUTHORIZATION])
    }

    /// Why a request may not pass, if it may not.
    fn refuse(&self, method: &Method, headers: &HeaderMap, has_body: bool) -> Option<(StatusCode, String)> {
        let text = |h: header::HeaderName| headers.get(h).map(|v| v.to_str().unwrap_or("\u{fffd}").to_owned());
        let Some(host) = text(header::HOST) else {
            return Some((StatusCode::BAD_REQUEST, "the request names no Host".into()));
        };
        if !self.host_allowed(&host) {
            return Some((
                StatusCode::FORBIDDEN,
                format!("Host {host:?} is not a loopback name (add it to server.tcp_hosts to allow it)"),
            ));
        }
        if let Some(origin) = text(header::ORIGIN) {
            if !self.origins.contains(&origin.trim_end_matches('/').to_ascii_lowercase()) {
                return Some((
                    StatusCode::FORBIDDEN,
                    format!("requests from the web origin {origin:?} are not allowed (server.cors_origins)"),
                ));
            }
        }
        if method == Method::OPTIONS {
            return None; // a preflight from an allowed origin: CORS answers it
        }
        if let Some(key) = &self.key {
            let given = text(header::AUTHORIZATION).unwrap_or_default();
            let given = given.strip_prefix("Bearer ").unwrap_or("").trim();
            if !same(given.as_bytes(), key.as_bytes()) {
                return Some((
                    StatusCode::UNAUTHORIZED,
                    "a valid API key is required: Authorization: Bearer KEY".into(),
                ));
            }
        }
        if has_body {
            let ctype = text(header::CONTENT_TYPE).unwrap_or_default();
            let mime = ctype.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
            if mime != "application/json" {
                return Some((
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    format!("the body must be sent as Content-Type: application/json, not {ctype:?}"),
                ));
            }
        }
        None
    }

    /// Whether `host` (a `Host` header: a name, an IPv4 address or a bracketed IPv6 one,
    /// with an optional port) is loopback or configured.
    fn host_allowed(&self, host: &str) -> bool {
        let host = host.trim().to_ascii_lowercase();
        if let Ok(ip) = host.parse::<std::net::IpAddr>() {
            return ip.is_loopback(); // a bare address (an IPv6 one unbracketed)
        }
        let name = if let Some(rest) = host.strip_prefix('[') {
            rest.split(']').next().unwrap_or("")
        } else {
            host.rsplit_once(':').map_or(host.as_str(), |(n, port)| {
                if port.chars().all(|c| c.is_ascii_digit()) {
                    n
                } else {
                    host.as_str()
                }
            })
        };
        let name = name.trim_end_matches('.');
        if name == "localhost" || name.ends_with(".localhost") {
            return true;
        }
        if name.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback()) {
            return true;
        }
        self.hosts.iter().any(|h| h == name)
    }
}

/// Compares without stopping at the first difference (no timing tells how much of a key is
/// right).
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Middleware on the TCP listener's routes: the request passes the [`Guard`] or gets its
/// refusal as an error object.
pub async fn check(State(g): State<Arc<Guard>>, req: Request, next: Next) -> Response {
    let has_body = req.headers().get(header::CONTENT_LENGTH).is_some_and(|l| l.as_bytes() != b"0")
        || req.headers().contains_key(header::TRANSFER_ENCODING);
    match g.refuse(req.method(), req.headers(), has_body) {
        None => next.run(req).await,
        Some((status, msg)) => {
            let body =
                json!({ "error": { "message": msg, "type": "invalid_request_error", "param": null, "code": null } });
            (status, Json(body)).into_response()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, HeaderValue::from_str(v).unwrap_or(HeaderValue::from_static("?")));
        }
        h
    }

    #[test]
    fn loopback_hosts_pass_and_others_do_not() {
        let g = Guard::new(&["inferd.lan".into()], &[], None).map_err(|e| e.to_string());
        let Ok(g) = g else { panic!("{g:?}") };
        for ok in [
            "localhost",
            "localhost:8080",
            "127.0.0.1:1",
            "127.8.9.1",
            "[::1]:80",
            "::1",
            "a.localhost",
            "INFERD.lan:9",
        ] {
            assert!(g.host_allowed(ok), "{ok}");
        }
        for bad in
            ["evil.example", "evil.example:80", "127.0.0.1.evil.example", "[::2]:80", "localhost.evil", "0.0.0.0"]
        {
            assert!(!g.host_allowed(bad), "{bad}");
        }
    }

    #[test]
    fn a_browser_simple_request_from_another_site_is_refused() {
        let Ok(g) = Guard::new(&[], &["http://localhost:3000".into()], None) else { panic!() };
        let post = Method::POST;
        let form = headers(&[("host", "127.0.0.1:8080"), ("content-type", "text/plain")]);
        assert_eq!(g.refuse(&post, &form, true).map(|r| r.0), Some(StatusCode::UNSUPPORTED_MEDIA_TYPE));
        let evil = headers(&[
            ("host", "127.0.0.1:8080"),
            ("origin", "http://evil.example"),
            ("content-type", "application/json"),
        ]);
        assert_eq!(g.refuse(&post, &evil, true).map(|r| r.0), Some(StatusCode::FORBIDDEN));
        let ok = headers(&[
            ("host", "127.0.0.1:8080"),
            ("origin", "http://localhost:3000/"),
            ("content-type", "application/json; charset=utf-8"),
        ]);
        assert_eq!(g.refuse(&post, &ok, true), None);
        assert_eq!(g.refuse(&Method::GET, &headers(&[("host", "localhost")]), false), None);
        assert_eq!(g.refuse(&Method::GET, &HeaderMap::new(), false).map(|r| r.0), Some(StatusCode::BAD_REQUEST));
    }

    #[test]
    fn keys_compare_whole() {
        assert!(same(b"abc", b"abc"));
        assert!(!same(b"abc", b"abd") && !same(b"abc", b"ab") && !same(b"", b"a"));
    }
}
