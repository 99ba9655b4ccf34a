//! An upstream's OpenAI answer read as events, for the edges that translate it (Ollama's routes,
//! D-Bus): text, reasoning text, whole tool calls, the finish reason and the token counts.
//!
//! The answer is a server-sent-event stream of chunks (`data: {...}` lines, `data: [DONE]` at
//! the end) or, from an upstream that does not stream, one JSON body. A tool call streams as
//! pieces of its arguments under its index; it is handed on whole, once the choice finishes.
//! An `error` object in the stream, or a stream that ends before its choice finished, is an
//! error with the upstream's message.

use inferd_engine::tools::ToolCall;
use serde_json::Value;
use std::collections::VecDeque;

/// What the upstream's answer says, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// Answer text (a chat's `content`, a completion's `text`).
    Text(String),
    /// Reasoning text (`reasoning_content` or `reasoning`: vLLM, SGLang, llama-server).
    Reasoning(String),
    /// The tool calls of the answer, complete.
    Calls(Vec<ToolCall>),
    /// The choice ended: "stop", "length", "tool_calls", ...
    Finish(String),
    /// Token counts of the prompt and the answer.
    Usage { prompt: u64, completion: u64 },
}

/// A tool call still streaming.
#[derive(Default)]
struct Partial {
    id: String,
    name: String,
    arguments: String,
}

/// Turns the upstream's bytes into [`Event`]s.
#[derive(Default)]
pub struct Reader {
    line: Vec<u8>,
    data: String,
    calls: Vec<Partial>,
    finished: bool,
    ended: bool,
    out: VecDeque<Result<Event, String>>,
}

impl Reader {
    /// Takes the next bytes of an SSE stream.
    pub fn feed(&mut self, bytes: &[u8]) {
        for &b in bytes {
            if b != b'\n' {
                self.line.push(b);
                continue;
            }
            let line = std::mem::take(&mut self.line);
            let line = String::from_utf8_lossy(&line);
            let line = line.strip_suffix('\r').unwrap_or(&line);
            if line.is_empty() {
                self.dispatch();
            } else if let Some(d) = line.strip_prefix("data:") {
                if !self.data.is_empty() {
                    self.data.push('\n');
                }
                self.data.push_str(d.strip_prefix(' ').unwrap_or(d));
            }
            // Comments (`:`), `event:`, `id:` and `retry:` lines carry nothing here.
        }
    }

    /// A whole JSON answer (an upstream that did not stream).
    pub fn whole(&mut self, body: &[u8]) {
        match serde_json::from_slice::<Value>(body) {
            Ok(v) => self.chunk(&v),
            Err(e) => self.out.push_back(Err(format!("the upstream's answer is not JSON: {e}"))),
        }
        self.end();
    }

    /// The stream ended (`[DONE]` or the connection closed).
    pub fn end(&mut self) {
        if self.ended {
            return;
        }
        if !self.data.is_empty() {
            self.dispatch();
        }
        self.ended = true;
        if !self.finished {
            self.finish(None);
            self.out.push_back(Err("the upstream's answer ended before it finished".into()));
        }
    }

    /// The next event, once one is whole.
    pub fn take(&mut self) -> Option<Result<Event, String>> {
        self.out.pop_front()
    }

    pub fn ended(&self) -> bool {
        self.ended
    }

    fn dispatch(&mut self) {
        let data = std::mem::take(&mut self.data);
        if data.is_empty() || self.ended {
            return;
        }
        if data.trim() == "[DONE]" {
            self.end();
            return;
        }
        match serde_json::from_str::<Value>(&data) {
            Ok(v) => self.chunk(&v),
            Err(e) => self.out.push_back(Err(format!("the upstream sent a chunk that is not JSON: {e}"))),
        }
    }

    /// One chunk (or a whole answer): its first choice and its usage.
    fn chunk(&mut self, v: &Value) {
        if let Some(e) = v.get("error").filter(|e| !e.is_null()) {
            let m = e["message"].as_str().or_else(|| e.as_str()).map_or_else(|| e.to_string(), str::to_owned);
            self.out.push_back(Err(m));
            return;
        }
        if let Some(c) = v["choices"].get(0) {
            // A stream's `delta`, a whole chat answer's `message`; a completion's `text`.
            let d = c.get("delta").or_else(|| c.get("message")).unwrap_or(&Value::Null);
            // vLLM's and llama-server's key, or SGLang's.
            let reasoning = ["reasoning_content", "reasoning"].map(|key| d[key].as_str().filter(|t| !t.is_empty()));
            if let Some(t) = reasoning.into_iter().flatten().next() {
                self.out.push_back(Ok(Event::Reasoning(t.to_owned())));
            }
            if let Some(t) = d["content"].as_str().or_else(|| c["text"].as_str()).filter(|t| !t.is_empty()) {
                self.out.push_back(Ok(Event::Text(t.to_owned())));
            }
            for (i, tc) in d["tool_calls"].as_array().into_iter().flatten().enumerate() {
                let at = tc["index"].as_u64().map_or(i, |x| x as usize);
                if at > 1024 {
                    continue;
                }
                if self.calls.len() <= at {
                    self.calls.resize_with(at + 1, Partial::default);
                }
                let p = &mut self.calls[at];
                if let Some(id) = tc["id"].as_str() {
                    p.id = id.to_owned();
                }
                if let Some(n) = tc["function"]["name"].as_str() {
                    p.name.push_str(n);
                }
                match &tc["function"]["arguments"] {
                    Value::String(a) => p.arguments.push_str(a),
                    Value::Null => {}
                    // Some servers send the arguments as an object.
                    other => p.arguments.push_str(&other.to_string()),
                }
            }
            if let Some(r) = c["finish_reason"].as_str() {
                self.finish(Some(r));
            }
        }
        if let (Some(p), Some(n)) = (v["usage"]["prompt_tokens"].as_u64(), v["usage"]["completion_tokens"].as_u64()) {
            self.out.push_back(Ok(Event::Usage { prompt: p, completion: n }));
        }
    }

    /// The choice ended: its calls go out whole, then the reason.
    fn finish(&mut self, reason: Option<&str>) {
        if self.finished {
            return;
        }
        self.finished = true;
        let calls: Vec<ToolCall> = std::mem::take(&mut self.calls)
            .into_iter()
            .enumerate()
            .filter(|(_, p)| !p.name.is_empty())
            .map(|(i, p)| ToolCall {
                id: if p.id.is_empty() { format!("call_{i}") } else { p.id },
                name: p.name,
                arguments: if p.arguments.trim().is_empty() { "{}".into() } else { p.arguments },
            })
            .collect();
        if !calls.is_empty() {
            self.out.push_back(Ok(Event::Calls(calls)));
        }
        if let Some(r) = reason {
            self.out.push_back(Ok(Event::Finish(r.to_owned())));
        }
    }
}

/// The upstream's answer as events, read as it arrives.
pub struct Events {
    resp: reqwest::Response,
    reader: Reader,
    streamed: bool,
    /// A whole answer's bytes so far.
    body: Vec<u8>,
}

impl Events {
    pub fn new(resp: reqwest::Response) -> Events {
        let kind = resp.headers().get(reqwest::header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("");
        let streamed = kind.starts_with("text/event-stream");
        Events { resp, reader: Reader::default(), streamed, body: Vec::new() }
    }

    /// The next event; `None` once the answer is over.
    pub async fn next(&mut self) -> Option<Result<Event, String>> {
        loop {
            if let Some(e) = self.reader.take() {
                return Some(e);
            }
            if self.reader.ended() {
                return None;
            }
            if !self.streamed {
                match self.resp.chunk().await {
                    Ok(Some(b)) => self.body.extend_from_slice(&b),
                    Ok(None) => self.reader.whole(&self.body),
                    Err(e) => {
                        self.reader.ended = true;
                        return Some(Err(format!("reading the upstream's answer: {e}")));
                    }
                }
                continue;
            }
            match self.resp.chunk().await {
                Ok(Some(b)) => self.reader.feed(&b),
                Ok(None) => self.reader.end(),
                Err(e) => {
                    self.reader.ended = true;
                    return Some(Err(format!("reading the upstream's answer: {e}")));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Event, Reader};

    fn read(chunks: &[&str]) -> Vec<Result<Event, String>> {
        let mut r = Reader::default();
        let mut out = Vec::new();
        for c in chunks {
            r.feed(c.as_bytes());
            out.extend(std::iter::from_fn(|| r.take()));
        }
        r.end();
        out.extend(std::iter::from_fn(|| r.take()));
        out
    }

    #[test]
    fn a_chat_stream_split_anywhere_reads_the_same() {
        let stream = concat!(
            "data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n",
            ": keep-alive\n\n",
            "data: {\"choices\":[{\"delta\":{\"reasoning_content\":\"hm\"}}]}\r\n\r\n",
            "data: {\"choices\":[{\"delta\":{\"content\":\"Hé\"}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"c1\",\"function\":{\"name\":\"get\",\"arguments\":\"{\\\"a\\\":\"}}]}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\"1}\"}}]}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{},\"finish_reason\":\"tool_calls\"}]}\n\n",
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":3}}\n\n",
            "data: [DONE]\n\n",
        );
        let want = vec![
            Ok(Event::Reasoning("hm".into())),
            Ok(Event::Text("Hé".into())),
            Ok(Event::Calls(vec![inferd_engine::tools::ToolCall {
                id: "c1".into(),
                name: "get".into(),
                arguments: "{\"a\":1}".into(),
            }])),
            Ok(Event::Finish("tool_calls".into())),
            Ok(Event::Usage { prompt: 7, completion: 3 }),
        ];
        assert_eq!(read(&[stream]), want);
        // Byte by byte (a multi-byte character split too).
        let bytes = stream.as_bytes();
        let mut r = Reader::default();
        let mut got = Vec::new();
        for b in bytes {
            r.feed(std::slice::from_ref(b));
            got.extend(std::iter::from_fn(|| r.take()));
        }
        assert_eq!(got, want);
    }

    #[test]
    fn an_error_or_an_early_end_is_an_error() {
        let got = read(&["data: {\"choices\":[{\"text\":\"a\"}]}\n\n", "data: {\"error\":{\"message\":\"boom\"}}\n\n"]);
        assert_eq!(got[0], Ok(Event::Text("a".into())));
        assert_eq!(got[1], Err("boom".into()));
        assert!(got.last().unwrap().as_ref().unwrap_err().contains("ended before it finished"));
        let got = read(&["data: {\"choices\":[{\"text\":\"a\",\"finish_reason\":\"length\"}]}\n\n"]);
        assert_eq!(got, vec![Ok(Event::Text("a".into())), Ok(Event::Finish("length".into()))]);
    }

    #[test]
    fn a_whole_answer_reads_as_one_chunk() {
        let mut r = Reader::default();
        r.whole(br#"{"choices":[{"message":{"content":"hi","tool_calls":[{"id":"x","function":{"name":"f","arguments":"{}"}}]},"finish_reason":"tool_calls"}],"usage":{"prompt_tokens":2,"completion_tokens":1}}"#);
        let got: Vec<_> = std::iter::from_fn(|| r.take()).collect();
        assert_eq!(got.len(), 4, "{got:?}");
        assert_eq!(got[3], Ok(Event::Usage { prompt: 2, completion: 1 }));
    }
}
