//! Test helpers: write small safetensors files (valid or deliberately broken) and indexes.

use std::path::Path;

/// One tensor to write: name, safetensors dtype string, shape, raw little-endian bytes.
pub(crate) struct RawTensor<'a> {
    pub name: &'a str,
    pub dtype: &'a str,
    pub shape: Vec<usize>,
    pub bytes: Vec<u8>,
}

impl<'a> RawTensor<'a> {
    pub fn f32(name: &'a str, shape: &[usize], values: &[f32]) -> Self {
        let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        RawTensor {
            name,
            dtype: "F32",
            shape: shape.to_vec(),
            bytes,
        }
    }

    pub fn f16(name: &'a str, shape: &[usize], values: &[f32]) -> Self {
        let bytes = values
            .iter()
            .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
            .collect();
        RawTensor {
            name,
            dtype: "F16",
            shape: shape.to_vec(),
            bytes,
        }
    }

    pub fn bf16(name: &'a str, shape: &[usize], values: &[f32]) -> Self {
        let bytes = values
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
            .collect();
        RawTensor {
            name,
            dtype: "BF16",
            shape: shape.to_vec(),
            bytes,
        }
    }

    pub fn fp8(name: &'a str, shape: &[usize], bytes: &[u8]) -> Self {
        RawTensor {
            name,
            dtype: "F8_E4M3",
            shape: shape.to_vec(),
            bytes: bytes.to_vec(),
        }
    }

    pub fn i64(name: &'a str, shape: &[usize], values: &[i64]) -> Self {
        let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        RawTensor {
            name,
            dtype: "I64",
            shape: shape.to_vec(),
            bytes,
        }
    }
}

/// The bytes of a safetensors file holding `tensors` in order.
pub(crate) fn safetensors_bytes(tensors: &[RawTensor<'_>]) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    let mut offset = 0;
    for t in tensors {
        let end = offset + t.bytes.len();
        header.insert(
            t.name.to_string(),
            serde_json::json!({"dtype": t.dtype, "shape": t.shape, "data_offsets": [offset, end]}),
        );
        offset = end;
    }
    let mut text = serde_json::Value::Object(header).to_string();
    while !text.len().is_multiple_of(8) {
        text.push(' ');
    }
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(text.as_bytes());
    for t in tensors {
        out.extend_from_slice(&t.bytes);
    }
    out
}

/// Write `tensors` as the safetensors file `path`.
pub(crate) fn write_safetensors(path: &Path, tensors: &[RawTensor<'_>]) {
    std::fs::write(path, safetensors_bytes(tensors)).expect("write safetensors");
}

/// Write `model.safetensors.index.json` in `dir` mapping each name to its file.
pub(crate) fn write_index(dir: &Path, entries: &[(&str, &str)]) {
    let map: serde_json::Map<String, serde_json::Value> = entries
        .iter()
        .map(|(n, f)| (n.to_string(), serde_json::Value::from(*f)))
        .collect();
    let index = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": map});
    std::fs::write(dir.join(crate::weight_map::INDEX_FILE), index.to_string())
        .expect("write index");
}

/// `n` distinct values, each exactly representable in f16 (so every source dtype but bf16
/// holds them exactly), several not representable in bf16 (so bf16 conversion rounds).
pub(crate) fn f16_exact_values(n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| half::f16::from_f32((i as f32 - 7.3) * 0.173 + 1.0 / 1024.0).to_f32())
        .collect()
}
