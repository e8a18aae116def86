//! Reading part of a tensor: `TensorSlice` names rows and columns of a tensor seen as a matrix,
//! and `SafetensorsSource::load_bf16_slice` / `load_f32_slice` read only those elements from the
//! memory map, so a tensor-parallel rank touches (and holds on the host) only its shard of a
//! checkpoint. Rows are contiguous in the file; a column range is read row by row.
//!
//! Invariant: a slice is checked against the tensor's shape before any element is read; a slice
//! past the tensor is an error naming the tensor, never a short read.

use std::ops::Range;

use half::{bf16, f16};
use safetensors::Dtype;

use crate::weight_map::convert::{halves, singles};
use crate::weight_map::error::WeightError;
use crate::weight_map::loader::{DenseWeight, WeightLoader};
use crate::weight_map::source::SafetensorsSource;

/// Part of a tensor seen as the matrix `[rows, cols]`, `cols` its last dim (a vector is the
/// column `[n, 1]`): the rows of `rows`, range after range, and of each row the columns `cols`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSlice {
    /// Row ranges, read in this order.
    pub rows: Vec<Range<usize>>,
    /// The columns kept of each row.
    pub cols: Range<usize>,
}

/// `(rows, cols)` of `shape` seen as a matrix.
pub fn matrix_dims(shape: &[usize]) -> (usize, usize) {
    match shape.split_last() {
        None => (1, 1),
        Some((&n, [])) => (n, 1),
        Some((&c, lead)) => (lead.iter().product(), c),
    }
}

impl TensorSlice {
    /// The whole of a tensor of `shape`.
    pub fn whole(shape: &[usize]) -> TensorSlice {
        let (r, c) = matrix_dims(shape);
        TensorSlice {
            rows: std::iter::once(0..r).collect(),
            cols: 0..c,
        }
    }

    /// Rows `rows` (every column) of a tensor of `shape`.
    pub fn rows(shape: &[usize], rows: Vec<Range<usize>>) -> TensorSlice {
        TensorSlice {
            rows,
            cols: 0..matrix_dims(shape).1,
        }
    }

    /// The one row range `rows` (every column) of a tensor of `shape`.
    pub fn row_span(shape: &[usize], rows: Range<usize>) -> TensorSlice {
        TensorSlice::rows(shape, std::iter::once(rows).collect())
    }

    /// Columns `cols` of every row of a tensor of `shape`.
    pub fn cols(shape: &[usize], cols: Range<usize>) -> TensorSlice {
        TensorSlice {
            rows: std::iter::once(0..matrix_dims(shape).0).collect(),
            cols,
        }
    }

    /// Rows the slice reads.
    pub fn num_rows(&self) -> usize {
        self.rows.iter().map(|r| r.len()).sum()
    }

    /// Elements the slice reads.
    pub fn numel(&self) -> usize {
        self.num_rows() * self.cols.len()
    }
}

impl SafetensorsSource {
    /// The bytes of `slice` of tensor `name` (which must have shape `expected_shape`), with the
    /// tensor's dtype; FP8 tensors are refused (their block scales do not slice with them).
    fn slice_bytes(
        &self,
        name: &str,
        expected_shape: &[usize],
        slice: &TensorSlice,
    ) -> Result<(Dtype, Vec<u8>), WeightError> {
        let problem = |problem: String| WeightError::Slice {
            tensor: name.to_string(),
            problem,
        };
        if self.is_fp8(name) {
            return Err(problem(
                "an FP8 tensor is read whole (its block scales do not slice with it)".into(),
            ));
        }
        let (dtype, shape, bytes) = self.raw(name)?;
        if !matches!(dtype, Dtype::BF16 | Dtype::F16 | Dtype::F32) {
            return Err(WeightError::Dtype {
                tensor: name.to_string(),
                found: format!("{dtype:?}"),
                expected: crate::weight_map::LOADABLE_DTYPES,
            });
        }
        if shape != expected_shape {
            return Err(WeightError::Shape {
                tensor: name.to_string(),
                expected: expected_shape.to_vec(),
                found: shape.to_vec(),
            });
        }
        let (rows, cols) = matrix_dims(shape);
        if let Some(r) = slice.rows.iter().find(|r| r.start > r.end || r.end > rows) {
            return Err(problem(format!("rows {r:?} of {rows}")));
        }
        if slice.cols.start > slice.cols.end || slice.cols.end > cols {
            return Err(problem(format!("columns {:?} of {cols}", slice.cols)));
        }
        let elem = dtype.bitsize() / 8;
        let mut out = Vec::with_capacity(slice.numel() * elem);
        for range in &slice.rows {
            if slice.cols == (0..cols) {
                out.extend_from_slice(&bytes[range.start * cols * elem..range.end * cols * elem]);
                continue;
            }
            for row in range.clone() {
                let at = row * cols;
                out.extend_from_slice(
                    &bytes[(at + slice.cols.start) * elem..(at + slice.cols.end) * elem],
                );
            }
        }
        Ok((dtype, out))
    }

    /// `slice` of tensor `name` (shape `expected_shape`) as bf16, reading only its elements.
    pub fn load_bf16_slice(
        &self,
        name: &str,
        expected_shape: &[usize],
        slice: &TensorSlice,
    ) -> Result<Vec<bf16>, WeightError> {
        let (dtype, bytes) = self.slice_bytes(name, expected_shape, slice)?;
        Ok(match dtype {
            Dtype::BF16 => halves(&bytes).map(bf16::from_bits).collect(),
            Dtype::F16 => halves(&bytes)
                .map(|b| bf16::from_f32(f16::from_bits(b).to_f32()))
                .collect(),
            _ => singles(&bytes).map(bf16::from_f32).collect(),
        })
    }

    /// `slice` of tensor `name` (shape `expected_shape`) as f32, reading only its elements.
    pub fn load_f32_slice(
        &self,
        name: &str,
        expected_shape: &[usize],
        slice: &TensorSlice,
    ) -> Result<Vec<f32>, WeightError> {
        let (dtype, bytes) = self.slice_bytes(name, expected_shape, slice)?;
        Ok(match dtype {
            Dtype::BF16 => halves(&bytes)
                .map(|b| bf16::from_bits(b).to_f32())
                .collect(),
            Dtype::F16 => halves(&bytes).map(|b| f16::from_bits(b).to_f32()).collect(),
            _ => singles(&bytes).collect(),
        })
    }
}

impl WeightLoader<'_> {
    /// Slices of several tensors, concatenated in order, as one bf16 weight of shape `shape`
    /// on the device (a tensor-parallel rank's part of a fused projection or expert stack).
    pub fn upload_bf16_slices(
        &self,
        parts: &[(&str, &[usize], TensorSlice)],
        shape: Vec<usize>,
    ) -> Result<DenseWeight, WeightError> {
        // `shape` comes from the config: reserve no more than the parts' tensors hold.
        let stored = (self.source).stored_numel(parts.iter().map(|(name, full, _)| (*name, *full)));
        let wanted = shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
        let mut data = Vec::with_capacity(wanted.unwrap_or(0).min(stored));
        for (name, full, slice) in parts {
            data.extend(self.source.load_bf16_slice(name, full, slice)?);
        }
        let label = (parts.iter().map(|(name, _, _)| *name))
            .collect::<Vec<_>>()
            .join(" + ");
        if Some(data.len()) != wanted {
            return Err(WeightError::Slice {
                tensor: label,
                problem: format!(
                    "{} elements read for a weight of shape {shape:?}",
                    data.len()
                ),
            });
        }
        self.upload(&label, &data, shape, metrale_gpu_runtime::DType::Bf16)
    }

    /// `slice` of tensor `name` as f32 on the device, of shape `shape`.
    pub fn upload_f32_slice(
        &self,
        name: &str,
        full: &[usize],
        slice: &TensorSlice,
        shape: Vec<usize>,
    ) -> Result<DenseWeight, WeightError> {
        let data = self.source.load_f32_slice(name, full, slice)?;
        self.upload(name, &data, shape, metrale_gpu_runtime::DType::F32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matrix_dims_see_the_last_dim_as_columns() {
        assert_eq!(matrix_dims(&[8, 2, 5]), (16, 5));
        assert_eq!(matrix_dims(&[7]), (7, 1));
        let s = TensorSlice::rows(&[8, 2, 5], vec![0..2, 9..12]);
        assert_eq!((s.num_rows(), s.numel()), (5, 25));
        assert_eq!(TensorSlice::cols(&[4, 6], 2..5).numel(), 12);
    }
}
