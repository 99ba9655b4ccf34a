//! A model's engine thread behind one handle, the engine crate's entry point for a service:
//! [`EngineHandle::start`] opens the engine on its backend (and a draft model's, for
//! speculative decoding: half the KV budget, its own backend), spawns the thread that owns
//! them and runs the loop ([`engine_loop`]), and returns the handle. Requests go in as the
//! loop's closed [`Command`]s ([`EngineHandle::submit`], [`EngineHandle::embed`],
//! [`EngineHandle::cancel`]); what the loop does comes out through the [`Monitor`] of its
//! [`LoopConfig`]; [`EngineHandle::stop`] ends the thread. The engine, its KV cache and its
//! backend live on that thread alone: nothing outside reads them.

use super::{engine_loop, Command, Embedding, LoopConfig, RequestId, Submission};
use crate::backend::{BackendKind, DeviceMemory};
use crate::decode::store::EngineStore;
use crate::engine::{Engine, EngineError, EngineOptions};
use crate::model::Model;
use std::sync::mpsc::Sender;
use std::sync::Mutex;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// What a model's engine thread is started with.
pub struct Launch<'a> {
    pub model: &'a Model,
    pub backend: BackendKind,
    pub options: EngineOptions,
    /// A draft model for speculative decoding and the backend it runs on.
    pub draft: Option<(&'a Model, BackendKind)>,
    pub config: LoopConfig,
}

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("starting the engine thread: {0}")]
    Thread(std::io::Error),
}

/// A running engine thread.
#[derive(Debug)]
pub struct EngineHandle {
    tx: Mutex<Sender<Command>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    backend: String,
    device_memory: Option<DeviceMemory>,
}

/// How a stop ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stopped {
    /// The thread ended (or had ended before).
    Ended,
    /// It had not ended by the deadline (a step inside a call that never returns).
    Stuck,
}

impl EngineHandle {
    /// Opens `launch.model`'s engine (a model the backend cannot run fails here, before any
    /// thread) and starts its thread, named `name`.
    pub fn start(name: &str, launch: Launch<'_>) -> Result<EngineHandle, StartError> {
        let (mut engine, why) = Engine::open_with_reason(launch.model, launch.backend, &launch.options)?;
        let backend = format!("{} ({}; {why})", engine.backend.name(), engine.backend.device());
        let device_memory = engine.backend.device_memory();
        let draft = match launch.draft {
            Some((d, kind)) => {
                // On the target's threads: the draft's steps and the target's alternate.
                let opts = EngineOptions {
                    kv_budget_bytes: launch.options.kv_budget_bytes / 2,
                    pool: engine.backend.cpu_pool(),
                    ..launch.options
                };
                Some(Engine::open(d, kind, &opts)?)
            }
            None => None,
        };
        let (tx, rx) = std::sync::mpsc::channel();
        let cfg = launch.config;
        let thread = std::thread::Builder::new()
            .name(format!("inferd-engine-{name}"))
            .spawn(move || {
                match draft {
                    Some(mut d) => engine_loop(&mut EngineStore::with_draft(&mut engine, &mut d), &rx, &cfg),
                    None => engine_loop(&mut EngineStore::new(&mut engine), &rx, &cfg),
                };
            })
            .map_err(StartError::Thread)?;
        Ok(EngineHandle { tx: Mutex::new(tx), thread: Mutex::new(Some(thread)), backend, device_memory })
    }

    /// Where it runs and why that backend: `cpu (Avx512Vnni; auto: no usable GPU (...))`.
    pub fn backend(&self) -> &str {
        &self.backend
    }

    /// GPU memory its weights and KV pool take (none on the CPU backend).
    pub fn device_memory(&self) -> Option<DeviceMemory> {
        self.device_memory
    }

    /// Sends `cmd`: false when the thread has ended.
    pub fn send(&self, cmd: Command) -> bool {
        self.tx.lock().map(|tx| tx.send(cmd).is_ok()).unwrap_or(false)
    }

    /// Queues a request: false when the thread has ended.
    pub fn submit(&self, s: Submission) -> bool {
        self.send(Command::Submit(s))
    }

    /// Queues an embedding job: false when the thread has ended.
    pub fn embed(&self, e: Embedding) -> bool {
        self.send(Command::Embed(e))
    }

    /// Cancels a request or an embedding job, wherever it is.
    pub fn cancel(&self, id: RequestId) {
        self.send(Command::Cancel(id));
    }

    /// Ends a request as finished (its client has what it wanted: a stop string matched).
    pub fn finish(&self, id: RequestId) {
        self.send(Command::Stop(id));
    }

    /// Asks the loop to end (everything in it cancelled) without waiting for it.
    pub fn shut_down(&self) {
        self.send(Command::Shutdown);
    }

    /// Asks the loop to end (everything in it cancelled) and waits for the thread until
    /// `deadline` (none: as long as it takes).
    pub fn stop(&self, deadline: Option<Instant>) -> Stopped {
        self.send(Command::Shutdown);
        let Some(t) = self.thread.lock().ok().and_then(|mut t| t.take()) else { return Stopped::Ended };
        if let Some(deadline) = deadline {
            while !t.is_finished() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            if !t.is_finished() {
                return Stopped::Stuck;
            }
        }
        let _ = t.join();
        Stopped::Ended
    }
}
