//! The confinement of a plugin's helper process: bounded memory, no descriptors but its own,
//! death with the daemon, and, once its library is loaded, a system-call allow-list (seccomp)
//! that leaves it computing, allocating, making threads and talking over the socket it was
//! given, and nothing else: no files, no network, no processes, no signals to others.
//!
//! The filter is a short classic-BPF program written here: an architecture check, then one
//! comparison per allowed call, `clone` only for threads and `tgkill` only within the helper.
//! Refused calls fail with `EPERM` (`clone3` with `ENOSYS`, so the C library falls back to
//! `clone`), so a library that merely probes (`fstat` on standard output, `open` of a locale
//! file) keeps working. It is installed with `prctl`, which systemd's `@system-service` set (the
//! daemon's own filter) allows, for every thread (`SECCOMP_FILTER_FLAG_TSYNC`) where the
//! `seccomp` call itself is allowed; where it is not, a library that started threads while it
//! loaded is refused, since those threads would run unconfined.

#![allow(unsafe_code)]

use std::io;

#[cfg(target_arch = "x86_64")]
const AUDIT_ARCH: u32 = 0xc000_003e;
#[cfg(target_arch = "aarch64")]
const AUDIT_ARCH: u32 = 0xc000_00b7;

fn check(r: libc::c_int) -> io::Result<()> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Starts `cmd` from a thread that lives as long as the process. A helper asks the kernel to
/// kill it when its parent dies ([`die_with_parent`]), and for the kernel the parent is the
/// *thread* that forked it: a helper started from a worker thread that later ends (the async
/// runtime's blocking pool retires idle threads after seconds) would be killed with it, and the
/// next request to reuse it would find it dead.
pub fn spawn_lasting(cmd: std::process::Command) -> io::Result<std::process::Child> {
    type Job = (std::process::Command, std::sync::mpsc::Sender<io::Result<std::process::Child>>);
    static SPAWNER: std::sync::OnceLock<std::sync::Mutex<std::sync::mpsc::Sender<Job>>> = std::sync::OnceLock::new();
    let spawner = SPAWNER.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel::<Job>();
        let started = std::thread::Builder::new().name("inferd-spawner".into()).spawn(move || {
            for (mut cmd, reply) in rx {
                let _ = reply.send(cmd.spawn());
            }
        });
        if let Err(e) = started {
            eprintln!("inferd: no spawner thread ({e}); helpers start from the calling thread");
        }
        std::sync::Mutex::new(tx)
    });
    let (reply, answer) = std::sync::mpsc::channel();
    let sent = spawner.lock().map_err(|_| io::Error::other("the spawner is poisoned"))?.send((cmd, reply));
    match sent {
        Ok(()) => answer.recv().map_err(|_| io::Error::other("the spawner thread is gone"))?,
        // No spawner thread: start it here (the helper then lives as long as this thread).
        Err(std::sync::mpsc::SendError((mut cmd, _))) => cmd.spawn(),
    }
}

/// Dies (SIGKILL) when the daemon `parent` does, and refuses to start if it already has.
pub fn die_with_parent(parent: u32) -> io::Result<()> {
    // SAFETY: prctl with integer arguments.
    check(unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) })?;
    // SAFETY: getppid cannot fail.
    if unsafe { libc::getppid() } as u32 != parent {
        return Err(io::Error::other("the daemon that started this helper is gone"));
    }
    Ok(())
}

/// Closes every descriptor above standard error (a socket-activated daemon's listener has no
/// close-on-exec flag).
pub fn close_inherited() {
    // SAFETY: close_range on descriptors this process owns and does not use; failure (an old
    // kernel) leaves them open, which the filter then makes useless anyway.
    unsafe { libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32) };
}

/// Bounds the address space at `mib` MiB (an allocation past it fails instead of reaching the
/// machine's OOM killer) and writes no core files.
pub fn limit_memory(mib: u64) -> io::Result<()> {
    let bytes = mib.saturating_mul(1 << 20);
    let lim = libc::rlimit { rlim_cur: bytes, rlim_max: bytes };
    // SAFETY: setrlimit with a valid struct.
    check(unsafe { libc::setrlimit(libc::RLIMIT_AS, &lim) })?;
    let none = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: as above.
    check(unsafe { libc::setrlimit(libc::RLIMIT_CORE, &none) })
}

/// The calls a helper may make freely.
fn allowed() -> Vec<libc::c_long> {
    use libc::*;
    vec![
        SYS_read,
        SYS_write,
        SYS_readv,
        SYS_writev,
        SYS_recvfrom,
        SYS_sendto,
        SYS_recvmsg,
        SYS_sendmsg,
        SYS_close,
        SYS_mmap,
        SYS_munmap,
        SYS_mremap,
        SYS_mprotect,
        SYS_brk,
        SYS_madvise,
        SYS_futex,
        SYS_sched_yield,
        SYS_nanosleep,
        SYS_clock_nanosleep,
        SYS_clock_gettime,
        SYS_gettimeofday,
        SYS_exit,
        SYS_exit_group,
        SYS_rt_sigreturn,
        SYS_rt_sigprocmask,
        SYS_rt_sigaction,
        SYS_sigaltstack,
        SYS_getpid,
        SYS_gettid,
        SYS_getrandom,
        SYS_set_robust_list,
        SYS_rseq,
        SYS_sched_getaffinity,
        SYS_membarrier,
    ]
}

fn stmt(code: u32, k: u32) -> libc::sock_filter {
    libc::sock_filter { code: code as u16, jt: 0, jf: 0, k }
}

fn jump(code: u32, k: u32, jt: u8, jf: u8) -> libc::sock_filter {
    libc::sock_filter { code: code as u16, jt, jf, k }
}

/// The filter for a helper whose process id is `pid`.
fn program(pid: u32) -> Vec<libc::sock_filter> {
    use libc::{BPF_ABS, BPF_JEQ, BPF_JGE, BPF_JMP, BPF_JSET, BPF_K, BPF_LD, BPF_RET, BPF_W};
    const NR: u32 = 0;
    const ARCH: u32 = 4;
    const ARG0_LO: u32 = 16;
    const ARG0_HI: u32 = 20;
    let (allow, eperm) = (libc::SECCOMP_RET_ALLOW, libc::SECCOMP_RET_ERRNO | libc::EPERM as u32);
    let mut p = vec![
        stmt(BPF_LD | BPF_W | BPF_ABS, ARCH),
        jump(BPF_JMP | BPF_JEQ | BPF_K, AUDIT_ARCH, 1, 0),
        stmt(BPF_RET | BPF_K, libc::SECCOMP_RET_KILL_PROCESS),
        stmt(BPF_LD | BPF_W | BPF_ABS, NR),
    ];
    if cfg!(target_arch = "x86_64") {
        // The x32 calls share the architecture tag; their numbers have bit 30 set.
        p.push(jump(BPF_JMP | BPF_JGE | BPF_K, 0x4000_0000, 0, 1));
        p.push(stmt(BPF_RET | BPF_K, eperm));
    }
    for nr in allowed() {
        p.push(jump(BPF_JMP | BPF_JEQ | BPF_K, nr as u32, 0, 1));
        p.push(stmt(BPF_RET | BPF_K, allow));
    }
    p.push(jump(BPF_JMP | BPF_JEQ | BPF_K, libc::SYS_clone3 as u32, 0, 1));
    p.push(stmt(BPF_RET | BPF_K, libc::SECCOMP_RET_ERRNO | libc::ENOSYS as u32));
    // clone: threads only (CLONE_THREAD in the flags, the first argument on both architectures).
    p.push(jump(BPF_JMP | BPF_JEQ | BPF_K, libc::SYS_clone as u32, 0, 4));
    p.push(stmt(BPF_LD | BPF_W | BPF_ABS, ARG0_LO));
    p.push(jump(BPF_JMP | BPF_JSET | BPF_K, libc::CLONE_THREAD as u32, 0, 1));
    p.push(stmt(BPF_RET | BPF_K, allow));
    p.push(stmt(BPF_RET | BPF_K, eperm));
    // tgkill: signals to this process's own threads (abort() raises SIGABRT this way).
    p.push(jump(BPF_JMP | BPF_JEQ | BPF_K, libc::SYS_tgkill as u32, 0, 6));
    p.push(stmt(BPF_LD | BPF_W | BPF_ABS, ARG0_LO));
    p.push(jump(BPF_JMP | BPF_JEQ | BPF_K, pid, 0, 3));
    p.push(stmt(BPF_LD | BPF_W | BPF_ABS, ARG0_HI));
    p.push(jump(BPF_JMP | BPF_JEQ | BPF_K, 0, 0, 1));
    p.push(stmt(BPF_RET | BPF_K, allow));
    p.push(stmt(BPF_RET | BPF_K, eperm));
    p.push(stmt(BPF_RET | BPF_K, eperm));
    p
}

/// How many threads this process has.
fn threads() -> usize {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("Threads:").and_then(|n| n.trim().parse().ok())))
        .unwrap_or(1)
}

/// Installs the filter; from here on the process can only compute and use what it holds.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
pub fn confine() -> io::Result<()> {
    // SAFETY: getpid cannot fail.
    let filter = program(unsafe { libc::getpid() } as u32);
    let prog = libc::sock_fprog { len: filter.len() as u16, filter: filter.as_ptr().cast_mut() };
    let many = threads() > 1;
    // SAFETY: prctl with integer arguments.
    check(unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) })?;
    // SAFETY: `prog` points to `filter`, alive for the call; the kernel copies it.
    let tsync = unsafe {
        libc::syscall(
            libc::SYS_seccomp,
            libc::SECCOMP_SET_MODE_FILTER,
            libc::SECCOMP_FILTER_FLAG_TSYNC,
            &prog as *const libc::sock_fprog,
        )
    };
    if tsync == 0 {
        return Ok(());
    }
    if many {
        return Err(io::Error::other(
            "it started threads while loading, and this system does not let the sandbox confine them",
        ));
    }
    // SAFETY: as above, through prctl.
    check(unsafe {
        libc::prctl(libc::PR_SET_SECCOMP, libc::SECCOMP_MODE_FILTER as libc::c_ulong, &prog as *const libc::sock_fprog)
    })
}

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
pub fn confine() -> io::Result<()> {
    Err(io::Error::other("no system-call filter for this architecture"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_jump_of_the_filter_lands_inside_it_on_a_return_or_a_comparison() {
        let p = program(1234);
        assert!(p.len() < 255, "{} instructions", p.len());
        for (i, ins) in p.iter().enumerate() {
            if u32::from(ins.code) & 0x07 == libc::BPF_JMP {
                for off in [ins.jt, ins.jf] {
                    let to = i + 1 + off as usize;
                    assert!(to < p.len(), "instruction {i} jumps past the end");
                }
            }
        }
        let last = p.last().map(|i| (u32::from(i.code), i.k));
        assert_eq!(last, Some((libc::BPF_RET | libc::BPF_K, libc::SECCOMP_RET_ERRNO | libc::EPERM as u32)));
    }
}
