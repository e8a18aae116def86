//! Host-side loading of one tensor (or several concatenated along dim 0) from a
//! `SafetensorsSource`, checked against the shape the model expects and converted to bf16 or
//! f32. BF16, F16 and F32 sources are accepted; f32 -> bf16 rounds to nearest even
//! (`half::bf16::from_f32`), f16 -> bf16 goes through the exact f16 -> f32 widening first. An
//! FP8 weight with its scales (`fp8.rs`) loads as bf16 too, each element bf16(e4m3 · scale):
//! the bf16 the FP8 kernels compute with.
//!
//! Invariant: the file bytes are read element by element as little-endian values, so no
//! alignment of the mapped data is assumed.

use half::{bf16, f16};
use safetensors::Dtype;

use crate::weight_map::error::WeightError;
use crate::weight_map::source::SafetensorsSource;

/// The source dtypes `load_bf16` and `load_f32` accept, for error messages.
pub const LOADABLE_DTYPES: &str = "bf16, f16 or f32";

impl SafetensorsSource {
    /// Tensor `name`, which must have shape `expected_shape`, as bf16.
    pub fn load_bf16(
        &self,
        name: &str,
        expected_shape: &[usize],
    ) -> Result<Vec<bf16>, WeightError> {
        let mut out = Vec::new();
        self.append_bf16(name, expected_shape, &mut out)?;
        Ok(out)
    }

    /// Tensor `name`, which must have shape `expected_shape`, as f32 (for small vectors such as
    /// `A_log` and `dt_bias` that kernels read in f32).
    pub fn load_f32(&self, name: &str, expected_shape: &[usize]) -> Result<Vec<f32>, WeightError> {
        let (dtype, bytes) = self.checked(name, expected_shape)?;
        let mut out = Vec::with_capacity(bytes.len() / dtype_bytes(dtype));
        match dtype {
            Dtype::BF16 => out.extend(halves(bytes).map(|b| bf16::from_bits(b).to_f32())),
            Dtype::F16 => out.extend(halves(bytes).map(|b| f16::from_bits(b).to_f32())),
            Dtype::F32 => out.extend(singles(bytes)),
            other => return Err(dtype_error(name, other)),
        }
        Ok(out)
    }

    /// Several tensors concatenated along dim 0 into one bf16 buffer (q/k/v into one
    /// projection, gate/up into one, per-expert weights into one stack). Each part must have
    /// its expected shape, and every part the same trailing dims.
    pub fn load_bf16_concat(&self, parts: &[(&str, &[usize])]) -> Result<Vec<bf16>, WeightError> {
        concat_shape(parts)?;
        let mut out = Vec::with_capacity(self.stored_numel(parts.iter().copied()));
        for &(name, shape) in parts {
            self.append_bf16(name, shape, &mut out)?;
        }
        Ok(out)
    }

    fn append_bf16(
        &self,
        name: &str,
        expected_shape: &[usize],
        out: &mut Vec<bf16>,
    ) -> Result<(), WeightError> {
        if self.is_fp8(name) {
            out.extend(self.load_fp8(name, expected_shape)?.dequantized());
            return Ok(());
        }
        let (dtype, bytes) = self.checked(name, expected_shape)?;
        out.reserve(bytes.len() / dtype_bytes(dtype));
        match dtype {
            Dtype::BF16 => out.extend(halves(bytes).map(bf16::from_bits)),
            Dtype::F16 => {
                out.extend(halves(bytes).map(|b| bf16::from_f32(f16::from_bits(b).to_f32())));
            }
            Dtype::F32 => out.extend(singles(bytes).map(bf16::from_f32)),
            other => return Err(dtype_error(name, other)),
        }
        Ok(())
    }

    /// The elements of `parts` (name, expected shape) when the checkpoint stores each at its
    /// expected shape, else 0: what a reader may reserve before reading them. The expected
    /// shapes come from config.json, so a size there (a huge `intermediate_size`) sizes nothing
    /// until the headers agree; otherwise the read fails with the tensor's shape error.
    pub(crate) fn stored_numel<'n>(
        &self,
        parts: impl IntoIterator<Item = (&'n str, &'n [usize])>,
    ) -> usize {
        let mut total = 0;
        for (name, expected) in parts {
            match self.info(name) {
                Ok((_, shape)) if shape == expected => total += shape.iter().product::<usize>(),
                _ => return 0,
            }
        }
        total
    }

    /// The dtype and bytes of `name` after checking its dtype is loadable and its shape.
    fn checked(&self, name: &str, expected_shape: &[usize]) -> Result<(Dtype, &[u8]), WeightError> {
        let (dtype, shape, bytes) = self.raw(name)?;
        if !matches!(dtype, Dtype::BF16 | Dtype::F16 | Dtype::F32) {
            return Err(dtype_error(name, dtype));
        }
        if shape != expected_shape {
            return Err(WeightError::Shape {
                tensor: name.to_string(),
                expected: expected_shape.to_vec(),
                found: shape.to_vec(),
            });
        }
        Ok((dtype, bytes))
    }
}

/// The shape of `parts` concatenated along dim 0; an error if they are empty, scalars, or
/// disagree in their trailing dims.
pub fn concat_shape(parts: &[(&str, &[usize])]) -> Result<Vec<usize>, WeightError> {
    let Some(&(first, first_shape)) = parts.first() else {
        return Err(WeightError::Concat {
            first: "(none)".to_string(),
            tensor: "(none)".to_string(),
            expected: Vec::new(),
            found: Vec::new(),
        });
    };
    let mut rows = 0;
    for &(name, shape) in parts {
        let (Some((&r, trailing)), Some((_, first_trailing))) =
            (shape.split_first(), first_shape.split_first())
        else {
            return Err(WeightError::Concat {
                first: first.to_string(),
                tensor: name.to_string(),
                expected: first_shape.get(1..).unwrap_or_default().to_vec(),
                found: shape.to_vec(),
            });
        };
        if trailing != first_trailing {
            return Err(WeightError::Concat {
                first: first.to_string(),
                tensor: name.to_string(),
                expected: first_trailing.to_vec(),
                found: trailing.to_vec(),
            });
        }
        rows += r;
    }
    let mut shape = first_shape.to_vec();
    shape[0] = rows;
    Ok(shape)
}

fn dtype_error(name: &str, dtype: Dtype) -> WeightError {
    WeightError::Dtype {
        tensor: name.to_string(),
        found: format!("{dtype:?}"),
        expected: LOADABLE_DTYPES,
    }
}

fn dtype_bytes(dtype: Dtype) -> usize {
    dtype.bitsize() / 8
}

/// Little-endian 16-bit words of `bytes`.
pub(super) fn halves(bytes: &[u8]) -> impl Iterator<Item = u16> + '_ {
    bytes
        .chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
}

/// Little-endian f32 values of `bytes`.
pub(super) fn singles(bytes: &[u8]) -> impl Iterator<Item = f32> + '_ {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
}
