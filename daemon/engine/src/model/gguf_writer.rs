//! A minimal GGUF v3 writer: tests build tiny random-weight models with it, and tools can use it
//! to export. Only what the reader supports is written.

use inferd_kernels::DType;

/// A metadata value to write, with its GGUF type.
#[derive(Clone, Debug)]
pub enum MetaValue {
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    Str(String),
    StrArray(Vec<String>),
    I32Array(Vec<i32>),
    F32Array(Vec<f32>),
}

/// Accumulates metadata and tensors, then serializes them with [`GgufWriter::to_bytes`].
#[derive(Debug, Default)]
pub struct GgufWriter {
    metadata: Vec<(String, MetaValue)>,
    tensors: Vec<(String, DType, Vec<usize>, Vec<u8>)>,
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

impl GgufWriter {
    pub fn meta(&mut self, key: &str, v: MetaValue) -> &mut Self {
        self.metadata.push((key.to_string(), v));
        self
    }

    /// Adds a tensor from f32 values, quantized to `dtype`. `dims` in GGML order (row length first).
    pub fn tensor(&mut self, name: &str, dtype: DType, dims: &[usize], values: &[f32]) -> &mut Self {
        let mut bytes = Vec::new();
        for row in values.chunks(dims[0]) {
            inferd_kernels::quant::quantize_row(dtype, row, &mut bytes);
        }
        self.tensors.push((name.to_string(), dtype, dims.to_vec(), bytes));
        self
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        const ALIGN: usize = 32;
        let mut out = Vec::new();
        out.extend_from_slice(b"GGUF");
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (k, v) in &self.metadata {
            put_str(&mut out, k);
            let arr = |out: &mut Vec<u8>, ty: u32, n: usize| {
                out.extend_from_slice(&9u32.to_le_bytes());
                out.extend_from_slice(&ty.to_le_bytes());
                out.extend_from_slice(&(n as u64).to_le_bytes());
            };
            match v {
                MetaValue::U32(x) => {
                    out.extend_from_slice(&4u32.to_le_bytes());
                    out.extend_from_slice(&x.to_le_bytes());
                }
                MetaValue::I32(x) => {
                    out.extend_from_slice(&5u32.to_le_bytes());
                    out.extend_from_slice(&x.to_le_bytes());
                }
                MetaValue::F32(x) => {
                    out.extend_from_slice(&6u32.to_le_bytes());
                    out.extend_from_slice(&x.to_le_bytes());
                }
                MetaValue::Bool(x) => {
                    out.extend_from_slice(&7u32.to_le_bytes());
                    out.push(u8::from(*x));
                }
                MetaValue::Str(s) => {
                    out.extend_from_slice(&8u32.to_le_bytes());
                    put_str(&mut out, s);
                }
                MetaValue::StrArray(a) => {
                    arr(&mut out, 8, a.len());
                    a.iter().for_each(|s| put_str(&mut out, s));
                }
                MetaValue::I32Array(a) => {
                    arr(&mut out, 5, a.len());
                    a.iter().for_each(|x| out.extend_from_slice(&x.to_le_bytes()));
                }
                MetaValue::F32Array(a) => {
                    arr(&mut out, 6, a.len());
                    a.iter().for_each(|x| out.extend_from_slice(&x.to_le_bytes()));
                }
            }
        }
        let mut rel = 0usize;
        for (name, dt, dims, bytes) in &self.tensors {
            put_str(&mut out, name);
            out.extend_from_slice(&(dims.len() as u32).to_le_bytes());
            dims.iter().for_each(|d| out.extend_from_slice(&(*d as u64).to_le_bytes()));
            out.extend_from_slice(&DType::ggml_type(*dt).to_le_bytes());
            out.extend_from_slice(&(rel as u64).to_le_bytes());
            rel = (rel + bytes.len()).div_ceil(ALIGN) * ALIGN;
        }
        out.resize(out.len().div_ceil(ALIGN) * ALIGN, 0);
        for (_, _, _, bytes) in &self.tensors {
            out.extend_from_slice(bytes);
            out.resize(out.len().div_ceil(ALIGN) * ALIGN, 0);
        }
        out
    }
}
