//! The helper process of an isolated plugin library (`inferd plugin-host FILE`): it loads the
//! library, confines itself (`sandbox`), declares what the library offers, then runs the calls
//! the daemon sends, one at a time, until the daemon closes the socket.
//!
//! The plugin sees the same host callback table as in the daemon; here the callbacks reach the
//! daemon by message (`Remote`), except `random`, which is computed in place from the session's
//! seed (the same Philox stream, so a seeded request draws the same numbers either way).
//!
//! Descriptors at start: 0 is the socket to the daemon, 1 the memory file of logits, 2 the
//! daemon's standard error. Standard output is then pointed at standard error, so a library
//! that prints cannot write into the logits.

#![allow(unsafe_code)]

use super::host::{CallCtx, HostErr, HostSide};
use super::loader::{self, Declaration, StrategyFns};
use super::philox;
use super::runner::{empty_plan, raw_init, read_raw_plan};
use super::sandbox;
use super::wire::{self, Answer, Callback, FromHelper, RawPlan, ToHelper};
use inferd_plugin_api::abi;
use std::collections::HashMap;
use std::ffi::c_void;
use std::fs::File;
use std::os::fd::FromRawFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

/// The host side inside the helper: callbacks become messages to the daemon.
struct Remote<'a> {
    sock: &'a mut UnixStream,
    seed: u64,
}

/// How long the helper polls for the daemon's answer to a callback before it sleeps (the
/// daemon answers within microseconds).
const SPIN: Duration = Duration::from_micros(100);

/// The daemon is gone or talks nonsense: nothing left to serve.
fn gone() -> ! {
    std::process::exit(0)
}

impl Remote<'_> {
    fn ask(&mut self, c: Callback) -> Result<Answer, HostErr> {
        if wire::send_to_daemon(self.sock, &FromHelper::Callback(c)).is_err() {
            gone();
        }
        let mut r = wire::Spinning { sock: self.sock, spin: SPIN, deadline: None };
        match wire::recv_from_daemon(&mut r) {
            Ok(ToHelper::Answer(Answer::Refused { status, message })) => Err(HostErr { status, message }),
            Ok(ToHelper::Answer(a)) => Ok(a),
            _ => gone(),
        }
    }

    fn done(&mut self, c: Callback) -> Result<(), HostErr> {
        match self.ask(c)? {
            Answer::Done => Ok(()),
            _ => gone(),
        }
    }

    fn seq(&mut self, c: Callback) -> Result<abi::Seq, HostErr> {
        match self.ask(c)? {
            Answer::Seq(s) => Ok(s),
            _ => gone(),
        }
    }
}

impl HostSide for Remote<'_> {
    fn log(&mut self, level: i32, message: &str) {
        let m = FromHelper::Log { level, message: message.chars().take(4096).collect() };
        if wire::send_to_daemon(self.sock, &m).is_err() {
            gone();
        }
    }
    fn seq_create(&mut self, role: u32) -> Result<abi::Seq, HostErr> {
        self.seq(Callback::SeqCreate { role })
    }
    fn seq_fork(&mut self, seq: abi::Seq) -> Result<abi::Seq, HostErr> {
        self.seq(Callback::SeqFork { seq })
    }
    fn seq_truncate(&mut self, seq: abi::Seq, len: u32) -> Result<(), HostErr> {
        self.done(Callback::SeqTruncate { seq, len })
    }
    fn seq_free(&mut self, seq: abi::Seq) -> Result<(), HostErr> {
        self.done(Callback::SeqFree { seq })
    }
    fn seq_tokens(&mut self, seq: abi::Seq) -> Result<Vec<u32>, HostErr> {
        match self.ask(Callback::SeqTokens { seq })? {
            Answer::Tokens(t) => Ok(t),
            _ => gone(),
        }
    }
    fn emit(&mut self, choice: u32, token: i32, logprob: f32) -> Result<(), HostErr> {
        self.done(Callback::Emit { choice, token, logprob })
    }
    fn finish(&mut self, choice: u32, reason: u32) -> Result<(), HostErr> {
        self.done(Callback::Finish { choice, reason })
    }
    fn random(&mut self, stream: u64, counter: u64) -> [u32; 4] {
        philox::random(self.seed, stream, counter)
    }
    fn report(&mut self, key: &str, value: f64) -> Result<(), HostErr> {
        self.done(Callback::Report { key: key.to_owned(), value })
    }
    fn token_bytes(&mut self, token: i32) -> Result<Vec<u8>, HostErr> {
        match self.ask(Callback::TokenBytes { token })? {
            Answer::Bytes(b) => Ok(b),
            _ => gone(),
        }
    }
    fn emit_top(&mut self, choice: u32, token: i32, logprob: f32, top: &[(i32, f32)]) -> Result<(), HostErr> {
        self.done(Callback::EmitTop { choice, token, logprob, top: top.to_vec() })
    }
}

/// Runs one call with `Remote` callbacks: its status and, when it failed, its message.
fn run(sock: &mut UnixStream, seed: u64, f: impl FnOnce(*mut abi::Call) -> i32) -> (i32, String) {
    let mut remote = Remote { sock, seed };
    let mut ctx = CallCtx::new(&mut remote);
    let status = f(ctx.as_call());
    let message = if status == abi::OK { String::new() } else { ctx.message(status) };
    (status, message)
}

struct Live {
    ptr: *mut c_void,
    fns: StrategyFns,
    seed: u64,
}

/// The logits memory file, mapped read-only as far as the daemon has written.
struct Logits {
    file: File,
    map: Option<memmap2::Mmap>,
}

impl Logits {
    fn rows(&mut self, vocab: usize, counts: &[u32]) -> std::io::Result<Vec<*const f32>> {
        let need: usize = counts.iter().map(|&c| c as usize * vocab * 4).sum();
        if self.map.as_ref().is_none_or(|m| m.len() < need) {
            // SAFETY: the daemon's memory file, grown to at least `need` bytes before it sent
            // this call and sealed against shrinking; mapped read-only.
            self.map = Some(unsafe { memmap2::MmapOptions::new().len(need.max(1)).map(&self.file) }?);
        }
        let base = self.map.as_ref().map_or(std::ptr::null(), |m| m.as_ptr());
        let mut at = 0usize;
        Ok(counts
            .iter()
            .map(|&c| {
                // SAFETY: `at` stays within the `need` bytes mapped.
                let p = unsafe { base.add(at) }.cast::<f32>();
                at += c as usize * vocab * 4;
                p
            })
            .collect())
    }
}

/// `inferd plugin-host FILE`: serves the library at `path` for the daemon `parent`. Returns the
/// process's exit status.
pub fn main(path: &Path, memory_mib: u64, parent: u32) -> i32 {
    sandbox::close_inherited();
    // SAFETY: the daemon started this process with the socket as descriptor 0 and the memory
    // file as descriptor 1 (`isolated::Helper::spawn`); each is taken over exactly once here,
    // the memory file through a duplicate so that descriptor 1 can become standard error.
    let (mut sock, shm) = unsafe {
        let shm = libc::dup(1);
        if shm < 0 || libc::dup2(2, 1) < 0 {
            return 1;
        }
        (UnixStream::from_raw_fd(0), File::from_raw_fd(shm))
    };
    let refuse = |sock: &mut UnixStream, why: String| {
        let _ = wire::send_to_daemon(sock, &FromHelper::Refused(why));
        0
    };
    if let Err(e) = sandbox::die_with_parent(parent) {
        return refuse(&mut sock, e.to_string());
    }
    // When memory runs out, the helper goes first (raising one's own score needs no privilege).
    let _ = std::fs::write("/proc/self/oom_score_adj", "1000");
    if let Err(e) = sandbox::limit_memory(memory_mib) {
        return refuse(&mut sock, format!("cannot limit its memory: {e}"));
    }
    let decl = match loader::load(path) {
        Ok(d) => d,
        Err(e) => return refuse(&mut sock, e),
    };
    if let Err(e) = sandbox::confine() {
        return refuse(&mut sock, format!("cannot be sandboxed: {e}"));
    }
    if wire::send_to_daemon(&mut sock, &FromHelper::Declared(decl.declared())).is_err() {
        return 0;
    }
    serve(&mut sock, shm, &decl)
}

/// The session's plan. After create and observe the helper computes it at once and sends it
/// with the answer: plan is pure (ABI rule: it changes nothing, and the same plan comes back
/// until observe), so the daemon's next plan call needs no round trip.
fn plan(sock: &mut UnixStream, l: &Live) -> Result<RawPlan, (i32, String)> {
    let mut plan = empty_plan();
    let (fns, ptr) = (l.fns, l.ptr);
    // SAFETY: the session's live pointer; `plan` is valid for the plugin to fill.
    let (status, message) = run(sock, l.seed, |c| unsafe { (fns.plan)(c, ptr, &mut plan) });
    if status != abi::OK {
        return Err((status, message));
    }
    // SAFETY: filled by the plan call that just returned.
    unsafe { read_raw_plan(&plan) }.map_err(|e| (abi::ERR, e))
}

fn serve(sock: &mut UnixStream, shm: File, decl: &Declaration) -> i32 {
    let mut sessions: HashMap<u64, Live> = HashMap::new();
    let mut logits = Logits { file: shm, map: None };
    let returned = |status: i32, message: String| FromHelper::Returned { status, message, plan: None };
    let no_session = |s: u64| returned(abi::ERR_INVALID, format!("no session {s} in the plugin's process"));
    loop {
        let msg = match wire::recv_from_daemon(sock) {
            Ok(m) => m,
            Err(_) => return 0,
        };
        let reply = match msg {
            ToHelper::Validate { strategy, init } => match (decl.strategies.get(strategy as usize), raw_init(&init)) {
                (Some(s), Ok(raw)) => {
                    let fns = s.fns;
                    // SAFETY: a checked entry point with a live context and an init struct
                    // whose pointers outlive the call.
                    let (status, message) = run(sock, init.seed, |c| unsafe { (fns.validate)(c, &raw.raw) });
                    returned(status, message)
                }
                _ => returned(abi::ERR_INVALID, format!("no strategy {strategy}, or a bad init")),
            },
            ToHelper::Create { session, strategy, init } => {
                match (decl.strategies.get(strategy as usize), raw_init(&init)) {
                    (Some(s), Ok(raw)) => {
                        let fns = s.fns;
                        let mut out: *mut c_void = std::ptr::null_mut();
                        // SAFETY: as for validate; `out` is valid for the plugin's session pointer.
                        let (status, message) =
                            run(sock, init.seed, |c| unsafe { (fns.create)(c, &raw.raw, &mut out) });
                        if status == abi::OK && out.is_null() {
                            returned(abi::ERR, "create returned no session".into())
                        } else {
                            let mut plan_ahead = None;
                            if status == abi::OK {
                                let l = Live { ptr: out, fns, seed: init.seed };
                                plan_ahead = plan(sock, &l).ok();
                                sessions.insert(session, l);
                            }
                            FromHelper::Returned { status, message, plan: plan_ahead }
                        }
                    }
                    _ => returned(abi::ERR_INVALID, format!("no strategy {strategy}, or a bad init")),
                }
            }
            ToHelper::Plan { session } => match sessions.get(&session) {
                None => no_session(session),
                Some(l) => match plan(sock, l) {
                    Ok(p) => FromHelper::Returned { status: abi::OK, message: String::new(), plan: Some(p) },
                    Err((status, message)) => returned(status, message),
                },
            },
            ToHelper::Observe { session, vocab, counts } => {
                match (sessions.get(&session), logits.rows(vocab as usize, &counts)) {
                    (None, _) => no_session(session),
                    (_, Err(e)) => returned(abi::ERR, format!("mapping the logits: {e}")),
                    (Some(l), Ok(rows)) => {
                        let view = abi::Logits {
                            header: abi::Header::new::<abi::Logits>(abi::TYPE_LOGITS),
                            n_items: counts.len() as u32,
                            vocab_size: vocab,
                            rows: rows.as_ptr(),
                            n_logits: counts.as_ptr(),
                        };
                        let (fns, ptr) = (l.fns, l.ptr);
                        // SAFETY: the session's live pointer; `view` and the mapped rows outlive the call.
                        let (status, message) = run(sock, l.seed, |c| unsafe { (fns.observe)(c, ptr, &view) });
                        // The next plan goes back with the answer (see `plan`).
                        let plan = if status == abi::OK { plan(sock, l).ok() } else { None };
                        FromHelper::Returned { status, message, plan }
                    }
                }
            }
            ToHelper::Destroy { session } => {
                if let Some(l) = sessions.remove(&session) {
                    // SAFETY: the live session, destroyed once (removed from the map).
                    unsafe { (l.fns.destroy)(l.ptr) };
                }
                continue;
            }
            ToHelper::Answer(_) => return 2,
        };
        if wire::send_to_daemon(sock, &reply).is_err() {
            return 0;
        }
    }
}
