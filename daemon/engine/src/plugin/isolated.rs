//! A plugin library in a helper process, seen from the daemon: spawning it, calling into it with
//! a time limit, and what happens when it crashes, hangs or talks nonsense.
//!
//! The helper is the daemon's own executable run as `inferd plugin-host` (`helper::main`): it
//! loads the one library, confines itself (`sandbox`) and serves calls over a Unix stream socket
//! (its standard input), reaching the daemon's host callbacks by messages (`wire`). Logits rows
//! travel through a memory file (`memfd`, its standard output at start) that the daemon writes
//! and the helper maps read-only; the daemon seals it against shrinking, so no helper can make
//! the daemon's mapping fault.
//!
//! One call at a time goes to a helper (a mutex over its connection); every wait for its next
//! message is bounded by the call time limit. A helper that dies, overruns the limit or breaks
//! the protocol is killed; the calls in flight and every later call into its sessions fail with
//! the reason, and the library is quarantined (persistently when the registry keeps a list).
//! The daemon never runs a byte of the library's code, its initializers included.

#![allow(unsafe_code)]

use super::host::HostSide;
use super::quarantine::Quarantine;
use super::recorder::signal_name;
use super::wire::{self, Answer, Callback, Declared, FromHelper, RawPlan, ReadError, ToHelper};
use std::fs::File;
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How isolated libraries are run.
#[derive(Clone, Debug)]
pub struct Isolation {
    /// The executable that serves as helper (`<exe> plugin-host ...`): the daemon's own.
    pub exe: PathBuf,
    /// How long one call into the plugin may run (each wait for its next message).
    pub call_timeout: Duration,
    /// The helper's address-space limit (RLIMIT_AS), MiB.
    pub memory_mib: u64,
    /// Where faults are remembered across restarts.
    pub quarantine: Option<Arc<Quarantine>>,
}

/// The logits of an observe: `counts[i]` rows of `vocab` floats at the start of `rows[i]`.
pub struct Rows<'a> {
    pub rows: &'a [Vec<f32>],
    pub counts: &'a [u32],
    pub vocab: usize,
}

/// How a call into the plugin returned: its status, its message when it failed, its plan.
pub struct Returned {
    pub status: i32,
    pub message: String,
    pub plan: Option<RawPlan>,
}

/// How long a helper may take to load its library and declare it.
const LOAD_TIMEOUT: Duration = Duration::from_secs(10);

/// The memory file the logits go through.
struct Shm {
    file: File,
    map: Option<memmap2::MmapMut>,
}

impl Shm {
    fn new() -> std::io::Result<Shm> {
        // SAFETY: a NUL-terminated name and valid flags; the descriptor returned is new and
        // owned by the `File` alone.
        let file = unsafe {
            let fd = libc::memfd_create(c"inferd-logits".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING);
            if fd < 0 {
                return Err(std::io::Error::last_os_error());
            }
            File::from(OwnedFd::from_raw_fd(fd))
        };
        // SAFETY: fcntl on a descriptor we own.
        if unsafe { libc::fcntl(std::os::fd::AsRawFd::as_raw_fd(&file), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Shm { file, map: None })
    }

    /// Writes item after item, `counts[i]` rows of `vocab` floats from each.
    fn write(&mut self, Rows { rows, counts, vocab }: Rows<'_>) -> std::io::Result<()> {
        let need: usize = counts.iter().map(|&c| c as usize * vocab * 4).sum();
        if self.map.as_ref().is_none_or(|m| m.len() < need) {
            let len = need.next_multiple_of(1 << 20).max(1 << 20);
            self.file.set_len(len as u64)?;
            // SAFETY: a shared mapping of our own memory file, sealed against shrinking, so
            // the whole length stays backed whatever the helper does with its descriptor.
            self.map = Some(unsafe { memmap2::MmapOptions::new().len(len).map_mut(&self.file) }?);
        }
        let Some(map) = self.map.as_mut() else { return Ok(()) };
        let mut at = 0;
        for (r, &c) in rows.iter().zip(counts) {
            let n = (c as usize * vocab).min(r.len());
            // SAFETY: f32 has no padding and every bit pattern is valid bytes; both processes
            // run on this machine, so its byte order is theirs.
            let bytes = unsafe { std::slice::from_raw_parts(r.as_ptr().cast::<u8>(), 4 * n) };
            map[at..at + 4 * n].copy_from_slice(bytes);
            at += 4 * c as usize * vocab;
        }
        Ok(())
    }
}

struct Conn {
    child: Child,
    sock: UnixStream,
    shm: Shm,
}

/// A library's helper process.
pub struct Helper {
    path: PathBuf,
    timeout: Duration,
    quarantine: Option<Arc<Quarantine>>,
    conn: Mutex<Conn>,
    /// Why the helper is out of service, once it is.
    fault: Mutex<Option<String>>,
    next_session: AtomicU64,
}

impl std::fmt::Debug for Helper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Helper({})", self.path.display())
    }
}

/// Reads one message, giving up at `deadline`.
fn recv(sock: &mut UnixStream, deadline: Instant) -> Result<FromHelper, ReadError> {
    wire::recv_from_helper(&mut wire::Spinning { sock, spin: SPIN, deadline: Some(deadline) })
}

/// How long the daemon polls for the helper's next message before it sleeps: a strategy's
/// call mostly returns within it (an argmax over 49,152 logits takes about 30 us).
const SPIN: Duration = Duration::from_micros(150);

/// Serves one forwarded callback with the daemon's host side.
fn answer(side: &mut dyn HostSide, c: Callback) -> Answer {
    let r = match c {
        Callback::SeqCreate { role } => side.seq_create(role).map(Answer::Seq),
        Callback::SeqFork { seq } => side.seq_fork(seq).map(Answer::Seq),
        Callback::SeqTruncate { seq, len } => side.seq_truncate(seq, len).map(|()| Answer::Done),
        Callback::SeqFree { seq } => side.seq_free(seq).map(|()| Answer::Done),
        Callback::SeqTokens { seq } => side.seq_tokens(seq).map(Answer::Tokens),
        Callback::Emit { choice, token, logprob } => side.emit(choice, token, logprob).map(|()| Answer::Done),
        Callback::EmitTop { choice, token, logprob, top } => {
            side.emit_top(choice, token, logprob, &top).map(|()| Answer::Done)
        }
        Callback::Finish { choice, reason } => side.finish(choice, reason).map(|()| Answer::Done),
        Callback::Report { key, value } => side.report(&key, value).map(|()| Answer::Done),
        Callback::TokenBytes { token } => side.token_bytes(token).map(Answer::Bytes),
    };
    r.unwrap_or_else(|e| Answer::Refused { status: e.status, message: e.message })
}

/// How a child ended, in words.
fn ended(child: &mut Child) -> String {
    use std::os::unix::process::ExitStatusExt;
    match child.wait() {
        Ok(s) => match (s.code(), s.signal()) {
            (_, Some(sig)) => format!("killed by signal {sig} ({})", signal_name(sig as u32)),
            (Some(c), _) => format!("exited with status {c}"),
            _ => "ended".into(),
        },
        Err(e) => format!("could not be waited for ({e})"),
    }
}

impl Helper {
    /// Starts a helper for the library at `path` and reads its declaration.
    pub fn spawn(path: &Path, iso: &Isolation) -> Result<(Arc<Helper>, Declared), String> {
        let (ours, theirs) = UnixStream::pair().map_err(|e| format!("socket pair: {e}"))?;
        let shm = Shm::new().map_err(|e| format!("memory file: {e}"))?;
        let shm_fd = shm.file.try_clone().map_err(|e| format!("memory file: {e}"))?;
        let mut cmd = Command::new(&iso.exe);
        cmd.arg("plugin-host")
            .arg(path)
            .arg("--memory-mib")
            .arg(iso.memory_mib.to_string())
            .arg("--parent")
            .arg(std::process::id().to_string())
            .stdin(Stdio::from(OwnedFd::from(theirs)))
            .stdout(Stdio::from(shm_fd))
            .stderr(Stdio::inherit());
        let mut child = super::sandbox::spawn_lasting(cmd)
            .map_err(|e| format!("starting its helper {}: {e}", iso.exe.display()))?;
        let mut sock = ours;
        let _ = sock.set_write_timeout(Some(iso.call_timeout.max(Duration::from_millis(100))));
        let decl = match recv(&mut sock, Instant::now() + LOAD_TIMEOUT) {
            Ok(FromHelper::Declared(d)) => d,
            Ok(FromHelper::Refused(why)) => {
                let _ = child.wait();
                return Err(why);
            }
            Ok(other) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("its helper sent {other:?} before declaring it"));
            }
            Err(e) => {
                let timed_out = matches!(&e, ReadError::Io(io) if is_timeout(io));
                let _ = child.kill();
                let how = ended(&mut child);
                let why = if timed_out {
                    format!("did not load within {} s (its helper was killed)", LOAD_TIMEOUT.as_secs())
                } else {
                    format!("its helper died while loading it ({how})")
                };
                if let Some(q) = &iso.quarantine {
                    let _ = q.add(path, &why);
                }
                return Err(why);
            }
        };
        let helper = Helper {
            path: path.to_owned(),
            timeout: iso.call_timeout,
            quarantine: iso.quarantine.clone(),
            conn: Mutex::new(Conn { child, sock, shm }),
            fault: Mutex::new(None),
            next_session: AtomicU64::new(1),
        };
        Ok((Arc::new(helper), decl))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn new_session(&self) -> u64 {
        self.next_session.fetch_add(1, Ordering::Relaxed)
    }

    /// Why the helper is out of service, if it is.
    pub fn fault(&self) -> Option<String> {
        self.fault.lock().ok().and_then(|f| f.clone())
    }

    /// Puts the helper out of service: kills it, and quarantines the library.
    fn broke(&self, conn: &mut Conn, what: String) -> String {
        let _ = conn.child.kill();
        let how = ended(&mut conn.child);
        let why = format!("{what}; its process was {how}");
        eprintln!("inferd: plugin {}: {why}: quarantined", self.path.display());
        if let Some(q) = &self.quarantine {
            if let Err(e) = q.add(&self.path, &why) {
                eprintln!("inferd: recording the quarantine in {}: {e}", q.file().display());
            }
        }
        if let Ok(mut f) = self.fault.lock() {
            *f = Some(why.clone());
        }
        why
    }

    /// Sends `msg` and serves the callbacks the plugin makes until it returns: its status,
    /// message and plan; or why the helper broke (a fault).
    pub fn call(&self, msg: &ToHelper, rows: Option<Rows<'_>>, side: &mut dyn HostSide) -> Result<Returned, String> {
        if let Some(f) = self.fault() {
            return Err(f);
        }
        let mut conn = self.conn.lock().map_err(|_| "the plugin's connection is poisoned".to_string())?;
        if let Some(rows) = rows {
            if let Err(e) = conn.shm.write(rows) {
                // The daemon's memory, not the plugin's fault.
                return Err(format!("passing the logits to the plugin's process: {e}"));
            }
        }
        if let Err(e) = wire::send_to_helper(&mut conn.sock, msg) {
            return Err(self.broke(&mut conn, format!("it stopped reading ({e})")));
        }
        loop {
            match recv(&mut conn.sock, Instant::now() + self.timeout) {
                Ok(FromHelper::Callback(c)) => {
                    let a = answer(side, c);
                    if let Err(e) = wire::send_to_helper(&mut conn.sock, &ToHelper::Answer(a)) {
                        return Err(self.broke(&mut conn, format!("it stopped reading ({e})")));
                    }
                }
                Ok(FromHelper::Log { level, message }) => side.log(level, &message),
                Ok(FromHelper::Returned { status, message, plan }) => return Ok(Returned { status, message, plan }),
                Ok(other) => {
                    let what = format!("it broke the protocol (sent {other:?} during a call)");
                    return Err(self.broke(&mut conn, what));
                }
                Err(ReadError::Io(e)) if is_timeout(&e) => {
                    let what = format!("a call into it ran for longer than {} ms", self.timeout.as_millis());
                    return Err(self.broke(&mut conn, what));
                }
                Err(ReadError::Io(_)) => return Err(self.broke(&mut conn, "it crashed".into())),
                Err(ReadError::Wire(e)) => return Err(self.broke(&mut conn, format!("it broke the protocol ({e})"))),
            }
        }
    }

    /// Ends a session (nothing comes back).
    pub fn destroy(&self, session: u64) {
        if self.fault().is_some() {
            return;
        }
        if let Ok(mut conn) = self.conn.lock() {
            if let Err(e) = wire::send_to_helper(&mut conn.sock, &ToHelper::Destroy { session }) {
                self.broke(&mut conn, format!("it stopped reading ({e})"));
            }
        }
    }
}

fn is_timeout(e: &std::io::Error) -> bool {
    matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut)
}

impl Drop for Helper {
    fn drop(&mut self) {
        if let Ok(conn) = self.conn.get_mut() {
            let _ = conn.child.kill();
            let _ = conn.child.wait();
        }
    }
}
