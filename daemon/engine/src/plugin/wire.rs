//! The messages between the daemon and an isolated plugin's helper process, and their frames on
//! the Unix stream socket that joins them.
//!
//! A frame is a little-endian `u32` length and that many bytes: a tag byte, then the message's
//! fields, little-endian, strings and lists prefixed by their length. Logits rows never travel
//! here: they go through the shared memory the daemon writes (`isolated::Shm`). The daemon trusts
//! nothing it reads: every length is bounded before anything is allocated, so a helper writing
//! garbage is a protocol fault that ends the helper, never a large allocation in the daemon.

#![allow(unsafe_code)]

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

/// The largest frame either side accepts (a plan of `MAX_ITEMS` items of a few thousand tokens).
pub const MAX_FRAME: usize = 16 << 20;
/// The longest string a message carries (an error message, a parameter object).
const MAX_STRING: usize = 1 << 20;

/// What `create` and `validate` receive, owned: the session init without its pointers.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct InitData {
    pub params: String,
    pub seq: u64,
    pub prompt_len: u32,
    pub vocab: u32,
    pub max_tokens: u32,
    pub n: u32,
    pub eos: Vec<i32>,
    pub roles: u32,
    pub seed: u64,
    pub logprobs: u32,
    pub constrained: u32,
    pub top_logprobs: u32,
}

/// One item of a plan, as the plugin wrote it (checked by the session before use).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PlanItem {
    pub seq: u64,
    pub tokens: Vec<i32>,
    pub n_logits: u32,
}

/// A plan, as the plugin wrote it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RawPlan {
    pub done: bool,
    pub items: Vec<PlanItem>,
}

/// What a strategy of an isolated library declares.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StrategyInfo {
    pub name: String,
    pub description: String,
    pub params_doc: String,
    pub flags: u32,
}

/// What an isolated library declares once loaded in its helper.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Declared {
    pub name: String,
    pub version: String,
    pub abi_minor: u32,
    pub strategies: Vec<StrategyInfo>,
}

/// A host callback the plugin made, forwarded by the helper.
#[derive(Clone, Debug, PartialEq)]
pub enum Callback {
    SeqCreate { role: u32 },
    SeqFork { seq: u64 },
    SeqTruncate { seq: u64, len: u32 },
    SeqFree { seq: u64 },
    SeqTokens { seq: u64 },
    Emit { choice: u32, token: i32, logprob: f32 },
    EmitTop { choice: u32, token: i32, logprob: f32, top: Vec<(i32, f32)> },
    Finish { choice: u32, reason: u32 },
    Report { key: String, value: f64 },
    TokenBytes { token: i32 },
}

/// The daemon's answer to a callback.
#[derive(Clone, Debug, PartialEq)]
pub enum Answer {
    Done,
    Seq(u64),
    Tokens(Vec<u32>),
    Bytes(Vec<u8>),
    /// The callback was refused: an ABI status and why.
    Refused {
        status: i32,
        message: String,
    },
}

/// What the daemon sends.
#[derive(Clone, Debug, PartialEq)]
pub enum ToHelper {
    Validate {
        strategy: u32,
        init: InitData,
    },
    Create {
        session: u64,
        strategy: u32,
        init: InitData,
    },
    Plan {
        session: u64,
    },
    /// The logits are in the shared memory: item `i`'s `counts[i]` rows of `vocab` floats,
    /// items one after another from offset 0.
    Observe {
        session: u64,
        vocab: u32,
        counts: Vec<u32>,
    },
    /// No answer: the helper destroys the session and reads on.
    Destroy {
        session: u64,
    },
    Answer(Answer),
}

/// What the helper sends.
#[derive(Clone, Debug, PartialEq)]
pub enum FromHelper {
    /// The library loaded; the first message.
    Declared(Declared),
    /// The library could not be loaded (or the sandbox set up); the helper exits.
    Refused(String),
    Callback(Callback),
    /// No answer.
    Log {
        level: i32,
        message: String,
    },
    /// A call into the plugin returned `status` (with its message when it failed); a plan
    /// carries what the plugin planned.
    Returned {
        status: i32,
        message: String,
        plan: Option<RawPlan>,
    },
}

/// A frame that does not parse.
#[derive(Debug, thiserror::Error)]
#[error("plugin protocol: {0}")]
pub struct WireError(pub String);

fn bad(what: impl Into<String>) -> WireError {
    WireError(what.into())
}

/// Writes fields into a frame, after room for its length.
struct Out(Vec<u8>);

impl Default for Out {
    fn default() -> Self {
        Out(vec![0; 4])
    }
}

impl Out {
    /// The frame: its length, then the fields.
    fn frame(mut self) -> Vec<u8> {
        let n = (self.0.len() - 4) as u32;
        self.0[..4].copy_from_slice(&n.to_le_bytes());
        self.0
    }

    fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }
    fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn i32(&mut self, v: i32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn f32(&mut self, v: f32) -> &mut Self {
        self.u32(v.to_bits())
    }
    fn f64(&mut self, v: f64) -> &mut Self {
        self.u64(v.to_bits())
    }
    fn bytes(&mut self, v: &[u8]) -> &mut Self {
        self.u32(v.len() as u32);
        self.0.extend_from_slice(v);
        self
    }
    fn str(&mut self, v: &str) -> &mut Self {
        self.bytes(v.as_bytes())
    }
    fn list<T>(&mut self, v: &[T], mut f: impl FnMut(&mut Self, &T)) -> &mut Self {
        self.u32(v.len() as u32);
        for x in v {
            f(self, x);
        }
        self
    }
}

/// Reads fields from a frame, every length checked against what is left.
struct In<'a>(&'a [u8]);

impl In<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], WireError> {
        if self.0.len() < n {
            return Err(bad("truncated message"));
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32, WireError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().map_err(|_| bad("u32"))?))
    }
    fn i32(&mut self) -> Result<i32, WireError> {
        Ok(self.u32()? as i32)
    }
    fn u64(&mut self) -> Result<u64, WireError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().map_err(|_| bad("u64"))?))
    }
    fn f32(&mut self) -> Result<f32, WireError> {
        Ok(f32::from_bits(self.u32()?))
    }
    fn f64(&mut self) -> Result<f64, WireError> {
        Ok(f64::from_bits(self.u64()?))
    }
    fn bytes(&mut self) -> Result<Vec<u8>, WireError> {
        let n = self.u32()? as usize;
        Ok(self.take(n)?.to_vec())
    }
    fn str(&mut self) -> Result<String, WireError> {
        let n = self.u32()? as usize;
        if n > MAX_STRING {
            return Err(bad(format!("a string of {n} bytes")));
        }
        String::from_utf8(self.take(n)?.to_vec()).map_err(|_| bad("a string that is not UTF-8"))
    }
    /// A list of `n` elements of at least `min` bytes each (so `n` is bounded by the frame).
    fn list<T>(
        &mut self,
        min: usize,
        mut f: impl FnMut(&mut Self) -> Result<T, WireError>,
    ) -> Result<Vec<T>, WireError> {
        let n = self.u32()? as usize;
        if n.saturating_mul(min) > self.0.len() {
            return Err(bad(format!("a list of {n} elements in {} bytes", self.0.len())));
        }
        (0..n).map(|_| f(self)).collect()
    }
    fn end(&self) -> Result<(), WireError> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(bad(format!("{} bytes after the message", self.0.len())))
        }
    }
}

fn put_init(o: &mut Out, i: &InitData) {
    o.str(&i.params).u64(i.seq).u32(i.prompt_len).u32(i.vocab).u32(i.max_tokens).u32(i.n);
    o.list(&i.eos, |o, &t| {
        o.i32(t);
    });
    o.u32(i.roles).u64(i.seed).u32(i.logprobs).u32(i.constrained).u32(i.top_logprobs);
}

fn get_init(r: &mut In<'_>) -> Result<InitData, WireError> {
    Ok(InitData {
        params: r.str()?,
        seq: r.u64()?,
        prompt_len: r.u32()?,
        vocab: r.u32()?,
        max_tokens: r.u32()?,
        n: r.u32()?,
        eos: r.list(4, In::i32)?,
        roles: r.u32()?,
        seed: r.u64()?,
        logprobs: r.u32()?,
        constrained: r.u32()?,
        top_logprobs: r.u32()?,
    })
}

impl ToHelper {
    /// The message's frame.
    fn encode(&self) -> Vec<u8> {
        let mut o = Out::default();
        match self {
            ToHelper::Validate { strategy, init } => put_init(o.u8(1).u32(*strategy), init),
            ToHelper::Create { session, strategy, init } => put_init(o.u8(2).u64(*session).u32(*strategy), init),
            ToHelper::Plan { session } => {
                o.u8(3).u64(*session);
            }
            ToHelper::Observe { session, vocab, counts } => {
                o.u8(4).u64(*session).u32(*vocab).list(counts, |o, &c| {
                    o.u32(c);
                });
            }
            ToHelper::Destroy { session } => {
                o.u8(5).u64(*session);
            }
            ToHelper::Answer(a) => {
                o.u8(6);
                match a {
                    Answer::Done => o.u8(0),
                    Answer::Seq(s) => o.u8(1).u64(*s),
                    Answer::Tokens(t) => o.u8(2).list(t, |o, &t| {
                        o.u32(t);
                    }),
                    Answer::Bytes(b) => o.u8(3).bytes(b),
                    Answer::Refused { status, message } => o.u8(4).i32(*status).str(message),
                };
            }
        }
        o.frame()
    }

    fn decode(b: &[u8]) -> Result<ToHelper, WireError> {
        let mut r = In(b);
        let m = match r.u8()? {
            1 => ToHelper::Validate { strategy: r.u32()?, init: get_init(&mut r)? },
            2 => ToHelper::Create { session: r.u64()?, strategy: r.u32()?, init: get_init(&mut r)? },
            3 => ToHelper::Plan { session: r.u64()? },
            4 => ToHelper::Observe { session: r.u64()?, vocab: r.u32()?, counts: r.list(4, In::u32)? },
            5 => ToHelper::Destroy { session: r.u64()? },
            6 => ToHelper::Answer(match r.u8()? {
                0 => Answer::Done,
                1 => Answer::Seq(r.u64()?),
                2 => Answer::Tokens(r.list(4, In::u32)?),
                3 => Answer::Bytes(r.bytes()?),
                4 => Answer::Refused { status: r.i32()?, message: r.str()? },
                t => return Err(bad(format!("answer kind {t}"))),
            }),
            t => return Err(bad(format!("request kind {t}"))),
        };
        r.end()?;
        Ok(m)
    }
}

impl FromHelper {
    /// The message's frame.
    fn encode(&self) -> Vec<u8> {
        let mut o = Out::default();
        match self {
            FromHelper::Declared(d) => {
                o.u8(1).str(&d.name).str(&d.version).u32(d.abi_minor).list(&d.strategies, |o, s| {
                    o.str(&s.name).str(&s.description).str(&s.params_doc).u32(s.flags);
                });
            }
            FromHelper::Refused(why) => {
                o.u8(2).str(why);
            }
            FromHelper::Callback(c) => {
                o.u8(3);
                match c {
                    Callback::SeqCreate { role } => o.u8(1).u32(*role),
                    Callback::SeqFork { seq } => o.u8(2).u64(*seq),
                    Callback::SeqTruncate { seq, len } => o.u8(3).u64(*seq).u32(*len),
                    Callback::SeqFree { seq } => o.u8(4).u64(*seq),
                    Callback::SeqTokens { seq } => o.u8(5).u64(*seq),
                    Callback::Emit { choice, token, logprob } => o.u8(6).u32(*choice).i32(*token).f32(*logprob),
                    Callback::EmitTop { choice, token, logprob, top } => {
                        o.u8(7).u32(*choice).i32(*token).f32(*logprob).list(top, |o, &(t, p)| {
                            o.i32(t).f32(p);
                        })
                    }
                    Callback::Finish { choice, reason } => o.u8(8).u32(*choice).u32(*reason),
                    Callback::Report { key, value } => o.u8(9).str(key).f64(*value),
                    Callback::TokenBytes { token } => o.u8(10).i32(*token),
                };
            }
            FromHelper::Log { level, message } => {
                o.u8(4).i32(*level).str(message);
            }
            FromHelper::Returned { status, message, plan } => {
                o.u8(5).i32(*status).str(message);
                match plan {
                    None => o.u8(0),
                    Some(p) => o.u8(1).u8(u8::from(p.done)).list(&p.items, |o, it| {
                        o.u64(it.seq)
                            .list(&it.tokens, |o, &t| {
                                o.i32(t);
                            })
                            .u32(it.n_logits);
                    }),
                };
            }
        }
        o.frame()
    }

    fn decode(b: &[u8]) -> Result<FromHelper, WireError> {
        let mut r = In(b);
        let m = match r.u8()? {
            1 => FromHelper::Declared(Declared {
                name: r.str()?,
                version: r.str()?,
                abi_minor: r.u32()?,
                strategies: r.list(16, |r| {
                    Ok(StrategyInfo { name: r.str()?, description: r.str()?, params_doc: r.str()?, flags: r.u32()? })
                })?,
            }),
            2 => FromHelper::Refused(r.str()?),
            3 => FromHelper::Callback(match r.u8()? {
                1 => Callback::SeqCreate { role: r.u32()? },
                2 => Callback::SeqFork { seq: r.u64()? },
                3 => Callback::SeqTruncate { seq: r.u64()?, len: r.u32()? },
                4 => Callback::SeqFree { seq: r.u64()? },
                5 => Callback::SeqTokens { seq: r.u64()? },
                6 => Callback::Emit { choice: r.u32()?, token: r.i32()?, logprob: r.f32()? },
                7 => Callback::EmitTop {
                    choice: r.u32()?,
                    token: r.i32()?,
                    logprob: r.f32()?,
                    top: r.list(8, |r| Ok((r.i32()?, r.f32()?)))?,
                },
                8 => Callback::Finish { choice: r.u32()?, reason: r.u32()? },
                9 => Callback::Report { key: r.str()?, value: r.f64()? },
                10 => Callback::TokenBytes { token: r.i32()? },
                t => return Err(bad(format!("callback kind {t}"))),
            }),
            4 => FromHelper::Log { level: r.i32()?, message: r.str()? },
            5 => {
                let (status, message) = (r.i32()?, r.str()?);
                let plan = match r.u8()? {
                    0 => None,
                    _ => Some(RawPlan {
                        done: r.u8()? != 0,
                        items: r.list(16, |r| {
                            Ok(PlanItem { seq: r.u64()?, tokens: r.list(4, In::i32)?, n_logits: r.u32()? })
                        })?,
                    }),
                };
                FromHelper::Returned { status, message, plan }
            }
            t => return Err(bad(format!("message kind {t}"))),
        };
        r.end()?;
        Ok(m)
    }
}

/// A reader of the socket that first polls without blocking for up to `spin` (an answer that
/// is microseconds away then costs no wake-up: on a virtual machine, waking a sleeping process
/// on the other core takes tens of microseconds), then blocks until `deadline` (or for good).
pub struct Spinning<'a> {
    pub sock: &'a UnixStream,
    pub spin: Duration,
    pub deadline: Option<Instant>,
}

impl Read for Spinning<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let until = Instant::now() + self.spin;
        loop {
            // SAFETY: a non-blocking receive into `buf`, valid for `buf.len()` bytes, on a
            // descriptor the stream owns.
            let n =
                unsafe { libc::recv(self.sock.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) };
            if n >= 0 {
                return Ok(n as usize);
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::WouldBlock {
                return Err(e);
            }
            if Instant::now() >= until {
                break;
            }
            std::hint::spin_loop();
        }
        if let Some(d) = self.deadline {
            let left = d.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(std::io::ErrorKind::TimedOut.into());
            }
            self.sock.set_read_timeout(Some(left))?;
        }
        let mut s = self.sock;
        s.read(buf)
    }
}

/// Why a frame could not be read.
#[derive(Debug)]
pub enum ReadError {
    Io(std::io::Error),
    Wire(WireError),
}

fn read_frame(r: &mut impl Read) -> Result<Vec<u8>, ReadError> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len).map_err(ReadError::Io)?;
    let n = u32::from_le_bytes(len) as usize;
    if n > MAX_FRAME {
        return Err(ReadError::Wire(bad(format!("a frame of {n} bytes"))));
    }
    let mut body = vec![0u8; n];
    r.read_exact(&mut body).map_err(ReadError::Io)?;
    Ok(body)
}

pub fn send_to_helper(w: &mut impl Write, m: &ToHelper) -> std::io::Result<()> {
    w.write_all(&m.encode())
}

pub fn recv_from_daemon(r: &mut impl Read) -> Result<ToHelper, ReadError> {
    ToHelper::decode(&read_frame(r)?).map_err(ReadError::Wire)
}

pub fn send_to_daemon(w: &mut impl Write, m: &FromHelper) -> std::io::Result<()> {
    w.write_all(&m.encode())
}

pub fn recv_from_helper(r: &mut impl Read) -> Result<FromHelper, ReadError> {
    FromHelper::decode(&read_frame(r)?).map_err(ReadError::Wire)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn init() -> InitData {
        InitData { params: "{\"k\": 1}".into(), seq: 7, eos: vec![2, 0], n: 3, seed: u64::MAX, ..Default::default() }
    }

    #[test]
    fn every_message_comes_back_as_it_was_sent() {
        let to = [
            ToHelper::Validate { strategy: 1, init: init() },
            ToHelper::Create { session: 9, strategy: 0, init: init() },
            ToHelper::Plan { session: 9 },
            ToHelper::Observe { session: 9, vocab: 49152, counts: vec![1, 0, 5] },
            ToHelper::Destroy { session: 9 },
            ToHelper::Answer(Answer::Done),
            ToHelper::Answer(Answer::Seq(44)),
            ToHelper::Answer(Answer::Tokens(vec![1, 2, 3])),
            ToHelper::Answer(Answer::Bytes(b"<|im_end|>".to_vec())),
            ToHelper::Answer(Answer::Refused { status: 2, message: "no".into() }),
        ];
        for m in to {
            let mut buf = Vec::new();
            send_to_helper(&mut buf, &m).unwrap();
            assert_eq!(recv_from_daemon(&mut buf.as_slice()).unwrap(), m);
        }
        let plan = RawPlan { done: false, items: vec![PlanItem { seq: 3, tokens: vec![5, -1], n_logits: 2 }] };
        let from = [
            FromHelper::Declared(Declared {
                name: "x".into(),
                version: "1".into(),
                abi_minor: 2,
                strategies: vec![StrategyInfo {
                    name: "s".into(),
                    description: "d".into(),
                    params_doc: "{}".into(),
                    flags: 1,
                }],
            }),
            FromHelper::Refused("why".into()),
            FromHelper::Callback(Callback::EmitTop {
                choice: 1,
                token: 4,
                logprob: -0.5,
                top: vec![(4, -0.5), (1, -2.0)],
            }),
            FromHelper::Callback(Callback::Report { key: "draft_tokens".into(), value: 3.0 }),
            FromHelper::Callback(Callback::SeqTruncate { seq: 3, len: 10 }),
            FromHelper::Log { level: 3, message: "hi".into() },
            FromHelper::Returned { status: 0, message: String::new(), plan: Some(plan) },
            FromHelper::Returned { status: 1, message: "bad".into(), plan: None },
        ];
        for m in from {
            let mut buf = Vec::new();
            send_to_daemon(&mut buf, &m).unwrap();
            assert_eq!(recv_from_helper(&mut buf.as_slice()).unwrap(), m);
        }
    }

    #[test]
    fn garbage_is_an_error_and_allocates_nothing_it_was_not_sent() {
        // A list claiming four billion elements in a short frame.
        let mut body = vec![5u8, 0, 0, 0, 0, 0, 0, 0, 0, 1];
        body.extend_from_slice(&u32::MAX.to_le_bytes());
        let mut frame = (body.len() as u32).to_le_bytes().to_vec();
        frame.extend_from_slice(&body);
        assert!(matches!(recv_from_helper(&mut frame.as_slice()), Err(ReadError::Wire(_))));
        // A frame longer than the limit is refused before it is read.
        let huge = ((MAX_FRAME + 1) as u32).to_le_bytes();
        assert!(matches!(recv_from_helper(&mut huge.as_slice()), Err(ReadError::Wire(_))));
        // Trailing bytes, unknown kinds, truncation.
        for body in [&[3u8, 3, 0][..], &[99], &[5, 0, 0], &[4, 1, 0, 0, 0, 9, 0, 0, 0, 104, 105]] {
            let mut frame = (body.len() as u32).to_le_bytes().to_vec();
            frame.extend_from_slice(body);
            assert!(matches!(recv_from_helper(&mut frame.as_slice()), Err(ReadError::Wire(_))), "{body:?}");
        }
    }
}
