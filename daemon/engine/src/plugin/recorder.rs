//! The crash recorder for in-process plugin calls: which plugin each thread is calling into and
//! since when, kept in a shared file mapping that outlives the process.
//!
//! A library loaded into the daemon (inferd's own strategies, or any with `isolate = "none"`)
//! can take the daemon down with it: a segfault, an abort, a loop that never returns. The kernel
//! keeps a `MAP_SHARED` page after its process dies, so the next start reads what the last one
//! was doing: a fatal signal's handler notes the thread and the time, and a call found open on
//! the thread that crashed, or open for longer than the call time limit when the daemon was
//! killed (the service manager's watchdog aborts a daemon whose engine stopped turning), names
//! the library to quarantine. A call open when the daemon was killed without a signal it could
//! see (SIGKILL) names nobody: a plugin is not blamed for what it may not have done.
//!
//! Recording a call costs a clock read and a few stores; nothing is written to the file system.

#![allow(unsafe_code)]

use std::cell::RefCell;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicPtr, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::Mutex;
use std::time::Duration;

const MAGIC: u64 = 0x0031_7265_6472_6f63; // "corder1"
const SLOTS: usize = 64;
const PATH_MAX: usize = 480;

#[repr(C)]
struct Slot {
    /// The thread's id (gettid); 0: the slot is free.
    tid: AtomicU32,
    /// 1 while the thread is inside a call.
    active: AtomicU32,
    /// When the call began (CLOCK_MONOTONIC, nanoseconds).
    start: AtomicU64,
    path_len: AtomicU32,
    _pad: AtomicU32,
    path: [AtomicU8; PATH_MAX],
}

#[repr(C)]
struct Page {
    magic: AtomicU64,
    /// The thread a fatal signal hit, the signal, and when.
    died_tid: AtomicU32,
    died_signal: AtomicU32,
    died_at: AtomicU64,
    slots: [Slot; SLOTS],
}

/// The installed page (null: recording is off, as in `inferd run` or an embedding program).
static PAGE: AtomicPtr<Page> = AtomicPtr::new(std::ptr::null_mut());
static FREE: Mutex<Vec<usize>> = Mutex::new(Vec::new());

fn page() -> Option<&'static Page> {
    let p = PAGE.load(Ordering::Acquire);
    // SAFETY: non-null only once `install` has leaked a mapping of a whole `Page` (all atomics,
    // valid for any bytes), never unmapped.
    (!p.is_null()).then(|| unsafe { &*p })
}

fn now_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid timespec to fill; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn gettid() -> u32 {
    // SAFETY: gettid has no arguments and cannot fail.
    unsafe { libc::syscall(libc::SYS_gettid) as u32 }
}

/// This thread's slot, taken on its first call and given back when it ends.
struct Mine(Option<usize>);

impl Drop for Mine {
    fn drop(&mut self) {
        if let (Some(i), Some(p)) = (self.0, page()) {
            p.slots[i].active.store(0, Ordering::Release);
            p.slots[i].tid.store(0, Ordering::Release);
            if let Ok(mut f) = FREE.lock() {
                f.push(i);
            }
        }
    }
}

thread_local! {
    static MINE: RefCell<Mine> = const { RefCell::new(Mine(None)) };
}

/// An open in-process call; closing it (drop) ends the record.
pub struct InCall(Option<usize>);

impl Drop for InCall {
    fn drop(&mut self) {
        if let (Some(i), Some(p)) = (self.0, page()) {
            p.slots[i].active.store(0, Ordering::Release);
        }
    }
}

/// Records that this thread calls into the library at `path` until the guard drops.
pub fn enter(path: &Path) -> InCall {
    let Some(p) = page() else { return InCall(None) };
    let slot = MINE.try_with(|m| {
        let mut m = m.borrow_mut();
        if m.0.is_none() {
            m.0 = FREE.lock().ok().and_then(|mut f| f.pop());
            if let Some(i) = m.0 {
                p.slots[i].tid.store(gettid(), Ordering::Release);
            }
        }
        m.0
    });
    let Ok(Some(i)) = slot else { return InCall(None) };
    let s = &p.slots[i];
    let b = path.as_os_str().as_encoded_bytes();
    let n = b.len().min(PATH_MAX);
    for (d, &c) in s.path.iter().zip(&b[..n]) {
        d.store(c, Ordering::Relaxed);
    }
    s.path_len.store(n as u32, Ordering::Release);
    s.start.store(now_ns(), Ordering::Relaxed);
    s.active.store(1, Ordering::Release);
    InCall(Some(i))
}

fn slot_path(s: &Slot) -> PathBuf {
    use std::os::unix::ffi::OsStrExt;
    let n = (s.path_len.load(Ordering::Acquire) as usize).min(PATH_MAX);
    let b: Vec<u8> = s.path[..n].iter().map(|c| c.load(Ordering::Relaxed)).collect();
    PathBuf::from(std::ffi::OsStr::from_bytes(&b))
}

/// The calls open for longer than `limit` now: (library, how long).
pub fn hung(limit: Duration) -> Vec<(PathBuf, Duration)> {
    let Some(p) = page() else { return Vec::new() };
    let now = now_ns();
    p.slots
        .iter()
        .filter(|s| s.active.load(Ordering::Acquire) == 1)
        .map(|s| (slot_path(s), Duration::from_nanos(now.saturating_sub(s.start.load(Ordering::Relaxed)))))
        .filter(|(_, d)| *d > limit)
        .collect()
}

/// What the previous run's record says: the libraries that crashed or hung the daemon, and why.
fn blame(p: &Page, limit: Duration) -> Vec<(PathBuf, String)> {
    if p.magic.load(Ordering::Relaxed) != MAGIC {
        return Vec::new();
    }
    let (tid, sig, at) =
        (p.died_tid.load(Ordering::Relaxed), p.died_signal.load(Ordering::Relaxed), p.died_at.load(Ordering::Relaxed));
    if at == 0 {
        return Vec::new();
    }
    let mut out = Vec::new();
    for s in p.slots.iter().filter(|s| s.active.load(Ordering::Relaxed) == 1) {
        let open = Duration::from_nanos(at.saturating_sub(s.start.load(Ordering::Relaxed)));
        let why = if s.tid.load(Ordering::Relaxed) == tid {
            format!("the daemon died of signal {sig} ({}) inside a call into it", signal_name(sig))
        } else if open > limit {
            format!(
                "the daemon was stopped by signal {sig} ({}) while one call into it had run for {:.1} s",
                signal_name(sig),
                open.as_secs_f64()
            )
        } else {
            continue;
        };
        out.push((slot_path(s), why));
    }
    out
}

pub fn signal_name(sig: u32) -> &'static str {
    match sig as i32 {
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGBUS => "SIGBUS",
        libc::SIGILL => "SIGILL",
        libc::SIGFPE => "SIGFPE",
        libc::SIGABRT => "SIGABRT",
        libc::SIGSYS => "SIGSYS",
        libc::SIGTRAP => "SIGTRAP",
        libc::SIGKILL => "SIGKILL",
        libc::SIGTERM => "SIGTERM",
        libc::SIGXCPU => "SIGXCPU",
        _ => "a signal",
    }
}

const FATAL: [i32; 7] =
    [libc::SIGSEGV, libc::SIGBUS, libc::SIGILL, libc::SIGFPE, libc::SIGABRT, libc::SIGSYS, libc::SIGTRAP];

/// The handlers that were installed before ours, by signal number.
static OLD: [AtomicPtr<libc::sigaction>; 32] = [const { AtomicPtr::new(std::ptr::null_mut()) }; 32];

extern "C" fn on_fatal(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // Only async-signal-safe work: atomic stores into the mapping, gettid, clock_gettime,
    // sigaction, raise.
    if let Some(p) = page() {
        if p.died_at.load(Ordering::Relaxed) == 0 {
            p.died_tid.store(gettid(), Ordering::Relaxed);
            p.died_signal.store(sig as u32, Ordering::Relaxed);
            p.died_at.store(now_ns(), Ordering::Release);
        }
    }
    let old = OLD.get(sig as usize).map_or(std::ptr::null_mut(), |o| o.load(Ordering::Acquire));
    if old.is_null() {
        return;
    }
    // SAFETY: `old` is a leaked copy of the handler installed before ours; putting it back
    // and letting the signal happen again (a fault re-executes its instruction; a sent signal
    // is raised again) gives the signal the treatment it had without us (Rust's stack-overflow
    // report, a core dump).
    unsafe {
        libc::sigaction(sig, old, std::ptr::null_mut());
        let sent = !info.is_null() && (*info).si_code <= 0;
        if sent {
            libc::raise(sig);
        }
    }
    let _ = ctx;
}

/// Starts recording into `file` (created if needed) and installs the fatal-signal handlers.
/// Returns what the previous run's record blames: each library that crashed the daemon, or
/// was inside one call for longer than `limit` when the daemon was killed, with why.
pub fn install(file: &Path, limit: Duration) -> std::io::Result<Vec<(PathBuf, String)>> {
    if !PAGE.load(Ordering::Acquire).is_null() {
        return Ok(Vec::new());
    }
    if let Some(d) = file.parent() {
        std::fs::create_dir_all(d)?;
    }
    // One record per daemon: a second daemon of the same user (another socket) takes the
    // next free file.
    let mut f = None;
    for i in 0..8 {
        let name = if i == 0 { file.to_owned() } else { file.with_extension(i.to_string()) };
        let g = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&name)?;
        if g.try_lock().is_ok() {
            f = Some(g);
            break;
        }
    }
    let Some(f) = f else { return Err(std::io::Error::other("every crash record is in use by another daemon")) };
    let f = Box::leak(Box::new(f));
    let size = std::mem::size_of::<Page>() as u64;
    if f.metadata()?.len() != size {
        f.set_len(0)?;
        f.set_len(size)?;
    }
    // SAFETY: a file of exactly one `Page` that this process opened; others may write it only
    // as another inferd would (the state directory is the daemon's), and every field is an
    // atomic valid for any bytes.
    let map = unsafe { memmap2::MmapOptions::new().len(size as usize).map_mut(&*f) }?;
    let map = Box::leak(Box::new(map));
    let p = map.as_mut_ptr().cast::<Page>();
    // SAFETY: the mapping holds a whole `Page`, page-aligned.
    let page = unsafe { &*p };
    let blamed = blame(page, limit);
    page.died_tid.store(0, Ordering::Relaxed);
    page.died_signal.store(0, Ordering::Relaxed);
    page.died_at.store(0, Ordering::Relaxed);
    for s in &page.slots {
        s.active.store(0, Ordering::Relaxed);
        s.tid.store(0, Ordering::Relaxed);
    }
    page.magic.store(MAGIC, Ordering::Release);
    if let Ok(mut free) = FREE.lock() {
        *free = (0..SLOTS).rev().collect();
    }
    PAGE.store(p, Ordering::Release);
    for sig in FATAL {
        // SAFETY: a zeroed sigaction is a valid value to fill; our handler is an
        // `extern "C"` function of the SA_SIGINFO shape; the previous handler is kept (leaked,
        // so the signal handler may read it) and restored by the handler itself.
        unsafe {
            let mut new: libc::sigaction = std::mem::zeroed();
            new.sa_sigaction = on_fatal as *const () as usize;
            new.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
            libc::sigemptyset(&mut new.sa_mask);
            let mut prev: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(sig, &new, &mut prev) == 0 {
                OLD[sig as usize].store(Box::leak(Box::new(prev)), Ordering::Release);
            }
        }
    }
    Ok(blamed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_record_blames_the_call_that_crashed_and_the_one_that_hung_and_nobody_else() {
        // SAFETY: zeroed atomics are valid.
        let page: Box<Page> = unsafe { Box::new(std::mem::zeroed()) };
        page.magic.store(MAGIC, Ordering::Relaxed);
        let set = |i: usize, tid: u32, start: u64, path: &str| {
            let s = &page.slots[i];
            s.tid.store(tid, Ordering::Relaxed);
            s.active.store(1, Ordering::Relaxed);
            s.start.store(start, Ordering::Relaxed);
            for (d, c) in s.path.iter().zip(path.bytes()) {
                d.store(c, Ordering::Relaxed);
            }
            s.path_len.store(path.len() as u32, Ordering::Relaxed);
        };
        let sec = 1_000_000_000u64;
        set(0, 11, 100 * sec, "/p/crash.so");
        set(1, 12, 10 * sec, "/p/hang.so");
        set(2, 13, 100 * sec, "/p/busy.so");
        // Killed without a signal we saw: nobody is blamed.
        assert!(blame(&page, Duration::from_secs(2)).is_empty());
        page.died_tid.store(11, Ordering::Relaxed);
        page.died_signal.store(libc::SIGSEGV as u32, Ordering::Relaxed);
        page.died_at.store(100 * sec + sec / 2, Ordering::Relaxed);
        let b = blame(&page, Duration::from_secs(2));
        assert_eq!(b.len(), 2, "{b:?}");
        assert_eq!(b[0].0, PathBuf::from("/p/crash.so"));
        assert!(b[0].1.contains("(SIGSEGV) inside a call"), "{}", b[0].1);
        assert_eq!(b[1].0, PathBuf::from("/p/hang.so"));
        assert!(b[1].1.contains("90.5 s"), "{}", b[1].1);
    }
}
