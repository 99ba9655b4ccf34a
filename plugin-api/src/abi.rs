//! The `#[repr(C)]` mirror of `include/inferd_plugin.h`, field for field.
//!
//! The header is the contract; this file follows it. `tests::layout_matches_the_c_header`
//! compiles a C program against the header with the system C compiler and compares every size
//! and field offset with these definitions.

use std::ffi::{c_char, c_void};

pub const ABI_MAJOR: u32 = 1;
pub const ABI_MINOR: u32 = 2;
/// The entry symbol of this major version, NUL-terminated for `dlsym`.
pub const ENTRY_SYMBOL: &[u8] = b"inferd_plugin_entry_v1\0";

pub const OK: i32 = 0;
pub const ERR: i32 = 1;
pub const ERR_INVALID: i32 = 2;
pub const ERR_NO_MEMORY: i32 = 3;

pub const TYPE_HOST_INFO: u32 = 0x494e_0001;
pub const TYPE_HOST_API: u32 = 0x494e_0002;
pub const TYPE_PLUGIN_INFO: u32 = 0x494e_0003;
pub const TYPE_STRATEGY: u32 = 0x494e_0004;
pub const TYPE_SESSION_INIT: u32 = 0x494e_0005;
pub const TYPE_PLAN: u32 = 0x494e_0006;
pub const TYPE_LOGITS: u32 = 0x494e_0007;

pub const LOG_ERROR: i32 = 1;
pub const LOG_WARN: i32 = 2;
pub const LOG_INFO: i32 = 3;
pub const LOG_DEBUG: i32 = 4;

pub const ROLE_TARGET: u32 = 0;
pub const ROLE_DRAFT: u32 = 1;

pub const FINISH_STOP: u32 = 0;
pub const FINISH_LENGTH: u32 = 1;

pub const STRATEGY_NEEDS_DRAFT: u32 = 1;

/// A sequence handle; 0 is never valid.
pub type Seq = u64;

/// The host's context of one call (opaque to plugins).
#[repr(C)]
pub struct Call {
    _opaque: [u8; 0],
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Header {
    pub type_: u32,
    pub size: u32,
    pub next: *const c_void,
}

impl Header {
    pub const fn new<T>(type_: u32) -> Header {
        Header { type_, size: std::mem::size_of::<T>() as u32, next: std::ptr::null() }
    }
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct HostApi {
    pub header: Header,
    pub log: Option<unsafe extern "C" fn(*mut Call, i32, *const c_char)>,
    pub set_error: Option<unsafe extern "C" fn(*mut Call, *const c_char)>,
    pub seq_create: Option<unsafe extern "C" fn(*mut Call, u32, *mut Seq) -> i32>,
    pub seq_fork: Option<unsafe extern "C" fn(*mut Call, Seq, *mut Seq) -> i32>,
    pub seq_truncate: Option<unsafe extern "C" fn(*mut Call, Seq, u32) -> i32>,
    pub seq_free: Option<unsafe extern "C" fn(*mut Call, Seq) -> i32>,
    pub seq_len: Option<unsafe extern "C" fn(*mut Call, Seq, *mut u32) -> i32>,
    pub seq_tokens: Option<unsafe extern "C" fn(*mut Call, Seq, *mut i32, u32, *mut u32) -> i32>,
    pub emit: Option<unsafe extern "C" fn(*mut Call, u32, i32, f32) -> i32>,
    pub finish: Option<unsafe extern "C" fn(*mut Call, u32, u32) -> i32>,
    pub random: Option<unsafe extern "C" fn(*mut Call, u64, u64, *mut u32) -> i32>,
    pub report: Option<unsafe extern "C" fn(*mut Call, *const c_char, f64) -> i32>,
    /// ABI 1.1.
    pub token_bytes: Option<unsafe extern "C" fn(*mut Call, i32, *mut u8, u32, *mut u32) -> i32>,
    /// ABI 1.2.
    pub emit_top: Option<unsafe extern "C" fn(*mut Call, u32, i32, f32, *const i32, *const f32, u32) -> i32>,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct HostInfo {
    pub header: Header,
    pub abi_major: u32,
    pub abi_minor: u32,
    pub host_version: *const c_char,
    pub api: *const HostApi,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct SessionInit {
    pub header: Header,
    pub params_json: *const c_char,
    pub seq: Seq,
    pub prompt_len: u32,
    pub vocab_size: u32,
    pub max_tokens: u32,
    pub n: u32,
    pub eos: *const i32,
    pub n_eos: u32,
    pub roles: u32,
    pub seed: u64,
    pub logprobs: u32,
    pub reserved: u32,
    /// ABI 1.1.
    pub constrained: u32,
    /// ABI 1.2.
    pub top_logprobs: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct PlanItem {
    pub seq: Seq,
    pub tokens: *const i32,
    pub n_tokens: u32,
    pub n_logits: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct Plan {
    pub header: Header,
    pub items: *const PlanItem,
    pub n_items: u32,
    pub item_size: u32,
    pub done: u32,
    pub reserved: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct Logits {
    pub header: Header,
    pub n_items: u32,
    pub vocab_size: u32,
    pub rows: *const *const f32,
    pub n_logits: *const u32,
}

pub type ValidateFn = unsafe extern "C" fn(*mut Call, *const SessionInit) -> i32;
pub type CreateFn = unsafe extern "C" fn(*mut Call, *const SessionInit, *mut *mut c_void) -> i32;
pub type PlanFn = unsafe extern "C" fn(*mut Call, *mut c_void, *mut Plan) -> i32;
pub type ObserveFn = unsafe extern "C" fn(*mut Call, *mut c_void, *const Logits) -> i32;
pub type DestroyFn = unsafe extern "C" fn(*mut c_void);

#[repr(C)]
#[derive(Clone, Copy)]
pub struct Strategy {
    pub header: Header,
    pub name: *const c_char,
    pub description: *const c_char,
    pub params_doc: *const c_char,
    pub flags: u32,
    pub reserved: u32,
    pub validate: Option<ValidateFn>,
    pub create: Option<CreateFn>,
    pub plan: Option<PlanFn>,
    pub observe: Option<ObserveFn>,
    pub destroy: Option<DestroyFn>,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct PluginInfo {
    pub header: Header,
    pub abi_major: u32,
    pub abi_minor: u32,
    pub name: *const c_char,
    pub version: *const c_char,
    pub strategies: *const *const Strategy,
    pub n_strategies: u32,
    pub reserved: u32,
}

pub type EntryFn = unsafe extern "C" fn(*const HostInfo) -> *const PluginInfo;

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};
    use std::process::Command;

    /// `(C expression, Rust value)` for every struct size and field offset.
    fn rust_layout() -> Vec<(String, usize)> {
        let mut v: Vec<(String, usize)> = Vec::new();
        macro_rules! sizes {
            ($($c:literal => $t:ty),* $(,)?) => { $( v.push((format!("sizeof(struct {})", $c), size_of::<$t>())); )* };
        }
        macro_rules! fields {
            ($c:literal, $t:ty, [$($f:ident $(=> $cf:literal)?),* $(,)?]) => {
                $( v.push((format!("offsetof(struct {}, {})", $c, fields!(@name $f $($cf)?)), offset_of!($t, $f))); )*
            };
            (@name $f:ident $cf:literal) => { $cf };
            (@name $f:ident) => { stringify!($f) };
        }
        sizes!(
            "inferd_header" => Header, "inferd_host_api" => HostApi, "inferd_host_info" => HostInfo,
            "inferd_session_init" => SessionInit, "inferd_plan_item" => PlanItem, "inferd_plan" => Plan,
            "inferd_logits" => Logits, "inferd_strategy" => Strategy, "inferd_plugin_info" => PluginInfo,
        );
        fields!("inferd_header", Header, [type_ => "type", size, next]);
        fields!(
            "inferd_host_api",
            HostApi,
            [
                header,
                log,
                set_error,
                seq_create,
                seq_fork,
                seq_truncate,
                seq_free,
                seq_len,
                seq_tokens,
                emit,
                finish,
                random,
                report,
                token_bytes,
                emit_top
            ]
        );
        fields!("inferd_host_info", HostInfo, [header, abi_major, abi_minor, host_version, api]);
        fields!(
            "inferd_session_init",
            SessionInit,
            [
                header,
                params_json,
                seq,
                prompt_len,
                vocab_size,
                max_tokens,
                n,
                eos,
                n_eos,
                roles,
                seed,
                logprobs,
                reserved,
                constrained,
                top_logprobs
            ]
        );
        fields!("inferd_plan_item", PlanItem, [seq, tokens, n_tokens, n_logits]);
        fields!("inferd_plan", Plan, [header, items, n_items, item_size, done, reserved]);
        fields!("inferd_logits", Logits, [header, n_items, vocab_size, rows, n_logits]);
        fields!(
            "inferd_strategy",
            Strategy,
            [header, name, description, params_doc, flags, reserved, validate, create, plan, observe, destroy]
        );
        fields!(
            "inferd_plugin_info",
            PluginInfo,
            [header, abi_major, abi_minor, name, version, strategies, n_strategies, reserved]
        );
        v
    }

    #[test]
    fn layout_matches_the_c_header() {
        let layout = rust_layout();
        let dir = std::env::temp_dir().join(format!("inferd-abi-layout-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let mut c =
            String::from("#include <stdio.h>\n#include <stddef.h>\n#include \"inferd_plugin.h\"\nint main(void) {\n");
        for (expr, _) in &layout {
            c.push_str(&format!("    printf(\"%zu\\n\", (size_t)({expr}));\n"));
        }
        // The constants too: the header's values are the contract.
        let consts: [(&str, i64); 22] = [
            ("INFERD_LOG_ERROR", LOG_ERROR.into()),
            ("INFERD_LOG_WARN", LOG_WARN.into()),
            ("INFERD_LOG_INFO", LOG_INFO.into()),
            ("INFERD_ROLE_TARGET", ROLE_TARGET.into()),
            ("INFERD_ABI_MAJOR", ABI_MAJOR.into()),
            ("INFERD_ABI_MINOR", ABI_MINOR.into()),
            ("INFERD_OK", OK.into()),
            ("INFERD_ERR", ERR.into()),
            ("INFERD_ERR_INVALID", ERR_INVALID.into()),
            ("INFERD_ERR_NO_MEMORY", ERR_NO_MEMORY.into()),
            ("INFERD_TYPE_HOST_INFO", TYPE_HOST_INFO.into()),
            ("INFERD_TYPE_HOST_API", TYPE_HOST_API.into()),
            ("INFERD_TYPE_PLUGIN_INFO", TYPE_PLUGIN_INFO.into()),
            ("INFERD_TYPE_STRATEGY", TYPE_STRATEGY.into()),
            ("INFERD_TYPE_SESSION_INIT", TYPE_SESSION_INIT.into()),
            ("INFERD_TYPE_PLAN", TYPE_PLAN.into()),
            ("INFERD_TYPE_LOGITS", TYPE_LOGITS.into()),
            ("INFERD_ROLE_DRAFT", ROLE_DRAFT.into()),
            ("INFERD_FINISH_STOP", FINISH_STOP.into()),
            ("INFERD_FINISH_LENGTH", FINISH_LENGTH.into()),
            ("INFERD_STRATEGY_NEEDS_DRAFT", STRATEGY_NEEDS_DRAFT.into()),
            ("INFERD_LOG_DEBUG", LOG_DEBUG.into()),
        ];
        for (name, _) in &consts {
            c.push_str(&format!("    printf(\"%lld\\n\", (long long)({name}));\n"));
        }
        c.push_str("    printf(\"%s\\n\", INFERD_PLUGIN_ENTRY);\n    return 0;\n}\n");
        std::fs::write(dir.join("layout.c"), c).expect("write layout.c");
        let include = concat!(env!("CARGO_MANIFEST_DIR"), "/include");
        let exe = dir.join("layout");
        let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
        let st = Command::new(&cc)
            .args(["-std=c99", "-Wall", "-Werror", "-I", include, "-o"])
            .arg(&exe)
            .arg(dir.join("layout.c"))
            .status();
        let st = st.unwrap_or_else(|e| panic!("running the C compiler `{cc}`: {e} (install gcc)"));
        assert!(st.success(), "the header does not compile");
        let out = Command::new(&exe).output().expect("run layout");
        let text = String::from_utf8(out.stdout).expect("utf-8");
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), layout.len() + consts.len() + 1);
        for ((expr, rust), c) in layout.iter().zip(&lines) {
            assert_eq!(c.parse::<usize>().ok(), Some(*rust), "{expr}: C says {c}, Rust {rust}");
        }
        for ((name, rust), c) in consts.iter().zip(&lines[layout.len()..]) {
            assert_eq!(c.parse::<i64>().ok(), Some(*rust), "{name}: C says {c}, Rust {rust}");
        }
        assert_eq!(lines[lines.len() - 1].as_bytes(), &ENTRY_SYMBOL[..ENTRY_SYMBOL.len() - 1]);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
