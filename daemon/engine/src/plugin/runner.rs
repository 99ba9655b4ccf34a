//! How a strategy's functions are reached: in this process, through the C function pointers of
//! a library loaded here (inferd's own strategies), or in the library's helper process
//! (`isolated`, every other library by default). Both take the same owned inputs and give the
//! same owned outputs, so a session does not know which one it drives.
//!
//! Reading what a plugin wrote (a plan's items behind its pointers) happens here, on the side
//! that holds the plugin: in the daemon for an in-process library, in the helper otherwise; the
//! session then checks the plan the same way for both.

#![allow(unsafe_code)]

use super::host::{CallCtx, HostSide};
use super::isolated::{Helper, Returned, Rows};
use super::loader::StrategyFns;
use super::recorder;
use super::wire::{InitData, PlanItem, RawPlan, ToHelper};
use inferd_plugin_api::abi;
use std::ffi::{c_void, CString};
use std::path::Path;
use std::sync::Arc;

/// Plan items per round, logits rows per item and tokens per plan, at most (a runaway plugin's
/// plan is refused rather than copied).
pub const MAX_ITEMS: u32 = 4096;
pub const MAX_LOGITS: u32 = 1024;
pub const MAX_PLAN_TOKENS: usize = 1 << 20;

/// Where a strategy runs.
#[derive(Clone, Debug)]
pub enum Runner {
    /// In the daemon: a library loaded into this process.
    InProcess(StrategyFns),
    /// In the library's helper process: strategy `index` of what it declared.
    Isolated { helper: Arc<Helper>, index: u32 },
}

/// A live plugin session.
#[derive(Debug)]
pub enum Handle {
    Ptr(*mut c_void),
    /// A session in a helper, and the plan it computed after its last call (plan is pure, so
    /// the next plan call is answered from it without a round trip).
    Remote {
        id: u64,
        ahead: Option<RawPlan>,
    },
}

/// Why a call into a strategy did not succeed.
#[derive(Debug)]
pub enum CallError {
    /// The plugin returned an error status: its message. It fails this request only.
    Failed(String),
    /// The plugin's process crashed, ran past its time limit or broke the protocol: every
    /// session in it has failed, and its library is quarantined.
    Fault(String),
}

impl CallError {
    pub fn into_message(self) -> String {
        match self {
            CallError::Failed(m) | CallError::Fault(m) => m,
        }
    }
}

/// A session-init struct and the memory it points to.
pub struct RawInit<'a> {
    _params: CString,
    pub raw: abi::SessionInit,
    _eos: std::marker::PhantomData<&'a [i32]>,
}

/// The C struct for `d` (its pointers into `d` and a copy of the parameters).
pub fn raw_init(d: &InitData) -> Result<RawInit<'_>, String> {
    let params = CString::new(d.params.as_str()).map_err(|_| "parameters contain a NUL byte".to_string())?;
    let raw = abi::SessionInit {
        header: abi::Header::new::<abi::SessionInit>(abi::TYPE_SESSION_INIT),
        params_json: params.as_ptr(),
        seq: d.seq,
        prompt_len: d.prompt_len,
        vocab_size: d.vocab,
        max_tokens: d.max_tokens,
        n: d.n,
        eos: d.eos.as_ptr(),
        n_eos: d.eos.len() as u32,
        roles: d.roles,
        seed: d.seed,
        logprobs: d.logprobs,
        reserved: 0,
        constrained: d.constrained,
        top_logprobs: d.top_logprobs,
    };
    Ok(RawInit { _params: params, raw, _eos: std::marker::PhantomData })
}

/// A plan struct for the plugin to fill.
pub fn empty_plan() -> abi::Plan {
    abi::Plan {
        header: abi::Header::new::<abi::Plan>(abi::TYPE_PLAN),
        items: std::ptr::null(),
        n_items: 0,
        item_size: 0,
        done: 0,
        reserved: 0,
    }
}

/// Copies a plan out of the plugin's memory, its sizes bounded.
///
/// # Safety
/// `plan` was filled by the plugin's `plan`, whose items stay valid until the next call into the
/// session (ABI rule).
pub unsafe fn read_raw_plan(plan: &abi::Plan) -> Result<RawPlan, String> {
    if plan.done != 0 {
        return Ok(RawPlan { done: true, items: Vec::new() });
    }
    if plan.n_items > MAX_ITEMS {
        return Err(format!("plan has {} items (at most {MAX_ITEMS})", plan.n_items));
    }
    if plan.n_items > 0 && (plan.items.is_null() || (plan.item_size as usize) < std::mem::size_of::<abi::PlanItem>()) {
        return Err("plan items missing or of the wrong size".into());
    }
    let mut items = Vec::with_capacity(plan.n_items as usize);
    let mut total = 0usize;
    for i in 0..plan.n_items as usize {
        // SAFETY: the plugin declares `n_items` items of `item_size` bytes at `items` (the
        // caller's contract); we read the ABI 1.0 prefix of each.
        let it = unsafe {
            plan.items.cast::<u8>().add(i * plan.item_size as usize).cast::<abi::PlanItem>().read_unaligned()
        };
        total += it.n_tokens as usize;
        if total > MAX_PLAN_TOKENS {
            return Err(format!("plan appends more than {MAX_PLAN_TOKENS} tokens"));
        }
        let tokens = if it.n_tokens == 0 {
            Vec::new()
        } else if it.tokens.is_null() {
            return Err(format!("plan item {i} has {} tokens at a null pointer", it.n_tokens));
        } else {
            // SAFETY: as above, `n_tokens` tokens at `tokens`.
            unsafe { std::slice::from_raw_parts(it.tokens, it.n_tokens as usize) }.to_vec()
        };
        items.push(PlanItem { seq: it.seq, tokens, n_logits: it.n_logits });
    }
    Ok(RawPlan { done: false, items })
}

/// Runs one in-process call: the context for the callbacks, the call recorded for the crash
/// recorder, the plugin's message when it fails.
fn in_process(side: &mut dyn HostSide, path: &Path, f: impl FnOnce(*mut abi::Call) -> i32) -> Result<(), CallError> {
    let mut ctx = CallCtx::new(side);
    let status = {
        let _in_call = recorder::enter(path);
        f(ctx.as_call())
    };
    if status == abi::OK {
        Ok(())
    } else {
        Err(CallError::Failed(ctx.message(status)))
    }
}

/// An isolated call's outcome as a result.
fn returned(r: Result<Returned, String>) -> Result<Option<RawPlan>, CallError> {
    match r {
        Ok(Returned { status: abi::OK, plan, .. }) => Ok(plan),
        Ok(Returned { message, .. }) => Err(CallError::Failed(message)),
        Err(fault) => Err(CallError::Fault(fault)),
    }
}

impl Runner {
    /// The strategy's admission check.
    pub fn validate(&self, path: &Path, side: &mut dyn HostSide, init: &InitData) -> Result<(), CallError> {
        match self {
            Runner::InProcess(fns) => {
                let raw = raw_init(init).map_err(CallError::Failed)?;
                // SAFETY: a checked entry point of a loaded plugin, with a live call context and
                // an init struct whose pointers outlive the call.
                in_process(side, path, |call| unsafe { (fns.validate)(call, &raw.raw) })
            }
            Runner::Isolated { helper, index } => {
                returned(helper.call(&ToHelper::Validate { strategy: *index, init: init.clone() }, None, side))
                    .map(drop)
            }
        }
    }

    /// A new plugin session.
    pub fn create(&self, path: &Path, side: &mut dyn HostSide, init: &InitData) -> Result<Handle, CallError> {
        match self {
            Runner::InProcess(fns) => {
                let raw = raw_init(init).map_err(CallError::Failed)?;
                let mut out: *mut c_void = std::ptr::null_mut();
                // SAFETY: as in `validate`; `out` is a valid pointer for the plugin's session.
                in_process(side, path, |call| unsafe { (fns.create)(call, &raw.raw, &mut out) })?;
                if out.is_null() {
                    return Err(CallError::Failed("create returned no session".into()));
                }
                Ok(Handle::Ptr(out))
            }
            Runner::Isolated { helper, index } => {
                let session = helper.new_session();
                let m = ToHelper::Create { session, strategy: *index, init: init.clone() };
                let ahead = returned(helper.call(&m, None, side))?;
                Ok(Handle::Remote { id: session, ahead })
            }
        }
    }

    /// The session's plan, as the plugin wrote it.
    pub fn plan(&self, path: &Path, side: &mut dyn HostSide, h: &mut Handle) -> Result<RawPlan, CallError> {
        match (self, h) {
            (Runner::InProcess(fns), Handle::Ptr(p)) => {
                let mut plan = empty_plan();
                let p = *p;
                // SAFETY: `p` is this strategy's live session (never used concurrently); `plan`
                // is a valid struct for the plugin to fill.
                in_process(side, path, |call| unsafe { (fns.plan)(call, p, &mut plan) })?;
                // SAFETY: filled by the plan call that just returned.
                unsafe { read_raw_plan(&plan) }.map_err(CallError::Failed)
            }
            (Runner::Isolated { helper, .. }, Handle::Remote { id, ahead }) => {
                if let Some(p) = ahead {
                    return Ok(p.clone());
                }
                returned(helper.call(&ToHelper::Plan { session: *id }, None, side))?
                    .ok_or_else(|| CallError::Fault("the plugin's process answered a plan without one".into()))
            }
            _ => Err(CallError::Failed("a session handle of the other kind".into())),
        }
    }

    /// Hands the session the logits of its last plan: `counts[i]` rows of `vocab` floats at the
    /// start of `rows[i]`.
    pub fn observe(
        &self,
        path: &Path,
        side: &mut dyn HostSide,
        h: &mut Handle,
        rows: &[Vec<f32>],
        counts: &[u32],
        vocab: usize,
    ) -> Result<(), CallError> {
        match (self, h) {
            (Runner::InProcess(fns), Handle::Ptr(p)) => {
                let ptrs: Vec<*const f32> = rows.iter().map(|r| r.as_ptr()).collect();
                let logits = abi::Logits {
                    header: abi::Header::new::<abi::Logits>(abi::TYPE_LOGITS),
                    n_items: rows.len() as u32,
                    vocab_size: vocab as u32,
                    rows: ptrs.as_ptr(),
                    n_logits: counts.as_ptr(),
                };
                // SAFETY: as in `plan`; `logits` and the rows it points to outlive the call.
                in_process(side, path, |call| unsafe { (fns.observe)(call, *p, &logits) })
            }
            (Runner::Isolated { helper, .. }, Handle::Remote { id, ahead }) => {
                *ahead = None;
                let m = ToHelper::Observe { session: *id, vocab: vocab as u32, counts: counts.to_vec() };
                *ahead = returned(helper.call(&m, Some(Rows { rows, counts, vocab }), side))?;
                Ok(())
            }
            _ => Err(CallError::Failed("a session handle of the other kind".into())),
        }
    }

    /// Ends a plugin session.
    pub fn destroy(&self, path: &Path, h: Handle) {
        match (self, h) {
            (Runner::InProcess(fns), Handle::Ptr(p)) => {
                let _in_call = recorder::enter(path);
                // SAFETY: the live session of this strategy, destroyed exactly once (the handle
                // is moved in).
                unsafe { (fns.destroy)(p) };
            }
            (Runner::Isolated { helper, .. }, Handle::Remote { id, .. }) => helper.destroy(id),
            _ => {}
        }
    }

    /// The helper process crashed or hung: the strategy is out of service.
    pub fn faulted(&self) -> Option<String> {
        match self {
            Runner::InProcess(_) => None,
            Runner::Isolated { helper, .. } => helper.fault(),
        }
    }
}
