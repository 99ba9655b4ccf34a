//! Chat templates rendered in a confined helper process, bounded in memory as well as in steps.
//!
//! A model file's template is a program written by whoever made the file. Fuel bounds its
//! steps ([`crate::chat::FUEL`]) and a cap its output, but not what it builds along the way: a
//! template that doubles a string forty times takes a few hundred steps and a terabyte. Nothing
//! inside a process can stop that gracefully (an allocation that fails aborts the process), so
//! the daemon renders in helpers: its own executable run as `inferd template-host`, with its
//! address space limited to [`MEMORY_MIB`] (RLIMIT_AS), the plugin helpers' system-call filter
//! (it can compute and talk over its socket, nothing else), and death with the daemon. A
//! rendering that runs out of memory, overruns [`RENDER_TIMEOUT`] or crashes kills only its
//! helper, and the request gets an error naming the budget; the next rendering starts another.
//!
//! One rendering at a time per helper; idle helpers are kept for the next ([`MAX_IDLE`]), each
//! with the compiled templates it last used. Messages travel as length-prefixed JSON frames
//! over a Unix socket pair (the helper's standard input): about a hundred microseconds per
//! rendering against the milliseconds of a prefill.

#![allow(unsafe_code)]

use crate::chat::{ChatMessage, ChatTemplate, TemplateError, MAX_RENDERED};
use crate::plugin::sandbox;
use crate::tools::{Tool, ToolCall};
use serde::{Deserialize, Serialize};
use std::io::{Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::Duration;

/// A helper's address space, MiB: the executable and its libraries (about 60 MiB mapped), a
/// rendering's input (a request body is at most a few MiB) and the largest prompt it may write
/// ([`MAX_RENDERED`], 64 MiB) several times over while it is built.
pub const MEMORY_MIB: u64 = 768;
/// How long one rendering may take, its template's compilation included (fuel stops a
/// spinning template after about a third of a second).
pub const RENDER_TIMEOUT: Duration = Duration::from_secs(10);
/// Idle helpers kept (more are started while renderings overlap, then ended).
pub const MAX_IDLE: usize = 4;
/// Compiled templates a helper keeps, by source.
const CACHED: usize = 8;
/// The largest frame either side reads: a rendering's input or output with room to spare.
const MAX_FRAME: usize = 2 * MAX_RENDERED;

/// A template as the helper compiles (and caches) it: its source (ChatML when `None`) and the
/// model's BOS and EOS text.
#[derive(Clone, Copy, Debug)]
pub struct Template<'a> {
    pub source: Option<&'a str>,
    pub bos: &'a str,
    pub eos: &'a str,
}

/// One rendering, as the helper receives it.
#[derive(Serialize, Deserialize)]
struct Job {
    source: Option<String>,
    bos: String,
    eos: String,
    messages: Vec<WireMessage>,
    tools: Vec<WireTool>,
    /// Variables beside the standard ones ([`crate::chat::Extra`]).
    #[serde(default)]
    extra: crate::chat::Extra,
    add_generation_prompt: bool,
}

#[derive(Serialize, Deserialize)]
struct WireMessage {
    role: String,
    content: String,
    tool_calls: Vec<(String, String, String)>,
    tool_call_id: Option<String>,
    name: Option<String>,
    #[serde(default)]
    reasoning: Option<String>,
}

#[derive(Serialize, Deserialize)]
struct WireTool {
    name: String,
    description: Option<String>,
    /// The schema as JSON text: the client's key order is what the template shows.
    parameters: String,
}

impl From<&ChatMessage> for WireMessage {
    fn from(m: &ChatMessage) -> Self {
        WireMessage {
            role: m.role.clone(),
            content: m.content.clone(),
            tool_calls: m.tool_calls.iter().map(|c| (c.id.clone(), c.name.clone(), c.arguments.clone())).collect(),
            tool_call_id: m.tool_call_id.clone(),
            name: m.name.clone(),
            reasoning: m.reasoning.clone(),
        }
    }
}

impl From<WireMessage> for ChatMessage {
    fn from(m: WireMessage) -> Self {
        ChatMessage {
            role: m.role,
            content: m.content,
            tool_calls: m
                .tool_calls
                .into_iter()
                .map(|(id, name, arguments)| ToolCall { id, name, arguments })
                .collect(),
            tool_call_id: m.tool_call_id,
            name: m.name,
            reasoning: m.reasoning,
            // The template sees an image as its marker in the content; the pixels stay here.
            images: Vec::new(),
        }
    }
}

/// The helper's answer.
#[derive(Serialize, Deserialize)]
enum Reply {
    Rendered(String),
    Failed(String),
}

fn write_frame(w: &mut impl Write, value: &impl Serialize) -> std::io::Result<()> {
    let body = serde_json::to_vec(value).map_err(std::io::Error::other)?;
    w.write_all(&(body.len() as u32).to_le_bytes())?;
    w.write_all(&body)?;
    w.flush()
}

fn read_frame<T: for<'de> Deserialize<'de>>(r: &mut impl Read) -> std::io::Result<T> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(std::io::Error::other(format!("a frame of {len} bytes")));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)?;
    serde_json::from_slice(&body).map_err(std::io::Error::other)
}

/// A helper serving renderings.
struct Helper {
    child: Child,
    sock: UnixStream,
}

impl Drop for Helper {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The daemon's side: renders through helpers started from `exe`.
#[derive(Debug)]
pub struct TemplateHost {
    exe: PathBuf,
    idle: Mutex<Vec<Helper>>,
}

impl std::fmt::Debug for Helper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Helper").field("pid", &self.child.id()).finish()
    }
}

impl TemplateHost {
    /// Helpers will be `exe template-host` (the daemon's own executable: `/proc/self/exe`).
    pub fn new(exe: PathBuf) -> TemplateHost {
        TemplateHost { exe, idle: Mutex::new(Vec::new()) }
    }

    fn spawn(&self) -> Result<Helper, TemplateError> {
        let (ours, theirs) =
            UnixStream::pair().map_err(|e| TemplateError::new(format!("no socket for its renderer: {e}")))?;
        let mut cmd = Command::new(&self.exe);
        cmd.arg("template-host")
            .arg("--memory-mib")
            .arg(MEMORY_MIB.to_string())
            .arg("--parent")
            .arg(std::process::id().to_string())
            .stdin(Stdio::from(OwnedFd::from(theirs)))
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let child = sandbox::spawn_lasting(cmd)
            .map_err(|e| TemplateError::new(format!("starting its renderer {}: {e}", self.exe.display())))?;
        let _ = ours.set_read_timeout(Some(RENDER_TIMEOUT));
        let _ = ours.set_write_timeout(Some(RENDER_TIMEOUT));
        Ok(Helper { child, sock: ours })
    }

    /// `messages` (and `tools`, and `extra` variables) rendered with `template`, as
    /// [`ChatTemplate::render_with`] renders them, in a helper.
    pub fn render(
        &self,
        template: Template<'_>,
        messages: &[ChatMessage],
        tools: &[Tool],
        extra: &crate::chat::Extra,
        add_generation_prompt: bool,
    ) -> Result<String, TemplateError> {
        let job = Job {
            extra: extra.clone(),
            source: template.source.map(str::to_owned),
            bos: template.bos.to_owned(),
            eos: template.eos.to_owned(),
            messages: messages.iter().map(WireMessage::from).collect(),
            tools: tools
                .iter()
                .map(|t| WireTool {
                    name: t.name.clone(),
                    description: t.description.clone(),
                    parameters: t.parameters.to_string(),
                })
                .collect(),
            add_generation_prompt,
        };
        // An idle helper that ended meanwhile (killed for memory, say) is no use.
        let reused = self.idle.lock().ok().and_then(|mut idle| {
            while let Some(mut h) = idle.pop() {
                if matches!(h.child.try_wait(), Ok(None)) {
                    return Some(h);
                }
            }
            None
        });
        let mut helper = match reused {
            Some(h) => h,
            None => self.spawn()?,
        };
        let answer = write_frame(&mut helper.sock, &job).and_then(|()| read_frame::<Reply>(&mut helper.sock));
        match answer {
            Ok(reply) => {
                if let Ok(mut idle) = self.idle.lock() {
                    if idle.len() < MAX_IDLE {
                        idle.push(helper);
                    }
                }
                match reply {
                    Reply::Rendered(text) => Ok(text),
                    Reply::Failed(why) => Err(TemplateError::new(why)),
                }
            }
            Err(e) => Err(TemplateError::new(died(helper, &e))),
        }
    }
}

/// Why a rendering ended without an answer, in words, once its helper is gone.
fn died(mut helper: Helper, e: &std::io::Error) -> String {
    use std::os::unix::process::ExitStatusExt;
    let timed_out = matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut);
    let _ = helper.child.kill();
    let status = helper.child.wait().ok();
    if timed_out {
        return format!("the rendering ran past {} s and was stopped", RENDER_TIMEOUT.as_secs());
    }
    match status.and_then(|s| s.signal()) {
        Some(libc::SIGABRT) => {
            format!("the rendering ran past its memory budget of {MEMORY_MIB} MiB and was stopped")
        }
        Some(sig) => format!("the rendering crashed (signal {sig})"),
        None => format!("its renderer failed ({e})"),
    }
}

/// `inferd template-host`: serves renderings over its standard input for the daemon `parent`.
/// Returns the process's exit status.
pub fn main(memory_mib: u64, parent: u32) -> i32 {
    sandbox::close_inherited();
    // SAFETY: the daemon started this process with its end of a socket pair as descriptor 0
    // (`TemplateHost::spawn`), taken over exactly once here.
    let mut sock = unsafe { UnixStream::from_raw_fd(0) };
    if sandbox::die_with_parent(parent).is_err() {
        return 1;
    }
    // When memory runs out, the helper goes first (raising one's own score needs no privilege).
    let _ = std::fs::write("/proc/self/oom_score_adj", "1000");
    if sandbox::limit_memory(memory_mib).is_err() || sandbox::confine().is_err() {
        return 1;
    }
    let mut cache: Vec<(Job, ChatTemplate)> = Vec::new();
    loop {
        let Ok(job) = read_frame::<Job>(&mut sock) else { return 0 };
        let reply = match render_job(&mut cache, job) {
            Ok(text) => Reply::Rendered(text),
            Err(e) => Reply::Failed(e.to_string()),
        };
        if write_frame(&mut sock, &reply).is_err() {
            return 0;
        }
    }
}

/// Renders `job`, compiling its template unless `cache` has it (the cache's entries keep the
/// template's identity: source, BOS and EOS; their messages are emptied).
fn render_job(cache: &mut Vec<(Job, ChatTemplate)>, mut job: Job) -> Result<String, TemplateError> {
    let add_generation_prompt = job.add_generation_prompt;
    let extra = std::mem::take(&mut job.extra);
    let messages: Vec<ChatMessage> = std::mem::take(&mut job.messages).into_iter().map(ChatMessage::from).collect();
    let tools = std::mem::take(&mut job.tools)
        .into_iter()
        .map(|t| {
            let parameters = serde_json::from_str(&t.parameters).map_err(|e| TemplateError::new(e.to_string()))?;
            Ok(Tool { name: t.name, description: t.description, parameters })
        })
        .collect::<Result<Vec<Tool>, TemplateError>>()?;
    let hit = cache.iter().position(|(k, _)| k.source == job.source && k.bos == job.bos && k.eos == job.eos);
    let i = match hit {
        Some(i) => i,
        None => {
            let t = ChatTemplate::new(job.source.as_deref(), job.bos.clone(), job.eos.clone())?;
            if cache.len() == CACHED {
                cache.remove(0);
            }
            cache.push((job, t));
            cache.len() - 1
        }
    };
    cache[i].1.render_with(&messages, &tools, &extra, add_generation_prompt)
}
