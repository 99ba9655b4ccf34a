//! The vision encoder's own thread. Encoding an image takes seconds to tens of seconds on a
//! CPU (Gemma 3 4B's SigLIP over 896 x 896 pixels), many decode steps' worth; run inside a
//! step it would stall every other request's stream for that long (llama-server does). Here
//! the engine hands an image to this thread when its request arrives
//! ([`crate::engine::Engine::start_encodes`]) and admits the request once the embeddings are
//! back, while the other requests go on stepping.
//!
//! The thread runs the encoder on a pool of its own, as wide as the engine's, at a lower
//! priority ([`BACKGROUND_NICE`], inherited by the pool's workers): the cores go to the
//! engine's steps first and the encoder takes what they leave, which is everything when
//! nothing else runs. A job whose image nobody waits for any more is given up between two of
//! the encoder's layers.

use super::preprocess::RgbImage;
use super::VisionEncoder;
use inferd_kernels::pool::{lower_thread_priority, ThreadPool};
use inferd_kernels::Kernels;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// How many nice steps below the engine the encoder runs: its threads get about a tenth of a
/// core the engine's want too (Linux's weights for nice 0 and 10 are 1024 and 110).
pub const BACKGROUND_NICE: i32 = 10;

/// One image to encode.
struct Job {
    id: u64,
    hash: u128,
    image: Arc<RgbImage>,
    stop: Arc<AtomicBool>,
}

/// What became of a job.
#[derive(Debug)]
pub struct Encoded {
    /// The job's number ([`EncodeWorker::submit`]).
    pub id: u64,
    /// The image's pixel hash.
    pub hash: u128,
    pub rows: Result<Arc<[f32]>, EncodeFailure>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EncodeFailure {
    /// Its stop flag was raised.
    Stopped,
    /// The encoder failed on it (a panic, caught: the thread goes on).
    Failed(String),
}

/// The encoder thread; dropping it stops the job under way and waits for the thread.
#[derive(Debug)]
pub struct EncodeWorker {
    jobs: Option<Sender<Job>>,
    done: Receiver<Encoded>,
    closing: Arc<AtomicBool>,
    next: u64,
    /// Jobs queued and not answered yet: where the thread is gone, they answer as failed,
    /// so that nobody waits for them for ever.
    outstanding: Vec<(u64, u128)>,
    thread: Option<JoinHandle<()>>,
}

impl EncodeWorker {
    /// Starts the thread and its pool of `threads` threads in all.
    pub fn start(encoder: Arc<VisionEncoder>, threads: usize) -> std::io::Result<EncodeWorker> {
        let (jobs, inbox) = channel::<Job>();
        let (results, done) = channel();
        let closing = Arc::new(AtomicBool::new(false));
        let closed = Arc::clone(&closing);
        let thread = std::thread::Builder::new().name("inferd-vision".into()).spawn(move || {
            // Best effort: where the priority cannot be lowered the encoder still works, as an
            // equal of the engine's threads.
            let _ = lower_thread_priority(BACKGROUND_NICE);
            let pool = ThreadPool::new(threads);
            let k = Kernels::detect();
            for job in inbox {
                let stop = || job.stop.load(Relaxed) || closed.load(Relaxed);
                let rows = match catch_unwind(AssertUnwindSafe(|| encoder.encode_until(&pool, &k, &job.image, &stop))) {
                    Ok(Some(rows)) => Ok(rows.into()),
                    Ok(None) => Err(EncodeFailure::Stopped),
                    Err(_) => Err(EncodeFailure::Failed("the vision encoder failed on this image".into())),
                };
                if results.send(Encoded { id: job.id, hash: job.hash, rows }).is_err() {
                    return;
                }
            }
        })?;
        let (jobs, next, outstanding) = (Some(jobs), 0, Vec::new());
        Ok(EncodeWorker { jobs, done, closing, next, outstanding, thread: Some(thread) })
    }

    /// Queues `image` (pixel hash `hash`); returns the job's number and its stop flag.
    pub fn submit(&mut self, hash: u128, image: Arc<RgbImage>) -> (u64, Arc<AtomicBool>) {
        let (id, stop) = (self.next, Arc::new(AtomicBool::new(false)));
        self.next += 1;
        self.outstanding.push((id, hash));
        if let Some(jobs) = &self.jobs {
            // A send fails only where the thread is gone; the job then answers as failed.
            let _ = jobs.send(Job { id, hash, image, stop: Arc::clone(&stop) });
        }
        (id, stop)
    }

    /// A finished job, if one is waiting.
    pub fn try_take(&mut self) -> Option<Encoded> {
        match self.done.try_recv() {
            Ok(e) => Some(self.answered(e)),
            Err(TryRecvError::Empty) => None,
            Err(TryRecvError::Disconnected) => self.orphan(),
        }
    }

    /// A finished job, waiting up to `timeout` for one.
    pub fn wait(&mut self, timeout: Duration) -> Option<Encoded> {
        match self.done.recv_timeout(timeout) {
            Ok(e) => Some(self.answered(e)),
            Err(RecvTimeoutError::Timeout) => None,
            Err(RecvTimeoutError::Disconnected) => self.orphan(),
        }
    }

    fn answered(&mut self, e: Encoded) -> Encoded {
        self.outstanding.retain(|&(id, _)| id != e.id);
        e
    }

    /// A job the gone thread left unanswered, as failed.
    fn orphan(&mut self) -> Option<Encoded> {
        let (id, hash) = self.outstanding.pop()?;
        Some(Encoded { id, hash, rows: Err(EncodeFailure::Failed("the vision encoder has stopped".into())) })
    }
}

impl Drop for EncodeWorker {
    fn drop(&mut self) {
        self.closing.store(true, Relaxed);
        self.jobs = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
