//! The Rust SDK: implement [`Strategy`] and list it in [`export_plugin!`](crate::export_plugin).
//!
//! The SDK writes the C entry point and the five C functions of each strategy. Every one of them
//! catches panics (a panic crossing `extern "C"` would abort the daemon) and turns them, like
//! `Err` values, into the call's error message; the host then fails that request alone.

use crate::abi;
use crate::params::Params;
use crate::sampling::LogSoftmax;
use std::ffi::{c_char, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::OnceLock;

/// The host's callback table, stored by the entry point (a plugin is loaded once per host).
static HOST_API: AtomicPtr<abi::HostApi> = AtomicPtr::new(std::ptr::null_mut());

/// What a strategy learns about a request (see `inferd_session_init`).
#[derive(Clone, Debug)]
pub struct SessionInit {
    pub params: String,
    /// The target sequence holding the prompt (0 in `validate`).
    pub seq: abi::Seq,
    pub prompt_len: u32,
    pub vocab_size: u32,
    pub max_tokens: u32,
    pub n: u32,
    pub eos: Vec<u32>,
    /// Bit `1 << abi::ROLE_*` set for each role `seq_create` can make.
    pub roles: u32,
    pub seed: u64,
    /// The client wants log-probabilities; otherwise `emit` may get NaN.
    pub logprobs: bool,
    /// The request has a response format: its target rows arrive masked (ABI 1.1).
    pub constrained: bool,
    /// Alternatives wanted per token: every token then goes out through [`Host::emit_top`]
    /// (ABI 1.2; 0 from an older host).
    pub top_logprobs: u32,
}

/// What the client wants reported with each token, from [`SessionInit`]: its log-probability
/// and the `top` most probable alternatives, read from the row of logits it was chosen from
/// (see [`LogSoftmax`]). Strategies emit through it so that each reports the same numbers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Logprobs {
    pub each: bool,
    pub top: u32,
}

/// A token's log-probability (NaN when not wanted) and its alternatives (empty when none are
/// wanted), as [`Logprobs::score`] reads them.
pub type Scored = (f32, Vec<(u32, f32)>);

impl Logprobs {
    pub fn of(init: &SessionInit) -> Logprobs {
        Logprobs { each: init.logprobs || init.top_logprobs > 0, top: init.top_logprobs }
    }

    /// What to report with `token` chosen from `row`.
    pub fn score(self, row: &[f32], token: u32) -> Scored {
        if !self.each || token as usize >= row.len() {
            return (f32::NAN, Vec::new());
        }
        let ls = LogSoftmax::of(row);
        (ls.at(token as usize), ls.top(self.top as usize))
    }

    /// Emits `token` with what [`score`](Self::score) read.
    pub fn send(self, host: &Host, choice: u32, token: u32, scored: &Scored) -> Result<(), String> {
        if self.top > 0 {
            host.emit_top(choice, token, scored.0, &scored.1)
        } else {
            host.emit(choice, token, scored.0)
        }
    }

    /// Emits `token`, chosen from `row`.
    pub fn emit(self, host: &Host, choice: u32, token: u32, row: &[f32]) -> Result<(), String> {
        self.send(host, choice, token, &self.score(row, token))
    }
}

/// One sequence's part of a plan: append `tokens`, then return logits for the last `n_logits`
/// positions of what ran.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanItem {
    pub seq: abi::Seq,
    pub tokens: Vec<u32>,
    pub n_logits: u32,
}

/// What a session wants next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Plan {
    Run(Vec<PlanItem>),
    /// Every choice is finished.
    Done,
}

/// A decoding strategy. One value of the implementing type is one request's session.
pub trait Strategy: Sized + Send + 'static {
    /// `[a-z0-9_-]{1,64}`, unique among loaded strategies.
    const NAME: &'static CStr;
    const DESCRIPTION: &'static CStr;
    /// JSON object documenting the parameters.
    const PARAMS_DOC: &'static CStr = c"{}";
    /// `abi::STRATEGY_*` flags.
    const FLAGS: u32 = 0;

    /// Accepts or rejects a request before anything is scheduled (no sequence callbacks).
    fn validate(host: &Host, init: &SessionInit) -> Result<(), String>;
    fn create(host: &Host, init: &SessionInit) -> Result<Self, String>;
    /// What to run next; must not change anything the host can see.
    fn plan(&mut self, host: &Host) -> Result<Plan, String>;
    /// The logits of the last plan, `rows[i]` for item `i` (`n_logits * vocab` floats).
    fn observe(&mut self, host: &Host, rows: &[&[f32]]) -> Result<(), String>;
}

/// The host's services during one call.
pub struct Host {
    call: *mut abi::Call,
    api: &'static abi::HostApi,
}

impl Host {
    fn new(call: *mut abi::Call) -> Option<Host> {
        let api = HOST_API.load(Ordering::Acquire);
        // SAFETY: set once by `entry` from the host's table, which lives as long as the host.
        (!api.is_null()).then(|| Host { call, api: unsafe { &*api } })
    }

    fn status(&self, what: &str, s: i32) -> Result<(), String> {
        match s {
            abi::OK => Ok(()),
            abi::ERR_NO_MEMORY => Err(format!("{what}: out of KV cache blocks")),
            abi::ERR_INVALID => Err(format!("{what}: invalid argument")),
            _ => Err(format!("{what} failed (status {s})")),
        }
    }

    pub fn log(&self, level: i32, message: &str) {
        let Ok(m) = CString::new(message.replace('\0', " ")) else { return };
        if let Some(f) = self.api.log {
            // SAFETY: a host callback called with the call it gave us, during that call.
            unsafe { f(self.call, level, m.as_ptr()) }
        }
    }

    fn set_error(&self, message: &str) {
        let Ok(m) = CString::new(message.replace('\0', " ")) else { return };
        if let Some(f) = self.api.set_error {
            // SAFETY: as in `log`.
            unsafe { f(self.call, m.as_ptr()) }
        }
    }

    pub fn seq_create(&self, role: u32) -> Result<abi::Seq, String> {
        let f = self.api.seq_create.ok_or("host lacks seq_create")?;
        let mut out = 0;
        // SAFETY: as in `log`; `out` is a valid pointer.
        self.status("seq_create", unsafe { f(self.call, role, &mut out) })?;
        Ok(out)
    }

    pub fn seq_fork(&self, seq: abi::Seq) -> Result<abi::Seq, String> {
        let f = self.api.seq_fork.ok_or("host lacks seq_fork")?;
        let mut out = 0;
        // SAFETY: as in `seq_create`.
        self.status("seq_fork", unsafe { f(self.call, seq, &mut out) })?;
        Ok(out)
    }

    pub fn seq_truncate(&self, seq: abi::Seq, len: u32) -> Result<(), String> {
        let f = self.api.seq_truncate.ok_or("host lacks seq_truncate")?;
        // SAFETY: as in `log`.
        self.status("seq_truncate", unsafe { f(self.call, seq, len) })
    }

    pub fn seq_free(&self, seq: abi::Seq) -> Result<(), String> {
        let f = self.api.seq_free.ok_or("host lacks seq_free")?;
        // SAFETY: as in `log`.
        self.status("seq_free", unsafe { f(self.call, seq) })
    }

    pub fn seq_len(&self, seq: abi::Seq) -> Result<u32, String> {
        let f = self.api.seq_len.ok_or("host lacks seq_len")?;
        let mut out = 0;
        // SAFETY: as in `seq_create`.
        self.status("seq_len", unsafe { f(self.call, seq, &mut out) })?;
        Ok(out)
    }

    pub fn seq_tokens(&self, seq: abi::Seq) -> Result<Vec<u32>, String> {
        let f = self.api.seq_tokens.ok_or("host lacks seq_tokens")?;
        let mut buf = vec![0i32; self.seq_len(seq)? as usize];
        let mut len = 0;
        // SAFETY: as in `log`; `buf` holds `buf.len()` tokens.
        self.status("seq_tokens", unsafe { f(self.call, seq, buf.as_mut_ptr(), buf.len() as u32, &mut len) })?;
        buf.truncate(len as usize);
        Ok(buf.into_iter().map(|t| t as u32).collect())
    }

    pub fn emit(&self, choice: u32, token: u32, logprob: f32) -> Result<(), String> {
        let f = self.api.emit.ok_or("host lacks emit")?;
        // SAFETY: as in `log`.
        self.status("emit", unsafe { f(self.call, choice, token as i32, logprob) })
    }

    /// [`emit`](Self::emit) with the most probable tokens at that position and their
    /// log-probabilities, most probable first: how every token goes out when
    /// [`SessionInit::top_logprobs`] is above 0 (ABI 1.2, so `Err` from an older host, which
    /// never asks for them).
    pub fn emit_top(&self, choice: u32, token: u32, logprob: f32, top: &[(u32, f32)]) -> Result<(), String> {
        let end = std::mem::offset_of!(abi::HostApi, emit_top) + std::mem::size_of::<usize>();
        if (self.api.header.size as usize) < end {
            return Err("the host is older than ABI 1.2 and has no emit_top".into());
        }
        let f = self.api.emit_top.ok_or("host lacks emit_top")?;
        let ids: Vec<i32> = top.iter().map(|&(t, _)| t as i32).collect();
        let lps: Vec<f32> = top.iter().map(|&(_, lp)| lp).collect();
        // SAFETY: as in `log`; both arrays hold `top.len()` values; the size check above means
        // the host's table has this field.
        self.status("emit_top", unsafe {
            f(self.call, choice, token as i32, logprob, ids.as_ptr(), lps.as_ptr(), top.len() as u32)
        })
    }

    pub fn finish(&self, choice: u32, reason: u32) -> Result<(), String> {
        let f = self.api.finish.ok_or("host lacks finish")?;
        // SAFETY: as in `log`.
        self.status("finish", unsafe { f(self.call, choice, reason) })
    }

    /// 128 random bits for `(stream, counter)` under the request's seed.
    pub fn random(&self, stream: u64, counter: u64) -> Result<[u32; 4], String> {
        let f = self.api.random.ok_or("host lacks random")?;
        let mut out = [0u32; 4];
        // SAFETY: as in `log`; `out` holds 4 words.
        self.status("random", unsafe { f(self.call, stream, counter, out.as_mut_ptr()) })?;
        Ok(out)
    }

    /// Adds `value` to the request's statistic `key` (`[a-z0-9_]{1,64}`).
    pub fn report(&self, key: &str, value: f64) -> Result<(), String> {
        let f = self.api.report.ok_or("host lacks report")?;
        let k = CString::new(key).map_err(|_| "report key contains NUL")?;
        // SAFETY: as in `log`.
        self.status("report", unsafe { f(self.call, k.as_ptr(), value) })
    }

    /// The bytes token `token` stands for (a special token's text); ABI 1.1, so `Err` from a
    /// 1.0 host.
    pub fn token_bytes(&self, token: u32) -> Result<Vec<u8>, String> {
        let end = std::mem::offset_of!(abi::HostApi, token_bytes) + std::mem::size_of::<usize>();
        if (self.api.header.size as usize) < end {
            return Err("the host is older than ABI 1.1 and has no token_bytes".into());
        }
        let f = self.api.token_bytes.ok_or("host lacks token_bytes")?;
        let mut buf = vec![0u8; 64];
        loop {
            let mut len = 0;
            // SAFETY: as in `log`; `buf` holds `buf.len()` bytes; the size check above means
            // the host's table has this field.
            self.status("token_bytes", unsafe {
                f(self.call, token as i32, buf.as_mut_ptr(), buf.len() as u32, &mut len)
            })?;
            if (len as usize) <= buf.len() {
                buf.truncate(len as usize);
                return Ok(buf);
            }
            buf.resize(len as usize, 0);
        }
    }

    /// A uniform number in [0, 1) with 53 random bits, for `(stream, counter)`.
    pub fn uniform(&self, stream: u64, counter: u64) -> Result<f64, String> {
        let r = self.random(stream, counter)?;
        let bits = (u64::from(r[0]) << 21) ^ u64::from(r[1] >> 11);
        Ok(bits as f64 / (1u64 << 53) as f64)
    }
}

/// Runs `f` with panics caught; an `Err` or a panic becomes the call's error message.
fn guard(call: *mut abi::Call, f: impl FnOnce(&Host) -> Result<(), String>) -> i32 {
    let Some(host) = Host::new(call) else { return abi::ERR };
    match catch_unwind(AssertUnwindSafe(|| f(&host))) {
        Ok(Ok(())) => abi::OK,
        Ok(Err(msg)) => {
            host.set_error(&msg);
            abi::ERR
        }
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            host.set_error(&format!("the plugin panicked: {what}"));
            abi::ERR
        }
    }
}

/// # Safety
/// `p` is null or a NUL-terminated string valid for the call.
unsafe fn string(p: *const c_char, what: &str) -> Result<String, String> {
    if p.is_null() {
        return Err(format!("{what} is null"));
    }
    // SAFETY: the caller's contract.
    let s = unsafe { CStr::from_ptr(p) };
    s.to_str().map(str::to_owned).map_err(|_| format!("{what} is not UTF-8"))
}

/// # Safety
/// `init` is null or points to a host session-init struct valid for the call.
unsafe fn read_init(init: *const abi::SessionInit) -> Result<SessionInit, String> {
    if init.is_null() {
        return Err("session init is null".into());
    }
    // SAFETY: the caller's contract; the header is read first to check the size.
    let header = unsafe { (*init).header };
    // ABI 1.0's struct ends at `constrained`; the fields after it are read only when present.
    let v1_0 = std::mem::offset_of!(abi::SessionInit, constrained);
    if header.type_ != abi::TYPE_SESSION_INIT || (header.size as usize) < v1_0 {
        return Err("session init has the wrong type or size".into());
    }
    // The bytes the host wrote, over a zeroed struct: fields a 1.0 host does not know read as 0
    // (zero is a valid value of every field: integers and pointers).
    let mut copy = std::mem::MaybeUninit::<abi::SessionInit>::zeroed();
    let n = (header.size as usize).min(std::mem::size_of::<abi::SessionInit>());
    // SAFETY: the host's struct is `header.size` bytes long and `copy` holds at least `n`;
    // they do not overlap.
    unsafe { std::ptr::copy_nonoverlapping(init.cast::<u8>(), copy.as_mut_ptr().cast::<u8>(), n) };
    // SAFETY: all-zero bytes are a valid SessionInit, and the copy wrote valid field values.
    let i = unsafe { copy.assume_init() };
    let eos = if i.eos.is_null() || i.n_eos == 0 {
        Vec::new()
    } else {
        // SAFETY: the host passes `n_eos` tokens at `eos`.
        unsafe { std::slice::from_raw_parts(i.eos, i.n_eos as usize) }.iter().map(|&t| t as u32).collect()
    };
    Ok(SessionInit {
        // SAFETY: a host string valid for the call.
        params: unsafe { string(i.params_json, "params_json") }?,
        seq: i.seq,
        prompt_len: i.prompt_len,
        vocab_size: i.vocab_size,
        max_tokens: i.max_tokens,
        n: i.n,
        eos,
        roles: i.roles,
        seed: i.seed,
        logprobs: i.logprobs != 0,
        constrained: i.constrained != 0,
        top_logprobs: i.top_logprobs,
    })
}

/// A session as the plugin keeps it: the strategy's state and the memory of its last plan.
struct SessionBox<S> {
    state: S,
    tokens: Vec<Vec<i32>>,
    items: Vec<abi::PlanItem>,
}

unsafe extern "C" fn validate<S: Strategy>(call: *mut abi::Call, init: *const abi::SessionInit) -> i32 {
    guard(call, |host| {
        // SAFETY: the host passes a valid init for the duration of the call.
        let init = unsafe { read_init(init) }?;
        S::validate(host, &init)
    })
}

unsafe extern "C" fn create<S: Strategy>(
    call: *mut abi::Call,
    init: *const abi::SessionInit,
    out: *mut *mut c_void,
) -> i32 {
    guard(call, |host| {
        if out.is_null() {
            return Err("create: null session pointer".into());
        }
        // SAFETY: as in `validate`.
        let init = unsafe { read_init(init) }?;
        let state = S::create(host, &init)?;
        let b = Box::new(SessionBox { state, tokens: Vec::new(), items: Vec::new() });
        // SAFETY: `out` is a valid pointer (checked non-null; the host's contract).
        unsafe { *out = Box::into_raw(b).cast() };
        Ok(())
    })
}

unsafe extern "C" fn plan<S: Strategy>(call: *mut abi::Call, session: *mut c_void, out: *mut abi::Plan) -> i32 {
    guard(call, |host| {
        if session.is_null() || out.is_null() {
            return Err("plan: null pointer".into());
        }
        // SAFETY: `session` came from `create::<S>` and is not used concurrently (ABI rule).
        let b = unsafe { &mut *session.cast::<SessionBox<S>>() };
        // SAFETY: the host's plan struct, valid for the call; its size is checked before writing.
        let size = unsafe { (*out).header.size } as usize;
        if size < std::mem::size_of::<abi::Plan>() {
            return Err("plan struct too small".into());
        }
        let (items, done) = match b.state.plan(host)? {
            Plan::Done => (Vec::new(), true),
            Plan::Run(items) => (items, false),
        };
        b.tokens = items.iter().map(|it| it.tokens.iter().map(|&t| t as i32).collect()).collect();
        b.items = items
            .iter()
            .zip(&b.tokens)
            .map(|(it, t)| abi::PlanItem {
                seq: it.seq,
                tokens: t.as_ptr(),
                n_tokens: t.len() as u32,
                n_logits: it.n_logits,
            })
            .collect();
        // SAFETY: checked size above; the items live in the session box until the next call.
        unsafe {
            (*out).items = b.items.as_ptr();
            (*out).n_items = b.items.len() as u32;
            (*out).item_size = std::mem::size_of::<abi::PlanItem>() as u32;
            (*out).done = u32::from(done);
        }
        Ok(())
    })
}

unsafe extern "C" fn observe<S: Strategy>(
    call: *mut abi::Call,
    session: *mut c_void,
    logits: *const abi::Logits,
) -> i32 {
    guard(call, |host| {
        if session.is_null() || logits.is_null() {
            return Err("observe: null pointer".into());
        }
        // SAFETY: as in `plan`.
        let b = unsafe { &mut *session.cast::<SessionBox<S>>() };
        // SAFETY: the host's logits struct, valid for the call.
        let l = unsafe { &*logits };
        if l.header.type_ != abi::TYPE_LOGITS || (l.header.size as usize) < std::mem::size_of::<abi::Logits>() {
            return Err("logits struct has the wrong type or size".into());
        }
        let mut rows = Vec::with_capacity(l.n_items as usize);
        for i in 0..l.n_items as usize {
            // SAFETY: the host passes `n_items` row pointers and counts, each pointing to
            // `n_logits[i] * vocab_size` floats valid for the call.
            let (p, n) = unsafe { (*l.rows.add(i), *l.n_logits.add(i)) };
            let len = n as usize * l.vocab_size as usize;
            // SAFETY: as above.
            rows.push(if len == 0 { &[][..] } else { unsafe { std::slice::from_raw_parts(p, len) } });
        }
        b.state.observe(host, &rows)
    })
}

unsafe extern "C" fn destroy<S: Strategy>(session: *mut c_void) {
    if session.is_null() {
        return;
    }
    // SAFETY: `session` came from `create::<S>`; the host destroys it once.
    let b = unsafe { Box::from_raw(session.cast::<SessionBox<S>>()) };
    let _ = catch_unwind(AssertUnwindSafe(move || drop(b)));
}

/// The C descriptor of strategy `S` (used by [`export_plugin!`](crate::export_plugin)).
pub fn descriptor<S: Strategy>() -> abi::Strategy {
    abi::Strategy {
        header: abi::Header::new::<abi::Strategy>(abi::TYPE_STRATEGY),
        name: S::NAME.as_ptr(),
        description: S::DESCRIPTION.as_ptr(),
        params_doc: S::PARAMS_DOC.as_ptr(),
        flags: S::FLAGS,
        reserved: 0,
        validate: Some(validate::<S>),
        create: Some(create::<S>),
        plan: Some(plan::<S>),
        observe: Some(observe::<S>),
        destroy: Some(destroy::<S>),
    }
}

/// The plugin's static declaration, built once.
struct Declared {
    info: abi::PluginInfo,
    _strategies: Vec<abi::Strategy>,
    _pointers: Vec<*const abi::Strategy>,
    _strings: [CString; 2],
}
// SAFETY: built once, then only read (by the host, through the raw pointers it holds).
unsafe impl Send for Declared {}
// SAFETY: as above.
unsafe impl Sync for Declared {}

static DECLARED: OnceLock<Declared> = OnceLock::new();

/// The body of the entry point: checks the host, keeps its callback table and returns the
/// declaration (null when the host is incompatible).
///
/// # Safety
/// `host` is null or points to a host info struct valid for the call, whose callback table
/// lives as long as the process.
#[doc(hidden)]
pub unsafe fn entry(
    host: *const abi::HostInfo,
    name: &str,
    version: &str,
    strategies: &[fn() -> abi::Strategy],
) -> *const abi::PluginInfo {
    catch_unwind(AssertUnwindSafe(|| {
        if host.is_null() {
            return std::ptr::null();
        }
        // SAFETY: the host passes its info struct, valid for the call; the header is read first.
        let h = unsafe { *host };
        if h.header.type_ != abi::TYPE_HOST_INFO
            || (h.header.size as usize) < std::mem::size_of::<abi::HostInfo>()
            || h.abi_major != abi::ABI_MAJOR
            || h.api.is_null()
        {
            return std::ptr::null();
        }
        // SAFETY: checked non-null; the host's table lives as long as the host.
        let api = unsafe { &*h.api };
        // A 1.0 table ends before `token_bytes`; later callbacks are checked where they are used.
        let v1_0 = std::mem::offset_of!(abi::HostApi, token_bytes);
        if api.header.type_ != abi::TYPE_HOST_API || (api.header.size as usize) < v1_0 {
            return std::ptr::null();
        }
        HOST_API.store(h.api.cast_mut(), Ordering::Release);
        let d = DECLARED.get_or_init(|| {
            // Never modified after this, so pointers into the vector stay valid.
            let strategies: Vec<abi::Strategy> = strategies.iter().map(|f| f()).collect();
            let pointers: Vec<*const abi::Strategy> = strategies.iter().map(|s| s as *const abi::Strategy).collect();
            let strings = [CString::new(name).unwrap_or_default(), CString::new(version).unwrap_or_default()];
            let info = abi::PluginInfo {
                header: abi::Header::new::<abi::PluginInfo>(abi::TYPE_PLUGIN_INFO),
                abi_major: abi::ABI_MAJOR,
                abi_minor: abi::ABI_MINOR,
                name: strings[0].as_ptr(),
                version: strings[1].as_ptr(),
                strategies: pointers.as_ptr(),
                n_strategies: pointers.len() as u32,
                reserved: 0,
            };
            Declared { info, _strategies: strategies, _pointers: pointers, _strings: strings }
        });
        &d.info as *const abi::PluginInfo
    }))
    .unwrap_or(std::ptr::null())
}

/// Exports the plugin entry point for the listed strategies:
///
/// ```text
/// inferd_plugin_api::export_plugin!(name: "my-plugin", version: "0.1.0", strategies: [MyStrategy]);
/// ```
#[macro_export]
macro_rules! export_plugin {
    (name: $name:expr, version: $version:expr, strategies: [$($s:ty),+ $(,)?]) => {
        /// The plugin's entry point (`inferd_plugin.h`).
        ///
        /// # Safety
        /// Called by the host with its info struct.
        #[no_mangle]
        pub unsafe extern "C" fn inferd_plugin_entry_v1(host: *const $crate::abi::HostInfo) -> *const $crate::abi::PluginInfo {
            // SAFETY: the host passes its info struct (the ABI contract).
            unsafe { $crate::sdk::entry(host, $name, $version, &[$($crate::sdk::descriptor::<$s>),+]) }
        }
    };
}

/// Parses and checks `init.params` with `parse`, which must consume every key (see [`Params`]).
pub fn parse_params<T>(init: &SessionInit, parse: impl FnOnce(&mut Params) -> Result<T, String>) -> Result<T, String> {
    let mut p = Params::parse(&init.params)?;
    let v = parse(&mut p)?;
    p.finish()?;
    Ok(v)
}
