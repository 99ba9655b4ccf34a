//! The daemon: an engine thread per model ([`engine_loop`]) behind the API edges.
//!
//! Only the engine loop exists so far; the Unix-socket HTTP edge, D-Bus, systemd integration and
//! configuration arrive next (issue 4).

pub mod bench;
pub mod engine_loop;
