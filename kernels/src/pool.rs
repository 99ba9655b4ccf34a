//! A small persistent thread pool for data-parallel kernels.
//!
//! Decode runs a few hundred matrix products per token, each tens of microseconds long, so waking
//! workers must cost far less than that: workers spin briefly on a generation counter before they
//! park on a condition variable (the scheme of llama.cpp's ggml threadpool). The calling thread
//! takes part in every job. Tasks are claimed from a shared atomic counter, so uneven tasks balance.
//!
//! Background work ([`lower_thread_priority`]): a thread that lowers its own priority before it
//! makes a pool gets workers of the same priority (Linux's nice value is per thread and a new
//! thread inherits its creator's), so a second pool, such as the vision encoder's, yields the
//! cores to the engine's steps and takes what they leave.
//!
//! Where a step's time goes ([`ThreadPool::set_timing`], [`PoolTime`]): the calling thread's
//! clock splits each dispatch into its own tasks and its wait for the workers to finish theirs.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering::Relaxed, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle worker spins before it parks.
const SPIN: Duration = Duration::from_micros(200);

/// Items below which [`ThreadPool::for_rows`] stays on the calling thread: a decode step's few
/// rows cost less than waking the workers.
const PARALLEL_ROWS_MIN: usize = 1 << 15;

struct Job<'a> {
    task: &'a (dyn Fn(usize) + Sync),
    n_tasks: usize,
    next: AtomicUsize,
    done: AtomicUsize,
    panicked: AtomicBool,
}

impl Job<'_> {
    /// Claims and runs tasks until none are left.
    fn work(&self) {
        loop {
            let i = self.next.fetch_add(1, SeqCst);
            if i >= self.n_tasks {
                return;
            }
            if catch_unwind(AssertUnwindSafe(|| (self.task)(i))).is_err() {
                self.panicked.store(true, SeqCst);
            }
            self.done.fetch_add(1, SeqCst);
        }
    }
}

struct Shared {
    generation: AtomicU64,
    /// The current job (type-erased `Job<'_>`), null between jobs.
    job: AtomicPtr<()>,
    /// Workers currently holding a pointer to the job.
    active: AtomicUsize,
    /// Workers parked (or about to park) on `wake`: a job only takes the lock and makes the
    /// wake-up system call when some worker is asleep.
    sleepers: AtomicUsize,
    shutdown: AtomicBool,
    lock: Mutex<()>,
    wake: Condvar,
}

/// What the calling thread spent in the dispatches it timed ([`ThreadPool::set_timing`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolTime {
    /// Calls of [`ThreadPool::run`] (a single-task job too: it runs on the caller alone).
    pub dispatches: u64,
    /// In the tasks the caller claimed.
    pub work: Duration,
    /// After its last task, until every worker had finished and let go of the job.
    pub wait: Duration,
}

impl std::ops::Sub for PoolTime {
    type Output = PoolTime;
    /// The dispatches between two readings of [`ThreadPool::time`], `self` the later.
    fn sub(self, earlier: PoolTime) -> PoolTime {
        PoolTime {
            dispatches: self.dispatches - earlier.dispatches,
            work: self.work.saturating_sub(earlier.work),
            wait: self.wait.saturating_sub(earlier.wait),
        }
    }
}

impl std::ops::AddAssign for PoolTime {
    /// Adds another stretch's dispatches to these.
    fn add_assign(&mut self, more: PoolTime) {
        self.dispatches += more.dispatches;
        self.work += more.work;
        self.wait += more.wait;
    }
}

/// The caller's clock over dispatches, counted while `on`; nanoseconds.
#[derive(Default)]
struct Timing {
    on: AtomicBool,
    dispatches: AtomicU64,
    work: AtomicU64,
    wait: AtomicU64,
}

/// A fixed set of worker threads; see the module docs.
pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// Serializes callers: one job at a time.
    running: Mutex<()>,
    timing: Timing,
}

impl std::fmt::Debug for ThreadPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ThreadPool({} threads)", self.threads())
    }
}

impl ThreadPool {
    /// A pool running jobs on `threads` threads in all (the caller plus `threads - 1` workers).
    pub fn new(threads: usize) -> Self {
        let shared = Arc::new(Shared {
            generation: AtomicU64::new(0),
            job: AtomicPtr::new(std::ptr::null_mut()),
            active: AtomicUsize::new(0),
            sleepers: AtomicUsize::new(0),
            shutdown: AtomicBool::new(false),
            lock: Mutex::new(()),
            wake: Condvar::new(),
        });
        let workers = (1..threads.max(1))
            .map(|i| {
                let s = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("inferd-worker-{i}"))
                    .spawn(move || worker(&s))
                    .expect("spawning a kernel worker thread")
            })
            .collect();
        ThreadPool { shared, workers, running: Mutex::new(()), timing: Timing::default() }
    }

    /// The number of threads a job runs on, the caller included.
    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Starts or stops timing dispatches ([`ThreadPool::time`]); off, a dispatch costs one
    /// relaxed load more.
    pub fn set_timing(&self, on: bool) {
        self.timing.on.store(on, Relaxed);
    }

    /// The dispatches timed so far and the caller's time in them (readings are compared by
    /// subtraction).
    pub fn time(&self) -> PoolTime {
        let t = &self.timing;
        PoolTime {
            dispatches: t.dispatches.load(Relaxed),
            work: Duration::from_nanos(t.work.load(Relaxed)),
            wait: Duration::from_nanos(t.wait.load(Relaxed)),
        }
    }

    /// Runs `task(i)` for every `i < n_tasks` across the pool and returns when all have finished.
    /// A panicking task is re-raised here after the others finish.
    pub fn run(&self, n_tasks: usize, task: &(dyn Fn(usize) + Sync)) {
        if n_tasks == 0 {
            return;
        }
        if !self.timing.on.load(Relaxed) {
            return self.dispatch(n_tasks, task, &mut || {});
        }
        let start = Instant::now();
        let mut worked = None;
        self.dispatch(n_tasks, task, &mut || worked = Some(Instant::now()));
        let (end, t) = (Instant::now(), &self.timing);
        let worked = worked.unwrap_or(end);
        let nanos = |d: Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        t.dispatches.fetch_add(1, Relaxed);
        t.work.fetch_add(nanos(worked - start), Relaxed);
        t.wait.fetch_add(nanos(end - worked), Relaxed);
    }

    /// `f(first, rows)` over `data` cut into runs of whole rows of `row_len` items (`first`:
    /// the run's first row), one run per thread, where `data` is large enough to pay for a
    /// dispatch; else `f(0, data)` on the calling thread. Each row sees the same arithmetic
    /// either way: for a forward pass's per-token work between its products (norms, the
    /// activation quantization, the gates), which at a prefill's hundreds of tokens would
    /// otherwise leave every other core idle.
    pub fn for_rows<T: Send>(&self, data: &mut [T], row_len: usize, f: &(dyn Fn(usize, &mut [T]) + Sync)) {
        let rows = data.len() / row_len.max(1);
        if self.threads() == 1 || data.len() < PARALLEL_ROWS_MIN || rows < 2 || row_len == 0 {
            return f(0, data);
        }
        self.for_runs(data, row_len, rows.div_ceil(self.threads()), f);
    }

    /// `f(first, rows)` over `data` cut into runs of `per` whole rows of `row_len` items (the
    /// last may be shorter), the threads taking runs as they finish the last: for long work
    /// whose runs are many more than the threads, so that a thread slowed by others on its
    /// core does not hold up the rest.
    pub fn for_runs<T: Send>(&self, data: &mut [T], row_len: usize, per: usize, f: &(dyn Fn(usize, &mut [T]) + Sync)) {
        let per = per.max(1);
        if row_len == 0 || data.is_empty() {
            return f(0, data);
        }
        // Each task takes its own run out of its lock: distinct `&mut` runs without unsafe.
        let runs: Vec<Mutex<&mut [T]>> = data.chunks_mut(per * row_len).map(Mutex::new).collect();
        self.run(runs.len(), &|i| {
            let mut run = runs[i].lock().unwrap_or_else(|e| e.into_inner());
            f(i * per, &mut run);
        });
    }

    /// [`ThreadPool::run`]'s job; `worked` is called when the caller has run out of tasks.
    fn dispatch(&self, n_tasks: usize, task: &(dyn Fn(usize) + Sync), worked: &mut dyn FnMut()) {
        let job = Job {
            task,
            n_tasks,
            next: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
        };
        if self.workers.is_empty() || n_tasks == 1 {
            job.work();
            worked();
        } else {
            let _serial = self.running.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.job.store(&job as *const Job<'_> as *mut (), SeqCst);
            self.shared.generation.fetch_add(1, SeqCst);
            // A worker raises `sleepers` under the lock before it re-checks the generation, so
            // either it sees the new generation or we see it asleep and wake it.
            if self.shared.sleepers.load(SeqCst) > 0 {
                drop(self.shared.lock.lock().unwrap_or_else(|e| e.into_inner()));
                self.shared.wake.notify_all();
            }
            job.work();
            worked();
            while job.done.load(SeqCst) < n_tasks {
                std::hint::spin_loop();
            }
            // Retire the job, then wait until no worker still holds a pointer to it (it lives on
            // this stack frame).
            self.shared.job.store(std::ptr::null_mut(), SeqCst);
            while self.shared.active.load(SeqCst) != 0 {
                std::hint::spin_loop();
            }
        }
        if job.panicked.load(SeqCst) {
            panic!("a kernel task panicked");
        }
    }
}

fn worker(s: &Shared) {
    let mut seen = s.generation.load(SeqCst);
    loop {
        let start = Instant::now();
        let mut spins = 0u32;
        while s.generation.load(SeqCst) == seen && !s.shutdown.load(SeqCst) {
            std::hint::spin_loop();
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(1024) && start.elapsed() > SPIN {
                let guard = s.lock.lock().unwrap_or_else(|e| e.into_inner());
                s.sleepers.fetch_add(1, SeqCst);
                if s.generation.load(SeqCst) == seen && !s.shutdown.load(SeqCst) {
                    drop(s.wake.wait(guard).unwrap_or_else(|e| e.into_inner()));
                } else {
                    drop(guard);
                }
                s.sleepers.fetch_sub(1, SeqCst);
            }
        }
        if s.shutdown.load(SeqCst) {
            return;
        }
        seen = s.generation.load(SeqCst);
        s.active.fetch_add(1, SeqCst);
        let ptr = s.job.load(SeqCst);
        if !ptr.is_null() {
            // SAFETY: a non-null job pointer was loaded after `active` was raised, so the caller in
            // `run` is still waiting (it nulls the pointer, then waits for `active == 0`) and the
            // `Job` on its stack is alive until we lower `active` below.
            let job = unsafe { &*(ptr as *const Job<'_>) };
            job.work();
        }
        s.active.fetch_sub(1, SeqCst);
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, SeqCst);
        drop(self.shared.lock.lock().unwrap_or_else(|e| e.into_inner()));
        self.shared.wake.notify_all();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

/// Lowers the calling thread's scheduling priority by `by` nice steps (at most to 19, the
/// lowest) and returns its nice value after. Threads it creates afterwards start at that value.
/// Raising a priority needs a privilege, lowering one does not.
pub fn lower_thread_priority(by: i32) -> std::io::Result<i32> {
    // SAFETY: gettid has no preconditions and cannot fail.
    let tid = unsafe { libc::syscall(libc::SYS_gettid) } as libc::id_t;
    let now = thread_nice(tid)?;
    let nice = (now + by.max(0)).min(19);
    // SAFETY: PRIO_PROCESS with a thread id of this process changes that thread alone (Linux's
    // nice is per thread); no memory is passed.
    if unsafe { libc::setpriority(libc::PRIO_PROCESS, tid, nice) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    thread_nice(tid)
}

/// The nice value of thread `tid` of this process.
fn thread_nice(tid: libc::id_t) -> std::io::Result<i32> {
    // getpriority returns the value itself, so -1 is an error only when errno says so.
    // SAFETY: errno is this thread's; clearing it first is how getpriority's man page says to
    // tell -1 from an error.
    unsafe { *libc::__errno_location() = 0 };
    // SAFETY: as for setpriority above; it only reads.
    let nice = unsafe { libc::getpriority(libc::PRIO_PROCESS, tid) };
    let err = std::io::Error::last_os_error();
    match (nice, err.raw_os_error()) {
        (-1, Some(e)) if e != 0 => Err(err),
        _ => Ok(nice),
    }
}

/// A raw pointer that kernels share across tasks writing disjoint parts of one output buffer.
#[derive(Clone, Copy)]
pub struct SyncPtr<T>(pub *mut T);
// SAFETY: users only write disjoint elements through it from different tasks (each use says why).
unsafe impl<T: Send> Send for SyncPtr<T> {}
// SAFETY: as above.
unsafe impl<T: Send> Sync for SyncPtr<T> {}

impl<T> SyncPtr<T> {
    /// The pointer (a method, so closures capture the whole `Sync` wrapper, not the raw field).
    #[inline]
    pub fn get(self) -> *mut T {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn for_rows_gives_every_row_once_with_its_index() {
        let pool = ThreadPool::new(3);
        // Below and above the size that goes parallel, rows that do and do not divide evenly.
        let mut empty = vec![1u8; 1 << 16];
        pool.for_rows(&mut empty, 0, &|first, run| assert_eq!((first, run.len()), (0, 1 << 16), "rows of nothing"));
        for (rows, width) in [(1, 8), (5, 16), (1000, 64), (1001, 33), (7, 1 << 13)] {
            let mut data = vec![0usize; rows * width];
            let calls = AtomicUsize::new(0);
            pool.for_rows(&mut data, width, &|first, run| {
                calls.fetch_add(1, SeqCst);
                assert_eq!(run.len() % width, 0, "whole rows");
                for (i, row) in run.chunks_exact_mut(width).enumerate() {
                    row.iter_mut().for_each(|v| *v += first + i + 1);
                }
            });
            let want: Vec<usize> = (0..rows * width).map(|i| i / width + 1).collect();
            assert_eq!(data, want, "{rows} rows of {width}");
            let parallel = rows * width >= PARALLEL_ROWS_MIN && rows >= 2;
            assert_eq!(calls.load(SeqCst) > 1, parallel, "{rows} rows of {width}");
        }
    }

    #[test]
    fn for_runs_gives_every_row_once_in_runs_of_the_size_asked() {
        let pool = ThreadPool::new(2);
        for (rows, per) in [(0, 4), (1, 4), (10, 3), (96, 96), (1000, 7)] {
            let width = 5;
            let mut data = vec![0usize; rows * width];
            let calls = AtomicUsize::new(0);
            pool.for_runs(&mut data, width, per, &|first, run| {
                calls.fetch_add(1, SeqCst);
                assert_eq!(first % per, 0, "runs start at multiples of {per}");
                assert!(run.len() == per * width || first + run.len() / width == rows, "only the last run is short");
                for (i, row) in run.chunks_exact_mut(width).enumerate() {
                    row.iter_mut().for_each(|v| *v += first + i + 1);
                }
            });
            let want: Vec<usize> = (0..rows * width).map(|i| i / width + 1).collect();
            assert_eq!(data, want, "{rows} rows in runs of {per}");
            assert_eq!(calls.load(SeqCst), rows.div_ceil(per).max(1), "{rows} rows in runs of {per}");
        }
    }

    #[test]
    fn a_lowered_thread_and_its_pools_workers_run_at_the_lower_priority() {
        // In a thread of its own: the test harness's thread keeps its priority.
        let seen = std::thread::spawn(|| {
            let before = thread_nice(0).expect("reading the nice value");
            let after = lower_thread_priority(5).expect("lowering the priority");
            let pool = ThreadPool::new(3);
            let nices: Vec<Mutex<Option<i32>>> = (0..64).map(|_| Mutex::new(None)).collect();
            pool.run(64, &|i| {
                // SAFETY: gettid has no preconditions.
                let tid = unsafe { libc::syscall(libc::SYS_gettid) } as libc::id_t;
                std::thread::sleep(Duration::from_millis(1));
                *nices[i].lock().unwrap() = thread_nice(tid).ok();
            });
            (before, after, nices.into_iter().map(|m| m.into_inner().unwrap()).collect::<Vec<_>>())
        })
        .join()
        .unwrap();
        let (before, after, nices) = seen;
        assert_eq!(after, (before + 5).min(19));
        assert!(nices.iter().all(|&n| n == Some(after)), "{nices:?}");
        assert_eq!(thread_nice(0).unwrap(), before, "the other threads keep theirs");
    }

    #[test]
    fn runs_every_task_once() {
        let pool = ThreadPool::new(3);
        for n in [1, 2, 7, 1000] {
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            pool.run(n, &|i| {
                hits[i].fetch_add(1, SeqCst);
            });
            assert!(hits.iter().all(|h| h.load(SeqCst) == 1));
        }
    }

    #[test]
    fn survives_idle_periods_and_panics() {
        let pool = ThreadPool::new(2);
        std::thread::sleep(Duration::from_millis(5));
        let r = catch_unwind(AssertUnwindSafe(|| pool.run(4, &|i| assert_ne!(i, 2))));
        assert!(r.is_err());
        let count = AtomicUsize::new(0);
        pool.run(8, &|_| {
            count.fetch_add(1, SeqCst);
        });
        assert_eq!(count.load(SeqCst), 8);
    }

    #[test]
    fn timing_counts_the_callers_dispatches_only_while_on() {
        let pool = ThreadPool::new(2);
        let nap = |_| std::thread::sleep(Duration::from_millis(10));
        pool.run(2, &nap);
        assert_eq!(pool.time(), PoolTime::default(), "off: nothing counted");
        pool.set_timing(true);
        pool.run(1, &nap);
        let one = pool.time();
        assert_eq!(one.dispatches, 1);
        assert!(one.work >= Duration::from_millis(10) && one.wait < Duration::from_millis(10), "{one:?}");
        // Two naps: the caller runs one or both, and waits for the worker's when it runs one.
        pool.run(2, &nap);
        let two = pool.time() - one;
        assert_eq!(two.dispatches, 1);
        assert!(two.work >= Duration::from_millis(10) && two.work + two.wait >= Duration::from_millis(10), "{two:?}");
        pool.set_timing(false);
        pool.run(2, &nap);
        assert_eq!(pool.time() - one, two, "off again: nothing more counted");
    }
}
