//! Loading one plugin library and reading what it declares.
//!
//! The library is opened with `RTLD_NOW | RTLD_LOCAL` (every symbol resolved up front, none
//! leaking into other plugins) and never closed: unloading is unsafe with thread-local
//! destructors and a no-op for many libraries. Everything it declares is checked and copied
//! into owned values before use.

#![allow(unsafe_code)]

use super::host::host_info;
use inferd_plugin_api::abi;
use libloading::os::unix::{Library, RTLD_LOCAL, RTLD_NOW};
use std::ffi::{c_char, CStr};
use std::path::Path;

/// A strategy's entry points.
#[derive(Clone, Copy)]
pub struct StrategyFns {
    pub validate: abi::ValidateFn,
    pub create: abi::CreateFn,
    pub plan: abi::PlanFn,
    pub observe: abi::ObserveFn,
    pub destroy: abi::DestroyFn,
}

impl std::fmt::Debug for StrategyFns {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StrategyFns")
    }
}

#[derive(Clone, Debug)]
pub struct StrategyDecl {
    pub name: String,
    pub description: String,
    pub params_doc: String,
    pub flags: u32,
    pub fns: StrategyFns,
}

#[derive(Clone, Debug)]
pub struct Declaration {
    pub name: String,
    pub version: String,
    pub abi_minor: u32,
    pub strategies: Vec<StrategyDecl>,
}

impl Declaration {
    /// What it declares, without its entry points.
    pub fn declared(&self) -> super::Declared {
        super::Declared {
            name: self.name.clone(),
            version: self.version.clone(),
            abi_minor: self.abi_minor,
            strategies: self
                .strategies
                .iter()
                .map(|s| super::StrategyInfo {
                    name: s.name.clone(),
                    description: s.description.clone(),
                    params_doc: s.params_doc.clone(),
                    flags: s.flags,
                })
                .collect(),
        }
    }
}

const KNOWN_FLAGS: u32 = abi::STRATEGY_NEEDS_DRAFT;
const MAX_STRATEGIES: u32 = 64;

/// A valid strategy name: `[a-z0-9_-]{1,64}`.
pub fn valid_name(n: &str) -> bool {
    (1..=64).contains(&n.len())
        && n.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
}

/// # Safety
/// `p` is null or a NUL-terminated string.
unsafe fn string(p: *const c_char, what: &str) -> Result<String, String> {
    if p.is_null() {
        return Err(format!("{what} is missing"));
    }
    // SAFETY: the caller's contract.
    unsafe { CStr::from_ptr(p) }.to_str().map(str::to_owned).map_err(|_| format!("{what} is not UTF-8"))
}

/// Opens `path`, calls its entry point and checks the declaration.
pub fn load(path: &Path) -> Result<Declaration, String> {
    // SAFETY: loading runs the library's initializers; only files that passed the directory
    // trust policy (see `Registry`) or that a user named explicitly get here.
    let lib = unsafe { Library::open(Some(path), RTLD_NOW | RTLD_LOCAL) }.map_err(|e| format!("cannot load: {e}"))?;
    // SAFETY: the symbol, if present, has the entry point's type (the ABI contract).
    let entry = match unsafe { lib.get::<abi::EntryFn>(abi::ENTRY_SYMBOL) } {
        Ok(sym) => *sym,
        Err(_) => {
            for major in 2..10 {
                let name = format!("inferd_plugin_entry_v{major}\0");
                // SAFETY: only probing whether the symbol exists.
                if unsafe { lib.get::<*const ()>(name.as_bytes()) }.is_ok() {
                    return Err(format!("built for plugin ABI {major}; this inferd speaks ABI {}", abi::ABI_MAJOR));
                }
            }
            return Err(format!(
                "no {} symbol: not an inferd decoder plugin",
                String::from_utf8_lossy(&abi::ENTRY_SYMBOL[..abi::ENTRY_SYMBOL.len() - 1])
            ));
        }
    };
    // Never unloaded (module docs).
    std::mem::forget(lib);
    declare(entry)
}

/// Calls an ABI 1 entry point (of a loaded library, or linked in) and checks the declaration.
pub fn declare(entry: abi::EntryFn) -> Result<Declaration, String> {
    // SAFETY: the entry point of ABI 1, called with the host's static info.
    let info = unsafe { entry(host_info()) };
    if info.is_null() {
        return Err("the plugin refused this host (its entry point returned NULL)".into());
    }
    // SAFETY: non-null; the plugin's static declaration. The header is read first and the size
    // checked before any other field.
    let header = unsafe { (*info).header };
    if header.type_ != abi::TYPE_PLUGIN_INFO {
        return Err(format!("the declaration has type {:#x}, not inferd_plugin_info", header.type_));
    }
    if (header.size as usize) < std::mem::size_of::<abi::PluginInfo>() {
        return Err(format!(
            "the declaration is {} bytes, smaller than ABI 1.0's {}",
            header.size,
            std::mem::size_of::<abi::PluginInfo>()
        ));
    }
    // SAFETY: checked above.
    let info = unsafe { *info };
    if info.abi_major != abi::ABI_MAJOR {
        return Err(format!("declares ABI major {} from the v1 entry point", info.abi_major));
    }
    if info.abi_minor > abi::ABI_MINOR {
        return Err(format!("built for ABI 1.{}; this inferd speaks 1.{}", info.abi_minor, abi::ABI_MINOR));
    }
    // SAFETY: plugin strings, static.
    let (name, version) =
        unsafe { (string(info.name, "the plugin name")?, string(info.version, "the plugin version")?) };
    if info.n_strategies == 0 || info.n_strategies > MAX_STRATEGIES || info.strategies.is_null() {
        return Err(format!("declares {} strategies (1..={MAX_STRATEGIES} expected)", info.n_strategies));
    }
    let mut strategies: Vec<StrategyDecl> = Vec::new();
    for i in 0..info.n_strategies as usize {
        // SAFETY: the plugin declares `n_strategies` pointers at `strategies`.
        let p = unsafe { *info.strategies.add(i) };
        // SAFETY: `p` is checked for null and its header read before the rest.
        let s = unsafe { strategy(p) }.map_err(|e| format!("strategy {i}: {e}"))?;
        if strategies.iter().any(|o| o.name == s.name) {
            return Err(format!("declares strategy {:?} twice", s.name));
        }
        strategies.push(s);
    }
    Ok(Declaration { name, version, abi_minor: info.abi_minor, strategies })
}

/// # Safety
/// `p` is null or points to a plugin's static strategy descriptor.
unsafe fn strategy(p: *const abi::Strategy) -> Result<StrategyDecl, String> {
    if p.is_null() {
        return Err("null descriptor".into());
    }
    // SAFETY: the caller's contract; the header first.
    let header = unsafe { (*p).header };
    if header.type_ != abi::TYPE_STRATEGY || (header.size as usize) < std::mem::size_of::<abi::Strategy>() {
        return Err(format!(
            "descriptor has type {:#x} and size {}, not an ABI 1.0 inferd_strategy",
            header.type_, header.size
        ));
    }
    // SAFETY: checked above.
    let s = unsafe { *p };
    // SAFETY: plugin strings, static.
    let name = unsafe { string(s.name, "name") }?;
    if !valid_name(&name) {
        return Err(format!("invalid name {name:?} (expected [a-z0-9_-]{{1,64}})"));
    }
    // SAFETY: as above.
    let description = unsafe { string(s.description, "description") }?;
    let params_doc = if s.params_doc.is_null() {
        "{}".to_owned()
    } else {
        // SAFETY: as above.
        unsafe { string(s.params_doc, "params_doc") }?
    };
    if !matches!(serde_json::from_str::<serde_json::Value>(&params_doc), Ok(serde_json::Value::Object(_))) {
        return Err(format!("{name}: params_doc is not a JSON object"));
    }
    if s.flags & !KNOWN_FLAGS != 0 {
        return Err(format!("{name}: unknown flags {:#x}", s.flags & !KNOWN_FLAGS));
    }
    let missing = |f: bool, what: &str| if f { Ok(()) } else { Err(format!("{name}: no {what} function")) };
    missing(s.validate.is_some(), "validate")?;
    missing(s.create.is_some(), "create")?;
    missing(s.plan.is_some(), "plan")?;
    missing(s.observe.is_some(), "observe")?;
    missing(s.destroy.is_some(), "destroy")?;
    match (s.validate, s.create, s.plan, s.observe, s.destroy) {
        (Some(validate), Some(create), Some(plan), Some(observe), Some(destroy)) => Ok(StrategyDecl {
            name,
            description,
            params_doc,
            flags: s.flags,
            fns: StrategyFns { validate, create, plan, observe, destroy },
        }),
        _ => Err(format!("{name}: missing functions")),
    }
}
