//! `Matrix`: a typed view of a row-major matrix in device memory (where it starts, its element
//! type, its shape, and for a block-FP8 matrix its [`BlockScales`]), which the launchers take as
//! their operands instead of bare addresses and dimensions, and the checks that a launch's
//! operands agree before anything is launched.
//!
//! Invariant: a launcher that takes views checks every view against what the kernel reads
//! (element type) and against the others (shared dimensions), and refuses a mismatch with
//! `GpuError::BadOperand` naming the kernel, the operand and the mismatch; the kernel's
//! parameter struct is built from the checked views only.

use metrale_gpu_runtime::{DType, DevicePtr, GpuError, GpuResult};

use crate::weight_map::DenseWeight;

/// The scales of a block-FP8 matrix `[rows, cols]`: f32 `[ceil(rows / 2^row_shift),
/// ceil(cols / FP8_BLOCK)]`, element `(r, c)` standing for `bf16(e4m3 · scale[r >> row_shift][c /
/// FP8_BLOCK])`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockScales {
    /// The first scale.
    pub ptr: DevicePtr,
    /// log2 of the rows one scale row covers: `FP8_BLOCK_ROW_SHIFT` (the checkpoints' 128-row
    /// blocks) or 0 (a scale row per matrix row, for weights whose rows were concatenated or
    /// permuted across block boundaries).
    pub row_shift: u32,
}

/// A row-major matrix in device memory: `rows` rows of `cols` elements of `dtype`, contiguous.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Matrix {
    /// The first element.
    pub ptr: DevicePtr,
    /// Element type.
    pub dtype: DType,
    /// Rows.
    pub rows: u32,
    /// Elements per row.
    pub cols: u32,
    /// The block scales of an `F8E4M3` matrix; `None` for every other element type.
    pub scales: Option<BlockScales>,
}

impl Matrix {
    /// `[rows, cols]` of `dtype` at `ptr`.
    pub const fn new(ptr: DevicePtr, dtype: DType, rows: u32, cols: u32) -> Matrix {
        Matrix {
            ptr,
            dtype,
            rows,
            cols,
            scales: None,
        }
    }

    /// bf16 `[rows, cols]` at `ptr`.
    pub const fn bf16(ptr: DevicePtr, rows: u32, cols: u32) -> Matrix {
        Matrix::new(ptr, DType::Bf16, rows, cols)
    }

    /// f32 `[rows, cols]` at `ptr`.
    pub const fn f32(ptr: DevicePtr, rows: u32, cols: u32) -> Matrix {
        Matrix::new(ptr, DType::F32, rows, cols)
    }

    /// `(rows, cols)`.
    pub const fn shape(&self) -> (u32, u32) {
        (self.rows, self.cols)
    }
}

impl DenseWeight {
    /// The weight as a matrix: `[shape[0], the other dims multiplied]` (a vector is one row).
    /// A dimension past `u32::MAX` gives `u32::MAX`, which no launcher's checks accept.
    pub fn matrix(&self) -> Matrix {
        let clamp = |v: usize| u32::try_from(v).unwrap_or(u32::MAX);
        let (rows, cols) = match self.shape.as_slice() {
            [] => (1, 1),
            [n] => (1, *n),
            [rows, rest @ ..] => (*rows, rest.iter().product()),
        };
        Matrix {
            scales: self.scales,
            ..Matrix::new(self.ptr, self.dtype, clamp(rows), clamp(cols))
        }
    }
}

/// The operand checks of one launch of `kernel` (`module::name`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Operands {
    pub kernel: &'static str,
}

impl Operands {
    pub fn bad(&self, operand: &'static str, problem: String) -> GpuError {
        GpuError::BadOperand {
            kernel: self.kernel.to_string(),
            operand,
            problem,
        }
    }

    /// `m`'s element type is `dtype`.
    pub fn dtype(&self, operand: &'static str, m: &Matrix, dtype: DType) -> GpuResult<()> {
        if m.dtype != dtype {
            return Err(self.bad(
                operand,
                format!("is {}, the kernel reads {}", m.dtype.name(), dtype.name()),
            ));
        }
        Ok(())
    }

    /// `m` is `dtype` `[rows, cols]` (`what` says where the expected shape comes from).
    pub fn exactly(
        &self,
        operand: &'static str,
        m: &Matrix,
        dtype: DType,
        (rows, cols): (u32, u32),
        what: &str,
    ) -> GpuResult<()> {
        self.dtype(operand, m, dtype)?;
        if m.shape() != (rows, cols) {
            return Err(self.bad(
                operand,
                format!(
                    "is [{}, {}], but {what} makes it [{rows}, {cols}]",
                    m.rows, m.cols
                ),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mismatch_names_the_kernel_the_operand_and_both_shapes() {
        let check = Operands {
            kernel: "gemm::linear",
        };
        let w = Matrix::bf16(DevicePtr(256), 8, 4);
        assert!(check.exactly("w", &w, DType::Bf16, (8, 4), "x").is_ok());
        let e = check
            .exactly("w", &w, DType::Bf16, (4, 8), "x's columns")
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "kernel `gemm::linear`: operand `w`: is [8, 4], but x's columns makes it [4, 8]"
        );
        let e = check.dtype("w", &Matrix::f32(DevicePtr(256), 8, 4), DType::Bf16);
        assert!(
            e.unwrap_err()
                .to_string()
                .contains("is f32, the kernel reads bf16")
        );
        let weight = DenseWeight {
            ptr: DevicePtr(512),
            shape: vec![6, 2, 3],
            dtype: DType::Bf16,
            scales: None,
        };
        assert_eq!(weight.matrix(), Matrix::bf16(DevicePtr(512), 6, 6));
    }
}
