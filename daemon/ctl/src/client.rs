//! A small blocking HTTP/1.1 client for the daemon's Unix socket, for `inferctl`: one request
//! per connection, bodies by Content-Length or chunked transfer coding, Server-Sent Events
//! delivered one `data:` payload at a time as they arrive. Connection failures become messages
//! that say what to do.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("inferd is not running: there is no socket at {0} (start it with `inferd serve`, or `systemctl start inferd.socket`)")]
    NotRunning(PathBuf),
    #[error("cannot use {0}: permission denied (the daemon's socket is open to its group: see `ls -l {0}`)")]
    Denied(PathBuf),
    #[error("nothing is listening on {0} (a socket left by a daemon that is gone?)")]
    Refused(PathBuf),
    #[error("talking to inferd at {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("inferd answered {status}: {message}")]
    Api { status: u16, message: String },
    #[error("inferd sent a response this client does not understand: {0}")]
    Protocol(String),
}

/// The socket `inferctl` talks to: `$INFERD_SOCKET`, else the user's daemon's socket when it
/// exists, else the system daemon's.
pub fn default_socket() -> PathBuf {
    if let Some(s) = std::env::var_os("INFERD_SOCKET") {
        return PathBuf::from(s);
    }
    let user = user_socket();
    if user.exists() {
        return user;
    }
    PathBuf::from("/run/inferd/inferd.sock")
}

/// The socket of a user's daemon: `$XDG_RUNTIME_DIR/inferd/inferd.sock` for a user, `/run/inferd/inferd.sock`
/// without a runtime directory (the system daemon).
pub fn user_socket() -> PathBuf {
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(d) => PathBuf::from(d).join("inferd/inferd.sock"),
        None => PathBuf::from("/run/inferd/inferd.sock"),
    }
}

pub struct Client {
    socket: PathBuf,
}

/// A response whose body has not been read yet.
struct Response {
    status: u16,
    chunked: bool,
    length: Option<usize>,
    body: BufReader<UnixStream>,
}

impl Client {
    pub fn new(socket: &Path) -> Client {
        Client { socket: socket.to_owned() }
    }

    fn io(&self, source: std::io::Error) -> ClientError {
        ClientError::Io { path: self.socket.clone(), source }
    }

    fn connect(&self) -> Result<UnixStream, ClientError> {
        UnixStream::connect(&self.socket).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => ClientError::NotRunning(self.socket.clone()),
            std::io::ErrorKind::PermissionDenied => ClientError::Denied(self.socket.clone()),
            std::io::ErrorKind::ConnectionRefused => ClientError::Refused(self.socket.clone()),
            _ => self.io(e),
        })
    }

    fn send(&self, method: &str, path: &str, body: Option<&serde_json::Value>) -> Result<Response, ClientError> {
        let mut s = self.connect()?;
        let body = body.map(|b| b.to_string()).unwrap_or_default();
        write!(s, "{method} {path} HTTP/1.1\r\nHost: inferd\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len()).map_err(|e| self.io(e))?;
        self.response(s)
    }

    /// Sends `len` bytes from `body` as a `PUT` to `path` with `headers`, calling `sent(n)` as
    /// they go, and reads the JSON answer. The daemon may answer before the body is all sent
    /// (a refusal): the answer is what counts. A failure to read `body` ends the request
    /// unfinished (the daemon keeps what it received) and is returned as is.
    pub fn upload(
        &self,
        path: &str,
        headers: &[(&str, String)],
        len: u64,
        body: &mut dyn Read,
        sent: &mut dyn FnMut(u64),
    ) -> Result<Result<serde_json::Value, std::io::Error>, ClientError> {
        let mut s = self.connect()?;
        let mut head = format!(
            "PUT {path} HTTP/1.1\r\nHost: inferd\r\nContent-Type: application/octet-stream\r\nContent-Length: {len}\r\nConnection: close\r\n"
        );
        for (k, v) in headers {
            head += &format!("{k}: {v}\r\n");
        }
        head += "\r\n";
        s.write_all(head.as_bytes()).map_err(|e| self.io(e))?;
        let mut buf = vec![0u8; 1 << 20];
        let mut done = 0u64;
        while done < len {
            let want = usize::try_from(len - done).unwrap_or(usize::MAX).min(buf.len());
            let failed = match body.read(&mut buf[..want]) {
                Ok(0) => Some(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "the source ended early")),
                Ok(n) => {
                    if s.write_all(&buf[..n]).is_err() {
                        break; // the daemon answered early: read why
                    }
                    done += n as u64;
                    sent(n as u64);
                    None
                }
                Err(e) => Some(e),
            };
            if let Some(e) = failed {
                // The body ends unfinished: the daemon keeps what it received, and its answer
                // says it has written it.
                let _ = s.shutdown(std::net::Shutdown::Write);
                let _ = self.response(s).and_then(|r| self.read_all(r));
                return Ok(Err(e));
            }
        }
        let (status, bytes) = self.read_all(self.response(s)?)?;
        let v: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| ClientError::Protocol(e.to_string()))?;
        if status >= 400 {
            return Err(api_error(status, &v));
        }
        Ok(Ok(v))
    }

    fn response(&self, s: UnixStream) -> Result<Response, ClientError> {
        let mut r = BufReader::new(s);
        let mut line = String::new();
        r.read_line(&mut line).map_err(|e| self.io(e))?;
        let status = line
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .ok_or_else(|| ClientError::Protocol(format!("status line {line:?}")))?;
        let (mut chunked, mut length) = (false, None);
        loop {
            line.clear();
            r.read_line(&mut line).map_err(|e| self.io(e))?;
            let h = line.trim_end();
            if h.is_empty() {
                break;
            }
            if let Some((k, v)) = h.split_once(':') {
                match k.trim().to_ascii_lowercase().as_str() {
                    "transfer-encoding" => chunked = v.trim().eq_ignore_ascii_case("chunked"),
                    "content-length" => length = v.trim().parse().ok(),
                    _ => {}
                }
            }
        }
        Ok(Response { status, chunked, length, body: r })
    }

    /// The next piece of a chunked body (empty at the end).
    fn chunk(&self, r: &mut Response) -> Result<Vec<u8>, ClientError> {
        let mut line = String::new();
        r.body.read_line(&mut line).map_err(|e| self.io(e))?;
        let size = usize::from_str_radix(line.trim().split(';').next().unwrap_or(""), 16)
            .map_err(|_| ClientError::Protocol(format!("chunk size {line:?}")))?;
        let mut buf = vec![0u8; size + 2];
        r.body.read_exact(&mut buf).map_err(|e| self.io(e))?;
        buf.truncate(size);
        Ok(buf)
    }

    fn read_all(&self, mut r: Response) -> Result<(u16, Vec<u8>), ClientError> {
        let mut out = Vec::new();
        if r.chunked {
            loop {
                let c = self.chunk(&mut r)?;
                if c.is_empty() {
                    break;
                }
                out.extend(c);
            }
        } else if let Some(n) = r.length {
            out.resize(n, 0);
            r.body.read_exact(&mut out).map_err(|e| self.io(e))?;
        } else {
            r.body.read_to_end(&mut out).map_err(|e| self.io(e))?;
        }
        Ok((r.status, out))
    }

    /// A JSON request and its JSON answer; an error status becomes [`ClientError::Api`].
    pub fn json(
        &self,
        method: &str,
        path: &str,
        body: Option<&serde_json::Value>,
    ) -> Result<serde_json::Value, ClientError> {
        let (status, bytes) = self.read_all(self.send(method, path, body)?)?;
        let v: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| ClientError::Protocol(e.to_string()))?;
        if status >= 400 {
            return Err(api_error(status, &v));
        }
        Ok(v)
    }

    /// A request answered by a stream of JSON lines (NDJSON): `on_line` gets each as it
    /// arrives.
    pub fn lines(
        &self,
        method: &str,
        path: &str,
        body: &serde_json::Value,
        on_line: &mut dyn FnMut(serde_json::Value),
    ) -> Result<(), ClientError> {
        let r = self.send(method, path, Some(body))?;
        if r.status >= 400 || !r.chunked {
            let status = r.status;
            let (_, bytes) = self.read_all(r)?;
            let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_default();
            if status >= 400 {
                return Err(api_error(status, &v));
            }
            on_line(v);
            return Ok(());
        }
        self.split(r, b"\n", &mut |line| {
            if line.iter().all(u8::is_ascii_whitespace) {
                return Ok(true);
            }
            let v = serde_json::from_slice(&line)
                .map_err(|e| ClientError::Protocol(format!("line {:?}: {e}", String::from_utf8_lossy(&line))))?;
            on_line(v);
            Ok(true)
        })
    }

    /// Reads a chunked body and hands `on_item` each piece ending with `end` (with it) as it
    /// arrives, until the body ends or `on_item` answers false.
    fn split(
        &self,
        mut r: Response,
        end: &[u8],
        on_item: &mut dyn FnMut(Vec<u8>) -> Result<bool, ClientError>,
    ) -> Result<(), ClientError> {
        let mut pending: Vec<u8> = Vec::new();
        loop {
            let c = self.chunk(&mut r)?;
            if c.is_empty() {
                return Ok(());
            }
            pending.extend(c);
            while let Some(at) = pending.windows(end.len()).position(|w| w == end) {
                let item: Vec<u8> = pending.drain(..at + end.len()).collect();
                if !on_item(item)? {
                    return Ok(());
                }
            }
        }
    }

    /// A streaming request: `on_event` gets each SSE `data:` payload (but `[DONE]`) as it
    /// arrives, and each comment as `{"comment": TEXT}`.
    pub fn stream(
        &self,
        path: &str,
        body: &serde_json::Value,
        on_event: &mut dyn FnMut(serde_json::Value),
    ) -> Result<(), ClientError> {
        let r = self.send("POST", path, Some(body))?;
        if r.status >= 400 || !r.chunked {
            let status = r.status;
            let (_, bytes) = self.read_all(r)?;
            let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_default();
            return Err(api_error(status, &v));
        }
        // Events end with a blank line.
        self.split(r, b"\n\n", &mut |event| {
            for line in String::from_utf8_lossy(&event).lines() {
                // A comment: what the daemon does before the first event (loading the model).
                if let Some(c) = line.strip_prefix(':') {
                    on_event(serde_json::json!({ "comment": c.trim() }));
                    continue;
                }
                let Some(data) = line.strip_prefix("data:").map(str::trim_start) else { continue };
                if data == "[DONE]" {
                    return Ok(false);
                }
                let v: serde_json::Value =
                    serde_json::from_str(data).map_err(|e| ClientError::Protocol(format!("event {data:?}: {e}")))?;
                if let Some(e) = v.get("error") {
                    return Err(ClientError::Api {
                        status: e["code"].as_u64().and_then(|c| u16::try_from(c).ok()).unwrap_or(500),
                        message: e["message"].as_str().unwrap_or("failed").to_owned(),
                    });
                }
                on_event(v);
            }
            Ok(true)
        })
    }
}

fn api_error(status: u16, v: &serde_json::Value) -> ClientError {
    let message = v["error"]["message"].as_str().map(str::to_owned).unwrap_or_else(|| v.to_string());
    ClientError::Api { status, message }
}
