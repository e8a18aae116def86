//! Block-FP8 projections from a checkpoint: an `F8_E4M3` weight `W.weight` and its scales,
//! `W.weight_scale_inv` (the Qwen / DeepSeek `fp8` packs) or `W.weight_scale` (llm-compressor's
//! compressed-tensors packs), each element standing for e4m3 · its scale. The scales come as a
//! grid of 128 x 128 blocks (`[ceil(n / 128), ceil(k / 128)]`, partial edge blocks included),
//! one per output channel (`[n, 1]` or `[n]`) or one per tensor (`[]` or `[1]`), in f32, bf16 or
//! f16; they are kept as the f32 grid the kernels read (`BlockScales`): 128-row blocks where the
//! checkpoint has them (or one scale per tensor), else a scale row per weight row.
//!
//! An FP8 KV cache's per-layer scales (`kv_scales`) are read here too.
//!
//! Invariants:
//! - A weight without a scale tensor is refused (`WeightError::MissingScale`), as is a
//!   scale grid of any other shape (`WeightError::Shape`) or dtype (`WeightError::Dtype`).
//! - A scale outside [0, `MAX_SCALE`) (NaN included) or an element holding a NaN code is refused
//!   (`WeightError::Fp8Value`): the kernels read neither.
//! - Concatenated FP8 parts keep 128-row scale blocks only where every part but the last has a
//!   multiple of 128 rows (so no block straddles two parts); otherwise each row gets its own scale
//!   row, which the kernels read alike.

use half::{bf16, f16};
use metrale_cache::KvScales;
use metrale_gpu_runtime::fp8::{
    FP8_BLOCK, FP8_BLOCK_ROW_SHIFT, MAX_SCALE, dequant, is_nan_code, kv_scale_ok,
    quantize as quantize_block, scale_cols,
};
use safetensors::Dtype;

use crate::weight_map::convert::concat_shape;
use crate::weight_map::error::WeightError;
use crate::weight_map::layer_names::LayerNames;
use crate::weight_map::source::SafetensorsSource;

/// An attention layer's FP8 KV cache scales from the checkpoint: the first pair of
/// `LayerNames::kv_scales` the checkpoint holds (either tensor of a pair missing is an error
/// naming it), each one value (`[]` or `[1]`) in f32, bf16 or f16 that
/// `fp8::kv_scale_ok` takes (finite, in (0, `MAX_SCALE`)); `None` when it has none, so the
/// cache uses 1.0.
pub fn kv_scales(
    source: &SafetensorsSource,
    names: &LayerNames,
) -> Result<Option<KvScales>, WeightError> {
    let Some([k, v]) =
        (names.kv_scales().into_iter()).find(|[k, v]| source.contains(k) || source.contains(v))
    else {
        return Ok(None);
    };
    let one = |name: &str| -> Result<f32, WeightError> {
        let (_, shape) = source.info(name)?;
        if shape.iter().product::<usize>() != 1 || shape.len() > 1 {
            return Err(WeightError::Shape {
                tensor: name.to_string(),
                expected: vec![1],
                found: shape.to_vec(),
            });
        }
        let shape = shape.to_vec();
        let value = source.load_f32(name, &shape)?[0];
        if !kv_scale_ok(value) {
            return Err(WeightError::Fp8Value {
                tensor: name.to_string(),
                problem: format!(
                    "is {value}: a KV cache scale must be finite and in (0, {MAX_SCALE})"
                ),
            });
        }
        Ok(value)
    };
    Ok(Some(KvScales {
        k: one(&k)?,
        v: one(&v)?,
    }))
}

/// A block-FP8 `[n, k]` weight on the host: its e4m3 bytes and its f32 scale grid.
#[derive(Debug, Clone, PartialEq)]
pub struct Fp8Host {
    /// e4m3 `[n, k]`.
    pub bytes: Vec<u8>,
    /// f32 `[ceil(n / 2^row_shift), ceil(k / FP8_BLOCK)]`.
    pub scales: Vec<f32>,
    /// log2 of the weight rows a scale row covers: `FP8_BLOCK_ROW_SHIFT` or 0.
    pub row_shift: u32,
    /// `(n, k)`.
    pub shape: (usize, usize),
}

impl Fp8Host {
    /// The weight as the bf16 it stands for.
    pub fn dequantized(&self) -> Vec<bf16> {
        dequant(&self.bytes, &self.scales, self.shape, self.row_shift)
    }

    /// The weight's rows `rows`, in that order (a row may appear in any position): the same
    /// bytes and values, with a scale row per weight row, since the chosen rows need not keep
    /// their 128-row blocks together. `None` when a row is past the weight.
    pub fn select_rows(&self, rows: &[usize]) -> Option<Fp8Host> {
        let (n, k) = self.shape;
        let kb = scale_cols(k);
        let mut bytes = Vec::with_capacity(rows.len() * k);
        let mut scales = Vec::with_capacity(rows.len() * kb);
        for &r in rows {
            if r >= n {
                return None;
            }
            bytes.extend_from_slice(&self.bytes[r * k..(r + 1) * k]);
            scales.extend_from_slice(&self.scales[(r >> self.row_shift) * kb..][..kb]);
        }
        Some(Fp8Host {
            bytes,
            scales,
            row_shift: 0,
            shape: (rows.len(), k),
        })
    }

    /// The same weight with a scale row per weight row.
    fn per_row(self) -> Fp8Host {
        if self.row_shift == 0 {
            return self;
        }
        let (n, k) = self.shape;
        let kb = scale_cols(k);
        let scales = (0..n)
            .flat_map(|r| {
                self.scales[(r >> self.row_shift) * kb..][..kb]
                    .iter()
                    .copied()
            })
            .collect();
        Fp8Host {
            scales,
            row_shift: 0,
            ..self
        }
    }
}

/// The names a weight's scale tensor may have, in the order they are looked for.
fn scale_names(weight: &str) -> [String; 2] {
    let stem = weight.strip_suffix(".weight").unwrap_or(weight);
    [
        format!("{stem}.weight_scale_inv"),
        format!("{stem}.weight_scale"),
    ]
}

impl SafetensorsSource {
    /// Whether `name` is stored as FP8 (e4m3).
    pub fn is_fp8(&self, name: &str) -> bool {
        matches!(self.info(name), Ok((Dtype::F8_E4M3, _)))
    }

    /// FP8 tensor `name` (shape `[n, k]`) and its scales.
    pub fn load_fp8(&self, name: &str, expected_shape: &[usize]) -> Result<Fp8Host, WeightError> {
        let (dtype, shape, bytes) = self.raw(name)?;
        if dtype != Dtype::F8_E4M3 {
            return Err(WeightError::Dtype {
                tensor: name.to_string(),
                found: format!("{dtype:?}"),
                expected: "F8_E4M3",
            });
        }
        let &[n, k] = expected_shape else {
            return Err(shape_error(name, expected_shape, shape));
        };
        if shape != expected_shape {
            return Err(shape_error(name, expected_shape, shape));
        }
        let names = scale_names(name);
        let Some(scale_name) = names.iter().find(|n| self.contains(n)).cloned() else {
            return Err(WeightError::MissingScale {
                tensor: name.to_string(),
                names,
                dir: self.dir().to_path_buf(),
            });
        };
        let (sdtype, sshape, sbytes) = self.raw(&scale_name)?;
        let values: Vec<f32> = match sdtype {
            Dtype::F32 => (sbytes.chunks_exact(4))
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            Dtype::BF16 => (sbytes.chunks_exact(2))
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            Dtype::F16 => (sbytes.chunks_exact(2))
                .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            other => {
                return Err(WeightError::Dtype {
                    tensor: scale_name,
                    found: format!("{other:?}"),
                    expected: "f32, bf16 or f16 scales",
                });
            }
        };
        let block = FP8_BLOCK as usize;
        let kb = scale_cols(k);
        let (scales, row_shift) = match sshape {
            [r, c] if *r == n.div_ceil(block) && *c == kb => (values, FP8_BLOCK_ROW_SHIFT),
            [r, 1] | [r] if *r == n => {
                let per_row = values.iter().flat_map(|&s| std::iter::repeat_n(s, kb));
                (per_row.collect(), 0)
            }
            [] | [1] if values.len() == 1 => {
                (vec![values[0]; n.div_ceil(block) * kb], FP8_BLOCK_ROW_SHIFT)
            }
            _ => {
                return Err(shape_error(&scale_name, &[n.div_ceil(block), kb], sshape));
            }
        };
        readable((name, bytes), (&scale_name, &scales))?;
        Ok(Fp8Host {
            bytes: bytes.to_vec(),
            scales,
            row_shift,
            shape: (n, k),
        })
    }

    /// Several FP8 tensors concatenated along dim 0 (see the module invariants for the scales).
    pub fn load_fp8_concat(&self, parts: &[(&str, &[usize])]) -> Result<Fp8Host, WeightError> {
        self.fp8_concat(parts, false)
    }

    /// [`SafetensorsSource::load_fp8_concat`] of parts stored as FP8 or not: each part that is
    /// not quantized with the block recipe on its own (`fp8::quantize`), as a pack quantizes
    /// each projection, so the fused weight is the fused weights of the pack.
    pub fn quantize_fp8_concat(&self, parts: &[(&str, &[usize])]) -> Result<Fp8Host, WeightError> {
        self.fp8_concat(parts, true)
    }

    fn fp8_concat(
        &self,
        parts: &[(&str, &[usize])],
        quantize: bool,
    ) -> Result<Fp8Host, WeightError> {
        let shape = concat_shape(parts)?;
        let load = |&(name, shape): &(&str, &[usize])| -> Result<Fp8Host, WeightError> {
            if !quantize || self.is_fp8(name) {
                return self.load_fp8(name, shape);
            }
            let &[n, k] = shape else {
                let found = self.info(name)?.1.to_vec();
                return Err(shape_error(name, shape, &found));
            };
            let (bytes, scales) = quantize_block(&self.load_bf16(name, shape)?, (n, k));
            readable((name, &bytes), (name, &scales))?;
            Ok(Fp8Host {
                bytes,
                scales,
                row_shift: FP8_BLOCK_ROW_SHIFT,
                shape: (n, k),
            })
        };
        let loaded = parts.iter().map(load).collect::<Result<Vec<_>, _>>()?;
        let block = FP8_BLOCK as usize;
        let aligned = loaded.iter().rev().skip(1).all(|p| p.shape.0 % block == 0)
            && loaded.iter().all(|p| p.row_shift == FP8_BLOCK_ROW_SHIFT);
        let mut out = Fp8Host {
            bytes: Vec::new(),
            scales: Vec::new(),
            row_shift: if aligned { FP8_BLOCK_ROW_SHIFT } else { 0 },
            shape: (shape[0], shape[1..].iter().product()),
        };
        for part in loaded {
            let part = if aligned { part } else { part.per_row() };
            out.bytes.extend_from_slice(&part.bytes);
            out.scales.extend_from_slice(&part.scales);
        }
        Ok(out)
    }
}

/// Refuse what the kernels cannot read: a scale outside [0, `MAX_SCALE`) (NaN included), an
/// element holding a NaN code.
fn readable(
    (name, bytes): (&str, &[u8]),
    (scale_name, scales): (&str, &[f32]),
) -> Result<(), WeightError> {
    if let Some(bad) = scales.iter().find(|s| !(0.0..MAX_SCALE).contains(*s)) {
        return Err(WeightError::Fp8Value {
            tensor: scale_name.to_string(),
            problem: format!("holds the scale {bad}; scales must be in [0, {MAX_SCALE})"),
        });
    }
    if let Some(at) = bytes.iter().position(|&b| is_nan_code(b)) {
        return Err(WeightError::Fp8Value {
            tensor: name.to_string(),
            problem: format!("holds a NaN at element {at}"),
        });
    }
    Ok(())
}

fn shape_error(name: &str, expected: &[usize], found: &[usize]) -> WeightError {
    WeightError::Shape {
        tensor: name.to_string(),
        expected: expected.to_vec(),
        found: found.to_vec(),
    }
}
