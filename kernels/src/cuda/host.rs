//! The kernels run on the host, for tests on machines without a GPU: `kernels/cuda` compiled
//! as C++ against `host_shim.h` (a block's threads are fibers switched at `__syncthreads` and
//! at the warp shuffles, which wait for the block's or the warp's threads) into one harness
//! program, a server that runs each launch sent to it. A [`Host`] is a [`Stream`] whose buffers are vectors, so the typed calls and the
//! CUDA backend's forward pass run here exactly as they are written for the GPU, launch
//! geometry included; only the device's own arithmetic and memory differ.

use super::stream::{Arg, Elem, GemmShape, GpuError, Stream};
use super::SOURCES;
use std::io::{BufReader, Read, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

const SHIM: &str = include_str!("../../cuda/host_shim.h");
const HARNESS: &str = include_str!("../../cuda/host_harness.cpp");

/// The harness process and its pipes.
struct Session {
    child: Child,
    to: ChildStdin,
    from: BufReader<ChildStdout>,
}

impl Drop for Session {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The host emulation of a GPU stream; clones share the harness.
#[derive(Clone)]
pub struct Host {
    session: Arc<Mutex<Session>>,
    launches: Arc<AtomicUsize>,
    gemms: Arc<AtomicUsize>,
}

fn io(what: &str, e: std::io::Error) -> GpuError {
    GpuError::Host(format!("{what}: {e}"))
}

impl Host {
    /// Compiles the harness in `dir` (a C++20 compiler, `c++`, must be installed) and starts it.
    pub fn new(dir: &Path) -> Result<Host, GpuError> {
        std::fs::create_dir_all(dir).map_err(|e| io("creating the work directory", e))?;
        for (name, src) in SOURCES.iter().chain(&[("host_shim.h", SHIM), ("host_harness.cpp", HARNESS)]) {
            std::fs::write(dir.join(name), src).map_err(|e| io("writing the sources", e))?;
        }
        let exe = dir.join("harness");
        let out = Command::new("c++")
            .args(["-std=c++20", "-O1", "-ffp-contract=off", "-U_FORTIFY_SOURCE", "-o"])
            .arg(&exe)
            .arg(dir.join("host_harness.cpp"))
            .output()
            .map_err(|e| io("running the C++ compiler (c++)", e))?;
        if !out.status.success() {
            return Err(GpuError::Host(format!("compiling the harness: {}", String::from_utf8_lossy(&out.stderr))));
        }
        let mut child = Command::new(&exe)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| io("starting the harness", e))?;
        let (Some(to), Some(from)) = (child.stdin.take(), child.stdout.take()) else {
            return Err(GpuError::Host("the harness has no pipes".into()));
        };
        let session = Session { child, to, from: BufReader::new(from) };
        Ok(Host {
            session: Arc::new(Mutex::new(session)),
            launches: Arc::new(AtomicUsize::new(0)),
            gemms: Arc::new(AtomicUsize::new(0)),
        })
    }

    /// How many kernels have run (on this harness, all clones together).
    pub fn launches(&self) -> usize {
        self.launches.load(Ordering::Relaxed)
    }

    /// How many products of halves have run ([`Stream::gemm_half`]), all clones together.
    pub fn gemms(&self) -> usize {
        self.gemms.load(Ordering::Relaxed)
    }
}

fn bytes<T: Elem>(v: &[T]) -> Vec<u8> {
    let mut out = Vec::with_capacity(std::mem::size_of_val(v));
    v.iter().for_each(|x| x.put(&mut out));
    out
}

fn read_u32(r: &mut impl Read) -> std::io::Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

/// A written-back buffer's bytes into `into`.
fn read_back<T: Elem>(r: &mut impl Read, into: &mut [T]) -> Result<(), GpuError> {
    let mut len = [0u8; 8];
    r.read_exact(&mut len).map_err(|e| io("reading a kernel's output", e))?;
    let size = std::mem::size_of::<T>();
    let len = u64::from_le_bytes(len) as usize;
    if len != std::mem::size_of_val(into) {
        return Err(GpuError::Host(format!("{len} bytes back for {} elements", into.len())));
    }
    let mut raw = vec![0u8; len];
    r.read_exact(&mut raw).map_err(|e| io("reading a kernel's output", e))?;
    into.iter_mut().zip(raw.chunks_exact(size)).for_each(|(x, b)| *x = T::get(b));
    Ok(())
}

impl Stream for Host {
    type Buf<T: Elem> = Vec<T>;

    fn describe(&self) -> String {
        "the host emulation of the CUDA kernels".into()
    }

    fn upload<T: Elem>(&self, data: &[T]) -> Result<Vec<T>, GpuError> {
        Ok(if data.is_empty() { vec![T::default()] } else { data.to_vec() })
    }

    fn zeros<T: Elem>(&self, n: usize) -> Result<Vec<T>, GpuError> {
        Ok(vec![T::default(); n.max(1)])
    }

    fn download<T: Elem>(&self, buf: &Vec<T>) -> Result<Vec<T>, GpuError> {
        Ok(buf.clone())
    }

    fn len<T: Elem>(buf: &Vec<T>) -> usize {
        buf.len()
    }

    fn device_memory(&self) -> Result<Option<(usize, usize)>, GpuError> {
        Ok(None)
    }

    unsafe fn launch(
        &self,
        name: &'static str,
        grid: (u32, u32),
        block: (u32, u32),
        args: &mut [Arg<'_, Self>],
    ) -> Result<(), GpuError> {
        self.launches.fetch_add(1, Ordering::Relaxed);
        let mut req = Vec::new();
        req.extend_from_slice(&(name.len() as u32).to_le_bytes());
        req.extend_from_slice(name.as_bytes());
        for v in [grid.0, grid.1, block.0, block.1, args.len() as u32] {
            req.extend_from_slice(&v.to_le_bytes());
        }
        for a in args.iter() {
            let (back, b) = match a {
                Arg::U8(x) => (false, x.to_vec()),
                Arg::U8Mut(x) => (true, x.to_vec()),
                Arg::I32(x) => (false, bytes(x)),
                Arg::I32Mut(x) => (true, bytes(x)),
                Arg::U16(x) => (false, bytes(x)),
                Arg::U16Mut(x) => (true, bytes(x)),
                Arg::F32(x) => (false, bytes(x)),
                Arg::F32Mut(x) => (true, bytes(x)),
                Arg::Int(v) => (false, v.to_le_bytes().to_vec()),
                Arg::Long(v) => (false, v.to_le_bytes().to_vec()),
                Arg::Float(v) => (false, v.to_le_bytes().to_vec()),
            };
            req.push(u8::from(back));
            req.extend_from_slice(&(b.len() as u64).to_le_bytes());
            req.extend_from_slice(&b);
        }
        let mut guard = self.session.lock().map_err(|_| GpuError::Host("a launch panicked".into()))?;
        let session = &mut *guard;
        session.to.write_all(&req).and_then(|_| session.to.flush()).map_err(|e| io("sending a launch", e))?;
        let status = read_u32(&mut session.from).map_err(|e| io("the harness's answer", e))?;
        if status != 0 {
            let len = read_u32(&mut session.from).map_err(|e| io("the harness's answer", e))?;
            let mut m = vec![0u8; len as usize];
            session.from.read_exact(&mut m).map_err(|e| io("the harness's answer", e))?;
            return Err(GpuError::Host(format!("{name}: {}", String::from_utf8_lossy(&m))));
        }
        for a in args.iter_mut() {
            match a {
                Arg::U8Mut(x) => read_back(&mut session.from, x)?,
                Arg::I32Mut(x) => read_back(&mut session.from, x)?,
                Arg::U16Mut(x) => read_back(&mut session.from, x)?,
                Arg::F32Mut(x) => read_back(&mut session.from, x)?,
                _ => {}
            }
        }
        Ok(())
    }

    fn has_gemm(&self) -> bool {
        true
    }

    /// cuBLAS's product, in the plain order: each output a sum over `k` in turn, in f32.
    unsafe fn gemm_half(&self, w: &Vec<u16>, x: &Vec<u16>, shape: GemmShape, y: &mut Vec<f32>) -> Result<(), GpuError> {
        let GemmShape { tokens, rows, cols, bf16 } = shape;
        if w.len() < rows * cols || x.len() < tokens * cols || y.len() < tokens * rows {
            return Err(GpuError::Shape { kernel: "gemm", message: format!("buffers too short for {shape:?}") });
        }
        self.gemms.fetch_add(1, Ordering::Relaxed);
        let f = |h: u16| if bf16 { half::bf16::from_bits(h).to_f32() } else { half::f16::from_bits(h).to_f32() };
        let (w, x): (Vec<f32>, Vec<f32>) = (w.iter().map(|&h| f(h)).collect(), x.iter().map(|&h| f(h)).collect());
        for t in 0..tokens {
            for r in 0..rows {
                let (wr, xt) = (&w[r * cols..(r + 1) * cols], &x[t * cols..(t + 1) * cols]);
                y[t * rows + r] = wr.iter().zip(xt).fold(0f32, |acc, (a, b)| acc + a * b);
            }
        }
        Ok(())
    }
}
