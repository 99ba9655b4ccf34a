//! The daemon: an engine thread per model ([`engine_loop`]) behind the API edges.
//!
//! So far: the engine loop and the HTTP edge on a Unix socket ([`http`]). D-Bus, systemd
//! integration, configuration and fairness arrive next (issue 4).

pub mod bench;
pub mod engine_loop;
pub mod http;

use crate::decode::store::EngineStore;
use crate::engine::{Engine, EngineOptions};
use crate::model::Model;
use crate::plugin::Registry;
use engine_loop::{engine_loop, LoopConfig};
use std::path::Path;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

/// Serves `model` on the Unix socket `socket` until the process ends.
pub fn run(model: Arc<Model>, registry: Arc<Registry>, socket: &Path, threads: usize) -> anyhow::Result<()> {
    let (tx, rx) = std::sync::mpsc::channel();
    let m = Arc::clone(&model);
    std::thread::Builder::new().name("inferd-engine".into()).spawn(move || {
        let mut engine = Engine::cpu(&m, &EngineOptions { threads, ..EngineOptions::default() });
        let mut store = EngineStore::new(&mut engine);
        engine_loop(&mut store, &rx, &LoopConfig { token_budget: 512, max_running: 64, eos: m.tokenizer.eos().to_vec() })
    })?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
    rt.block_on(async move {
        if let Some(dir) = socket.parent() {
            std::fs::create_dir_all(dir)?;
        }
        // A socket file left by a previous run would make bind fail.
        if socket.exists() {
            std::fs::remove_file(socket)?;
        }
        let listener = tokio::net::UnixListener::bind(socket)?;
        eprintln!("inferd: serving {} on {}", model.name, socket.display());
        let state = Arc::new(http::AppState { model, registry, engine: Mutex::new(tx), next_id: AtomicU64::new(1) });
        axum::serve(listener, http::router(state)).await?;
        Ok(())
    })
}
