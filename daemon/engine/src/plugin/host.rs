//! The host side of the plugin ABI: the callback table every plugin receives, and the context of
//! one call that the callbacks reach through the `inferd_call` pointer.
//!
//! A callback never trusts its arguments: handles are looked up (a stale or foreign one is
//! `ERR_INVALID`), output pointers are checked for null, and panics are caught (unwinding into
//! plugin code would abort the daemon).

#![allow(unsafe_code)]

use inferd_plugin_api::abi;
use std::ffi::{c_char, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::OnceLock;

/// A callback's failure: an ABI status and why.
#[derive(Debug)]
pub struct HostErr {
    pub status: i32,
    pub message: String,
}

impl HostErr {
    pub fn invalid(message: impl Into<String>) -> HostErr {
        HostErr { status: abi::ERR_INVALID, message: message.into() }
    }
}

/// What the callbacks act on during one call into a plugin.
pub trait HostSide {
    fn log(&mut self, level: i32, message: &str);
    fn seq_create(&mut self, role: u32) -> Result<abi::Seq, HostErr>;
    fn seq_fork(&mut self, seq: abi::Seq) -> Result<abi::Seq, HostErr>;
    fn seq_truncate(&mut self, seq: abi::Seq, len: u32) -> Result<(), HostErr>;
    fn seq_free(&mut self, seq: abi::Seq) -> Result<(), HostErr>;
    fn seq_tokens(&mut self, seq: abi::Seq) -> Result<Vec<u32>, HostErr>;
    fn emit(&mut self, choice: u32, token: i32, logprob: f32) -> Result<(), HostErr>;
    fn finish(&mut self, choice: u32, reason: u32) -> Result<(), HostErr>;
    fn random(&mut self, stream: u64, counter: u64) -> [u32; 4];
    fn report(&mut self, key: &str, value: f64) -> Result<(), HostErr>;
    /// The bytes token `token` stands for (ABI 1.1).
    fn token_bytes(&mut self, token: i32) -> Result<Vec<u8>, HostErr>;
    /// `emit` with the token's most probable alternatives (ABI 1.2).
    fn emit_top(&mut self, choice: u32, token: i32, logprob: f32, top: &[(i32, f32)]) -> Result<(), HostErr>;
}

/// The context behind an `inferd_call` pointer.
pub struct CallCtx<'a> {
    pub side: &'a mut dyn HostSide,
    /// The plugin's message (`set_error`).
    pub error: Option<String>,
    /// Why a callback refused, kept to explain a failure the plugin did not describe.
    pub host_error: Option<String>,
}

impl<'a> CallCtx<'a> {
    pub fn new(side: &'a mut dyn HostSide) -> Self {
        CallCtx { side, error: None, host_error: None }
    }

    /// The pointer handed to the plugin for this call.
    pub fn as_call(&mut self) -> *mut abi::Call {
        (self as *mut CallCtx<'a>).cast()
    }

    /// The error message for a failed call with `status`.
    pub fn message(&mut self, status: i32) -> String {
        match (self.error.take(), self.host_error.take()) {
            (Some(e), Some(h)) if !e.contains(&h) => format!("{e} ({h})"),
            (Some(e), _) => e,
            (None, Some(h)) => h,
            (None, None) => format!("failed with status {status} and no message"),
        }
    }
}

/// Runs `f` on the call's context; panics and errors become statuses.
///
/// # Safety
/// `call` is null or the pointer of a live [`CallCtx`] (the host passes it only during a call).
unsafe fn with_ctx(call: *mut abi::Call, f: impl FnOnce(&mut CallCtx<'_>) -> Result<(), HostErr>) -> i32 {
    if call.is_null() {
        return abi::ERR_INVALID;
    }
    // SAFETY: the caller's contract; the context outlives the plugin call that received it.
    let ctx = unsafe { &mut *call.cast::<CallCtx<'_>>() };
    match catch_unwind(AssertUnwindSafe(|| f(ctx))) {
        Ok(Ok(())) => abi::OK,
        Ok(Err(e)) => {
            ctx.host_error = Some(e.message);
            e.status
        }
        Err(_) => {
            ctx.host_error = Some("internal error in a host callback".into());
            abi::ERR
        }
    }
}

/// # Safety
/// `p` is null or a NUL-terminated string.
unsafe fn text(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: the caller's contract.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

unsafe extern "C" fn log(call: *mut abi::Call, level: i32, message: *const c_char) {
    // SAFETY: the plugin passes a string valid for the call.
    let m = unsafe { text(message) };
    if call.is_null() {
        // Outside a call (the entry point): no request to attribute it to.
        eprintln!("inferd: plugin: {m}");
        return;
    }
    // SAFETY: `call` is the context of the current call (ABI rule).
    unsafe {
        with_ctx(call, |c| {
            c.side.log(level, &m);
            Ok(())
        })
    };
}

unsafe extern "C" fn set_error(call: *mut abi::Call, message: *const c_char) {
    // SAFETY: as in `log`.
    let m = unsafe { text(message) };
    // SAFETY: as in `log`.
    unsafe {
        with_ctx(call, |c| {
            c.error = Some(m);
            Ok(())
        })
    };
}

/// Writes `v` through a plugin's output pointer.
///
/// # Safety
/// `out` is null or valid for writing a `T`.
unsafe fn put<T>(out: *mut T, v: T) -> Result<(), HostErr> {
    if out.is_null() {
        return Err(HostErr::invalid("null output pointer"));
    }
    // SAFETY: the caller's contract.
    unsafe { out.write(v) };
    Ok(())
}

unsafe extern "C" fn seq_create(call: *mut abi::Call, role: u32, out: *mut abi::Seq) -> i32 {
    // SAFETY: as in `log`; `out` is the plugin's output pointer for this call.
    unsafe { with_ctx(call, |c| put(out, c.side.seq_create(role)?)) }
}

unsafe extern "C" fn seq_fork(call: *mut abi::Call, seq: abi::Seq, out: *mut abi::Seq) -> i32 {
    // SAFETY: as in `seq_create`.
    unsafe { with_ctx(call, |c| put(out, c.side.seq_fork(seq)?)) }
}

unsafe extern "C" fn seq_truncate(call: *mut abi::Call, seq: abi::Seq, len: u32) -> i32 {
    // SAFETY: as in `log`.
    unsafe { with_ctx(call, |c| c.side.seq_truncate(seq, len)) }
}

unsafe extern "C" fn seq_free(call: *mut abi::Call, seq: abi::Seq) -> i32 {
    // SAFETY: as in `log`.
    unsafe { with_ctx(call, |c| c.side.seq_free(seq)) }
}

unsafe extern "C" fn seq_len(call: *mut abi::Call, seq: abi::Seq, out: *mut u32) -> i32 {
    // SAFETY: as in `seq_create`.
    unsafe { with_ctx(call, |c| put(out, c.side.seq_tokens(seq)?.len() as u32)) }
}

unsafe extern "C" fn seq_tokens(call: *mut abi::Call, seq: abi::Seq, buf: *mut i32, cap: u32, len: *mut u32) -> i32 {
    // SAFETY: as in `seq_create`; `buf` holds `cap` tokens (checked non-null when cap > 0).
    unsafe {
        with_ctx(call, |c| {
            let toks = c.side.seq_tokens(seq)?;
            let n = toks.len().min(cap as usize);
            if n > 0 {
                if buf.is_null() {
                    return Err(HostErr::invalid("null token buffer"));
                }
                for (i, &t) in toks[..n].iter().enumerate() {
                    buf.add(i).write(t as i32);
                }
            }
            put(len, toks.len() as u32)
        })
    }
}

unsafe extern "C" fn emit(call: *mut abi::Call, choice: u32, token: i32, logprob: f32) -> i32 {
    // SAFETY: as in `log`.
    unsafe { with_ctx(call, |c| c.side.emit(choice, token, logprob)) }
}

unsafe extern "C" fn finish(call: *mut abi::Call, choice: u32, reason: u32) -> i32 {
    // SAFETY: as in `log`.
    unsafe { with_ctx(call, |c| c.side.finish(choice, reason)) }
}

unsafe extern "C" fn random(call: *mut abi::Call, stream: u64, counter: u64, out: *mut u32) -> i32 {
    // SAFETY: as in `seq_create`; `out` holds 4 words (ABI).
    unsafe {
        with_ctx(call, |c| {
            if out.is_null() {
                return Err(HostErr::invalid("null output pointer"));
            }
            for (i, w) in c.side.random(stream, counter).into_iter().enumerate() {
                out.add(i).write(w);
            }
            Ok(())
        })
    }
}

unsafe extern "C" fn report(call: *mut abi::Call, key: *const c_char, value: f64) -> i32 {
    // SAFETY: as in `log`.
    let k = unsafe { text(key) };
    // SAFETY: as in `log`.
    unsafe { with_ctx(call, |c| c.side.report(&k, value)) }
}

unsafe extern "C" fn token_bytes(call: *mut abi::Call, token: i32, buf: *mut u8, cap: u32, len: *mut u32) -> i32 {
    // SAFETY: as in `seq_create`; `buf` holds `cap` bytes (checked non-null when cap > 0).
    unsafe {
        with_ctx(call, |c| {
            let bytes = c.side.token_bytes(token)?;
            let n = bytes.len().min(cap as usize);
            if n > 0 {
                if buf.is_null() {
                    return Err(HostErr::invalid("null byte buffer"));
                }
                std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf, n);
            }
            put(len, bytes.len() as u32)
        })
    }
}

unsafe extern "C" fn emit_top(
    call: *mut abi::Call,
    choice: u32,
    token: i32,
    logprob: f32,
    tokens: *const i32,
    logprobs: *const f32,
    n: u32,
) -> i32 {
    // SAFETY: as in `seq_create`; `tokens` and `logprobs` hold `n` values each (checked non-null
    // when n > 0), and `n` is bounded before anything is read.
    unsafe {
        with_ctx(call, |c| {
            if n > 64 {
                return Err(HostErr::invalid(format!("{n} alternatives (at most 64)")));
            }
            if n > 0 && (tokens.is_null() || logprobs.is_null()) {
                return Err(HostErr::invalid("null alternatives"));
            }
            let top: Vec<(i32, f32)> = (0..n as usize).map(|i| (*tokens.add(i), *logprobs.add(i))).collect();
            c.side.emit_top(choice, token, logprob, &top)
        })
    }
}

/// The host's info struct and callback table, built once and never freed.
struct Tables {
    info: abi::HostInfo,
    _api: Box<abi::HostApi>,
}
// SAFETY: immutable after construction; the raw pointers point into the leaked tables and to
// static strings.
unsafe impl Send for Tables {}
// SAFETY: as above.
unsafe impl Sync for Tables {}

static TABLES: OnceLock<Tables> = OnceLock::new();

/// The `inferd_host_info` every plugin entry point receives.
pub fn host_info() -> *const abi::HostInfo {
    let t = TABLES.get_or_init(|| {
        let api = Box::new(abi::HostApi {
            header: abi::Header::new::<abi::HostApi>(abi::TYPE_HOST_API),
            log: Some(log),
            set_error: Some(set_error),
            seq_create: Some(seq_create),
            seq_fork: Some(seq_fork),
            seq_truncate: Some(seq_truncate),
            seq_free: Some(seq_free),
            seq_len: Some(seq_len),
            seq_tokens: Some(seq_tokens),
            emit: Some(emit),
            finish: Some(finish),
            random: Some(random),
            report: Some(report),
            token_bytes: Some(token_bytes),
            emit_top: Some(emit_top),
        });
        let info = abi::HostInfo {
            header: abi::Header::new::<abi::HostInfo>(abi::TYPE_HOST_INFO),
            abi_major: abi::ABI_MAJOR,
            abi_minor: abi::ABI_MINOR,
            host_version: concat!("inferd ", env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast(),
            api: &*api,
        };
        Tables { info, _api: api }
    });
    &t.info
}
