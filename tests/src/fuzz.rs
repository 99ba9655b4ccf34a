//! A mutation fuzzer that runs on stable Rust inside the test suite, for a bounded number of
//! executions per target (cargo-fuzz needs a nightly compiler, which CI does not have). Each
//! execution takes a corpus entry, applies one to four mutations (bit flips, interesting
//! integers over 1/2/4/8 bytes, byte runs inserted, deleted or duplicated, pieces spliced in
//! from another entry or from the target's dictionary) and runs the target under
//! `catch_unwind`: a panic is a crash, its input saved for replay. A corpus of JSON documents
//! also gets structure-aware mutations (values replaced by the kinds parsers trip on, keys
//! removed), which reach the checks behind the parser. The corpora are committed
//! under `tests/fuzz/corpus/TARGET/` (binary model seeds are written by the tiny-model writers
//! at run time); `INFERD_FUZZ_SCALE` multiplies every target's executions for a longer run.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// xorshift64*: reproducible from the target's name.
pub struct Mutator {
    state: u64,
    dict: Vec<Vec<u8>>,
}

const INTERESTING: [u64; 12] =
    [0, 1, 2, 0x7f, 0x80, 0xff, 0x7fff, 0xffff, 0x7fff_ffff, 0xffff_ffff, u64::MAX >> 1, u64::MAX];

impl Mutator {
    pub fn new(name: &str, dict: &[&[u8]]) -> Mutator {
        let seed = name.bytes().fold(0x9E37_79B9_7F4A_7C15u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01B3));
        Mutator { state: seed | 1, dict: dict.iter().map(|d| d.to_vec()).collect() }
    }

    fn next(&mut self) -> u64 {
        self.state ^= self.state >> 12;
        self.state ^= self.state << 25;
        self.state ^= self.state >> 27;
        self.state.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next() % n as u64) as usize
        }
    }

    /// A mutated copy of one of `corpus`.
    pub fn mutate(&mut self, corpus: &[Vec<u8>]) -> Vec<u8> {
        let mut v = corpus[self.below(corpus.len())].clone();
        for _ in 0..1 + self.below(4) {
            let at = self.below(v.len() + 1);
            match self.below(8) {
                0 if !v.is_empty() => {
                    let i = self.below(v.len());
                    v[i] ^= 1 << self.below(8);
                }
                1 if !v.is_empty() => {
                    let i = self.below(v.len());
                    v[i] = self.next() as u8;
                }
                2 => {
                    let width = [1usize, 2, 4, 8][self.below(4)];
                    let x = INTERESTING[self.below(INTERESTING.len())].to_le_bytes();
                    let end = (at + width).min(v.len());
                    let n = end - at.min(end);
                    v[at.min(end)..end].copy_from_slice(&x[..n]);
                }
                3 => {
                    let n = 1 + self.below(16);
                    let bytes: Vec<u8> = (0..n).map(|_| self.next() as u8).collect();
                    v.splice(at..at, bytes);
                }
                4 if !v.is_empty() => {
                    let n = 1 + self.below(v.len().min(64));
                    let end = (at + n).min(v.len());
                    v.drain(at.min(end)..end);
                }
                5 if !v.is_empty() => {
                    let from = self.below(v.len());
                    let n = 1 + self.below((v.len() - from).min(64));
                    let piece = v[from..from + n].to_vec();
                    v.splice(at..at, piece);
                }
                6 if !self.dict.is_empty() => {
                    let i = self.below(self.dict.len());
                    let d = self.dict[i].clone();
                    v.splice(at..at, d);
                }
                _ => {
                    let other = &corpus[self.below(corpus.len())];
                    if !other.is_empty() {
                        let from = self.below(other.len());
                        let n = 1 + self.below((other.len() - from).min(256));
                        v.splice(at..at, other[from..from + n].iter().copied());
                    }
                }
            }
        }
        v
    }
}

impl Mutator {
    /// A copy of one of `corpus` (JSON documents) with one to three values replaced, removed
    /// or duplicated: inputs that get past the parser into the checks behind it.
    pub fn mutate_json(&mut self, corpus: &[serde_json::Value]) -> Vec<u8> {
        let mut v = corpus[self.below(corpus.len())].clone();
        for _ in 0..1 + self.below(3) {
            let mut nodes = 0;
            count(&v, &mut nodes);
            let target = self.below(nodes);
            let replacement = self.value();
            let mut seen = 0;
            self.edit(&mut v, target, &mut seen, replacement);
        }
        v.to_string().into_bytes()
    }

    /// A value of the kinds parsers trip on.
    fn value(&mut self) -> serde_json::Value {
        use serde_json::json;
        match self.below(14) {
            0 => json!(null),
            1 => json!(self.below(2) == 0),
            2 => json!(INTERESTING[self.below(INTERESTING.len())]),
            3 => json!(-(self.below(1000) as i64) - 1),
            4 => json!(f64::MAX),
            5 => json!(1e-300),
            6 => json!(""),
            7 => json!("x".repeat(1 + self.below(5000))),
            8 => json!([]),
            9 => json!({}),
            10 => json!([[[[[[[[1]]]]]]]]),
            11 => json!(0.5),
            12 => {
                let i = self.below(self.dict.len());
                let d = self.dict.get(i).cloned().unwrap_or_default();
                json!(String::from_utf8_lossy(&d))
            }
            _ => json!(["a", 1, null]),
        }
    }

    fn edit(&mut self, v: &mut serde_json::Value, target: usize, seen: &mut usize, new: serde_json::Value) -> bool {
        use serde_json::Value as J;
        if *seen == target {
            *v = new;
            return true;
        }
        *seen += 1;
        match v {
            J::Array(a) => {
                for x in a.iter_mut() {
                    if self.edit(x, target, seen, new.clone()) {
                        return true;
                    }
                }
            }
            J::Object(o) => {
                let keys: Vec<String> = o.keys().cloned().collect();
                for k in keys {
                    // Now and then the key goes instead of its value.
                    if *seen == target && self.below(4) == 0 {
                        o.remove(&k);
                        return true;
                    }
                    if let Some(x) = o.get_mut(&k) {
                        if self.edit(x, target, seen, new.clone()) {
                            return true;
                        }
                    }
                }
            }
            _ => {}
        }
        false
    }
}

fn count(v: &serde_json::Value, n: &mut usize) {
    *n += 1;
    match v {
        serde_json::Value::Array(a) => a.iter().for_each(|x| count(x, n)),
        serde_json::Value::Object(o) => o.values().for_each(|x| count(x, n)),
        _ => {}
    }
}

/// What a target's run found.
#[derive(Debug)]
pub struct Report {
    pub target: String,
    pub execs: usize,
    /// Inputs that panicked, saved for replay.
    pub crashes: Vec<PathBuf>,
    pub seconds: f64,
}

/// Executions per target: `base` times `INFERD_FUZZ_SCALE` (default 1).
pub fn execs(base: usize) -> usize {
    let scale = std::env::var("INFERD_FUZZ_SCALE").ok().and_then(|s| s.parse::<usize>().ok()).unwrap_or(1);
    base * scale.max(1)
}

/// The committed corpus of `target` (every file under `tests/fuzz/corpus/TARGET/`).
pub fn corpus(target: &str) -> Vec<Vec<u8>> {
    let dir = crate::tests_dir().join("fuzz/corpus").join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    files.sort();
    files.iter().map(|p| std::fs::read(p).expect("reading a corpus file")).collect()
}

/// Runs `target` on every corpus entry, then on `n` mutated inputs; panics are caught and
/// saved under `crash_dir`.
pub fn run(
    name: &str,
    corpus: &[Vec<u8>],
    dict: &[&[u8]],
    n: usize,
    crash_dir: &Path,
    target: impl Fn(&[u8]),
) -> Report {
    let mut m = Mutator::new(name, dict);
    let t0 = Instant::now();
    let mut crashes = Vec::new();
    let inputs = corpus.iter().cloned().map(Some).chain((0..n).map(|_| None));
    // A corpus of JSON documents: every other input is mutated as JSON, past the parser.
    let json: Vec<serde_json::Value> = corpus.iter().filter_map(|c| serde_json::from_slice(c).ok()).collect();
    let json = if json.len() == corpus.len() { json } else { Vec::new() };
    let mut execs = 0;
    for seed in inputs {
        let input = seed.unwrap_or_else(|| {
            if !json.is_empty() && execs % 2 == 0 {
                m.mutate_json(&json)
            } else {
                m.mutate(corpus)
            }
        });
        execs += 1;
        if catch_unwind(AssertUnwindSafe(|| target(&input))).is_err() {
            let p = crash_dir.join(format!("{name}-{execs}"));
            let _ = std::fs::create_dir_all(crash_dir);
            let _ = std::fs::write(&p, &input);
            crashes.push(p);
        }
    }
    let r = Report { target: name.to_owned(), execs, crashes, seconds: t0.elapsed().as_secs_f64() };
    eprintln!("fuzz {}: {} executions in {:.1} s, {} crashes", r.target, r.execs, r.seconds, r.crashes.len());
    r
}
