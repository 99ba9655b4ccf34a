//! systemd integration through `sd-notify`: the service-manager notifications (READY, STATUS,
//! RELOADING, STOPPING, WATCHDOG) and socket activation (LISTEN_FDS). Outside systemd (no
//! NOTIFY_SOCKET, no LISTEN_FDS) every call here does nothing.

use super::Shared;
use inferd_engine::sched::monitor::Monitor;
use sd_notify::NotifyState;
use std::sync::Arc;
use std::time::Duration;

fn send(states: &[NotifyState<'_>]) {
    if let Err(e) = sd_notify::notify(states) {
        eprintln!("inferd: sd_notify failed: {e}");
    }
}

/// Startup or a reload is complete.
pub fn ready(summary: &str) {
    send(&[NotifyState::Ready, NotifyState::Status(summary)]);
}

pub fn status(summary: &str) {
    send(&[NotifyState::Status(summary)]);
}

/// A reload begins (`Type=notify-reload` wants the monotonic time with it).
pub fn reloading() {
    match NotifyState::monotonic_usec_now() {
        Ok(now) => send(&[NotifyState::Reloading, now, NotifyState::Status("reloading the configuration")]),
        Err(_) => send(&[NotifyState::Reloading, NotifyState::Status("reloading the configuration")]),
    }
}

pub fn stopping() {
    send(&[NotifyState::Stopping, NotifyState::Status("stopping: finishing in-flight requests")]);
}

/// Feeds the watchdog while every engine loop is alive: the pings come from the loops'
/// heartbeats, so a stuck engine (a forward pass that never returns, a deadlock) stops them and
/// systemd restarts the service. Does nothing unless systemd asked for a watchdog.
pub fn watchdog(sh: Arc<Shared>) -> tokio::task::JoinHandle<()> {
    let period = sd_notify::watchdog_enabled();
    tokio::spawn(async move {
        let Some(period) = period else { return };
        let mut tick = tokio::time::interval(period / 2);
        loop {
            tick.tick().await;
            let loaded = sh.models.loaded();
            let stuck = stalled(loaded.iter().map(|m| &*m.monitor), period);
            if stuck.is_empty() {
                send(&[NotifyState::Watchdog]);
            } else {
                eprintln!(
                    "inferd: engine loop of {} has not turned for {:?}; not feeding the watchdog",
                    stuck.join(", "),
                    period / 2
                );
            }
        }
    })
}

/// The engine loops (by model name) that have not turned within half the watchdog period.
pub fn stalled<'a>(monitors: impl Iterator<Item = &'a Monitor>, period: Duration) -> Vec<&'a str> {
    monitors.filter(|m| m.since_beat() > period / 2).map(|m| m.model.as_str()).collect()
}

/// The first socket passed by the service manager (LISTEN_FDS), if this is socket activation.
/// (Adopting an inherited descriptor is the one `unsafe` outside kernels, plugins and mmap: the
/// standard library has no safe way to take ownership of a raw fd.)
#[allow(unsafe_code)]
pub fn activated_listener() -> anyhow::Result<Option<std::os::unix::net::UnixListener>> {
    use std::os::fd::FromRawFd;
    let Some(fd) = sd_notify::listen_fds()?.next() else { return Ok(None) };
    // SAFETY: `listen_fds` checked that LISTEN_PID is this process and returned a descriptor in
    // the range the service manager passed (starting at 3); nothing else in the process owns it,
    // and it is taken exactly once, here (the environment is not consulted again).
    let listener = unsafe { std::os::unix::net::UnixListener::from_raw_fd(fd) };
    listener
        .local_addr()
        .map_err(|e| anyhow::anyhow!("the socket passed by systemd (fd {fd}) is not a Unix socket: {e}"))?;
    Ok(Some(listener))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_loop_that_stops_turning_stops_the_watchdog() {
        let (alive, stuck) = (Monitor::new("alive"), Monitor::new("stuck"));
        alive.beat();
        stuck.beat();
        let period = Duration::from_millis(100);
        assert!(stalled([&alive, &stuck].into_iter(), period).is_empty());
        std::thread::sleep(Duration::from_millis(70));
        alive.beat();
        assert_eq!(stalled([&alive, &stuck].into_iter(), period), ["stuck"]);
    }
}
