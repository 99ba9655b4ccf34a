//! GGUF (v2/v3) reader: metadata, tensor directory and data offsets, all checked against the file.
//!
//! The file is untrusted: every count, length and offset is validated before it is used, and no
//! allocation is sized by a count that the remaining bytes could not hold, so a truncated or
//! hostile file yields a [`GgufError`], never a panic or an absurd allocation.
//!
//! Metadata is parsed within budgets ([`MAX_ARRAY_LEN`], [`MAX_VALUES`], [`MAX_STRING_LEN`],
//! [`MAX_STRING_BYTES`]), checked before anything is allocated for them: a value costs 32 bytes
//! in memory against as little as one in the file, so a 128 MB array of bytes once took 4.2 GB.
//! The budgets leave five to ten times the room the largest real vocabularies need (Gemma 3's
//! 262,144 tokens with scores and types; Llama 3's 280,147 merges). [`Gguf::parse_header`]
//! skips arrays altogether (what a store listing needs: architecture, type, tensors).

use crate::model::mmap::Blob;
use inferd_kernels::DType;
use std::collections::BTreeMap;

#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("not a GGUF file (bad magic)")]
    BadMagic,
    #[error("unsupported GGUF version {0} (supported: 2, 3)")]
    Version(u32),
    #[error("GGUF file is truncated or corrupt: {0}")]
    Corrupt(String),
    #[error("tensor '{name}' has unsupported type {ty} (supported: {})", supported_types())]
    UnsupportedType { name: String, ty: String },
}

/// The names of the weight types that load, for the refusal of the others.
fn supported_types() -> String {
    DType::ALL.iter().map(|d| d.name()).collect::<Vec<_>>().join(", ")
}

/// Elements of one metadata array.
pub const MAX_ARRAY_LEN: usize = 4 << 20;
/// Metadata values in one file, array elements included.
pub const MAX_VALUES: usize = 8 << 20;
/// Bytes of one metadata string (a chat template, an embedded `tokenizer.json`).
pub const MAX_STRING_LEN: usize = 32 << 20;
/// Bytes of all metadata strings of one file together.
pub const MAX_STRING_BYTES: usize = 256 << 20;

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U64(u64),
    I64(i64),
    F64(f64),
    Bool(bool),
    Str(String),
    Array(Vec<Value>),
}

impl Value {
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U64(v) => Some(v),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F64(v) => Some(v),
            Value::U64(v) => Some(v as f64),
            Value::I64(v) => Some(v as f64),
            _ => None,
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// One entry of the tensor directory.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: DType,
    /// GGML order: `dims[0]` is the fastest-varying (a row's length).
    pub dims: Vec<usize>,
    /// Absolute byte offset in the file.
    pub offset: usize,
    pub len: usize,
}

/// A parsed GGUF file.
#[derive(Debug)]
pub struct Gguf {
    pub version: u32,
    pub metadata: BTreeMap<String, Value>,
    pub tensors: Vec<TensorInfo>,
    pub blob: Blob,
}

struct Cursor<'a> {
    b: &'a [u8],
    pos: usize,
    /// Values and string bytes parsed so far, against the budgets.
    values: usize,
    string_bytes: usize,
    /// Arrays are stepped over, not kept ([`Gguf::parse_header`]).
    skip_arrays: bool,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], GgufError> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.b.len());
        let end = end.ok_or_else(|| {
            GgufError::Corrupt(format!("needs {n} bytes at offset {}, file has {}", self.pos, self.b.len()))
        })?;
        let s = &self.b[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, GgufError> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32, GgufError> {
        let s = self.take(4)?;
        Ok(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
    }
    fn u64(&mut self) -> Result<u64, GgufError> {
        let s = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(s);
        Ok(u64::from_le_bytes(a))
    }
    fn remaining(&self) -> usize {
        self.b.len() - self.pos
    }
    fn len(&mut self, what: &str) -> Result<usize, GgufError> {
        let n = self.u64()?;
        usize::try_from(n)
            .ok()
            .filter(|&n| n <= self.remaining())
            .ok_or_else(|| GgufError::Corrupt(format!("{what} length {n} exceeds the file")))
    }
    fn string(&mut self) -> Result<String, GgufError> {
        let n = self.len("string")?;
        if n > MAX_STRING_LEN {
            return Err(GgufError::Corrupt(format!("a string of {n} bytes (at most {MAX_STRING_LEN})")));
        }
        self.string_bytes += n;
        if self.string_bytes > MAX_STRING_BYTES {
            return Err(GgufError::Corrupt(format!("metadata strings pass {MAX_STRING_BYTES} bytes in all")));
        }
        let s = self.take(n)?;
        String::from_utf8(s.to_vec())
            .map_err(|_| GgufError::Corrupt(format!("string at offset {} is not UTF-8", self.pos - n)))
    }
    /// Steps over one value of type `ty` (an array's element: no nested arrays).
    fn skip(&mut self, ty: u32) -> Result<(), GgufError> {
        let size = match ty {
            0 | 1 | 7 => 1,
            2 | 3 => 2,
            4..=6 => 4,
            10..=12 => 8,
            8 => self.len("string")?,
            9 => return Err(GgufError::Corrupt("arrays of arrays in the header".into())),
            t => return Err(GgufError::Corrupt(format!("unknown metadata value type {t}"))),
        };
        self.take(size).map(|_| ())
    }

    fn value(&mut self, ty: u32, depth: u32) -> Result<Value, GgufError> {
        self.values += 1;
        if self.values > MAX_VALUES {
            return Err(GgufError::Corrupt(format!("more than {MAX_VALUES} metadata values")));
        }
        Ok(match ty {
            0 => Value::U64(u64::from(self.u8()?)),
            1 => Value::I64(i64::from(self.u8()? as i8)),
            2 => {
                let s = self.take(2)?;
                Value::U64(u64::from(u16::from_le_bytes([s[0], s[1]])))
            }
            3 => {
                let s = self.take(2)?;
                Value::I64(i64::from(i16::from_le_bytes([s[0], s[1]])))
            }
            4 => Value::U64(u64::from(self.u32()?)),
            5 => Value::I64(i64::from(self.u32()? as i32)),
            6 => Value::F64(f64::from(f32::from_bits(self.u32()?))),
            7 => Value::Bool(self.u8()? != 0),
            8 => Value::Str(self.string()?),
            9 => {
                if depth > 2 {
                    return Err(GgufError::Corrupt("arrays nested too deeply".into()));
                }
                let ety = self.u32()?;
                let n = self.len("array")?;
                if n > MAX_ARRAY_LEN {
                    return Err(GgufError::Corrupt(format!("an array of {n} values (at most {MAX_ARRAY_LEN})")));
                }
                if self.skip_arrays && ety != 9 {
                    for _ in 0..n {
                        self.skip(ety)?;
                    }
                    return Ok(Value::Array(Vec::new()));
                }
                // Every element takes at least one byte, so `n <= remaining` bounds the allocation.
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.value(ety, depth + 1)?);
                }
                Value::Array(v)
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(self.u64()? as i64),
            12 => Value::F64(f64::from_bits(self.u64()?)),
            t => return Err(GgufError::Corrupt(format!("unknown metadata value type {t}"))),
        })
    }
}

/// The weight type of GGML's type number `ty`, or the name to refuse it by.
fn ggml_type(ty: u32) -> Result<DType, String> {
    DType::from_ggml(ty)
        .ok_or_else(|| inferd_kernels::quant::ggml_type_name(ty).map_or(format!("ggml type {ty}"), str::to_string))
}

impl Gguf {
    /// Parses the header, metadata and tensor directory of the GGUF bytes in `blob`.
    pub fn parse(blob: Blob) -> Result<Gguf, GgufError> {
        Gguf::parse_with(blob, false)
    }

    /// [`Gguf::parse`] with every metadata array left empty (stepped over, checked only for
    /// fitting in the file): the header's scalars and the tensor directory, fast and small
    /// whatever the vocabulary.
    pub fn parse_header(blob: Blob) -> Result<Gguf, GgufError> {
        Gguf::parse_with(blob, true)
    }

    fn parse_with(blob: Blob, skip_arrays: bool) -> Result<Gguf, GgufError> {
        let b = blob.bytes();
        let mut c = Cursor { b, pos: 0, values: 0, string_bytes: 0, skip_arrays };
        if c.take(4).map_err(|_| GgufError::BadMagic)? != b"GGUF" {
            return Err(GgufError::BadMagic);
        }
        let version = c.u32()?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::Version(version));
        }
        let n_tensors = c.len("tensor count")?;
        let n_kv = c.len("metadata count")?;
        let mut metadata = BTreeMap::new();
        for _ in 0..n_kv {
            let key = c.string()?;
            let ty = c.u32()?;
            let v = c.value(ty, 0)?;
            metadata.insert(key, v);
        }
        let mut infos = Vec::with_capacity(n_tensors.min(c.remaining() / 24));
        for _ in 0..n_tensors {
            let name = c.string()?;
            let n_dims = c.u32()?;
            if n_dims == 0 || n_dims > 4 {
                return Err(GgufError::Corrupt(format!("tensor '{name}' has {n_dims} dimensions")));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                let d = c.u64()?;
                dims.push(
                    usize::try_from(d).map_err(|_| GgufError::Corrupt(format!("tensor '{name}' dimension {d}")))?,
                );
            }
            let ty = c.u32()?;
            let rel = c.u64()?;
            let dtype = ggml_type(ty).map_err(|ty| GgufError::UnsupportedType { name: name.clone(), ty })?;
            infos.push((name, dtype, dims, rel));
        }
        let alignment = match metadata.get("general.alignment") {
            None => 32,
            Some(v) => v
                .as_u64()
                .filter(|a| a.is_power_of_two() && *a <= 1 << 20)
                .ok_or_else(|| GgufError::Corrupt("general.alignment is not a power of two".into()))?
                as usize,
        };
        let data_start = c.pos.div_ceil(alignment) * alignment;
        let mut tensors = Vec::with_capacity(infos.len());
        for (name, dtype, dims, rel) in infos {
            let count = dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
            let len = count.filter(|n| dims[0] % dtype.block_len() == 0 && *n > 0).and_then(|n| dtype.bytes_for(n));
            let len = len.ok_or_else(|| {
                GgufError::Corrupt(format!("tensor '{name}' has invalid shape {dims:?} for {}", dtype.name()))
            })?;
            let offset = usize::try_from(rel).ok().and_then(|r| r.checked_add(data_start));
            let end = offset.and_then(|o| o.checked_add(len));
            match (offset, end) {
                (Some(o), Some(e)) if e <= b.len() => tensors.push(TensorInfo { name, dtype, dims, offset: o, len }),
                _ => {
                    return Err(GgufError::Corrupt(format!(
                        "tensor '{name}' data (offset {rel}, {len} bytes) lies outside the file"
                    )))
                }
            }
        }
        Ok(Gguf { version, metadata, tensors, blob })
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }
}
