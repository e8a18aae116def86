//! `linear` of a block-FP8 weight, and the conversions between bf16 and block FP8
//! (`quantize_fp8`, `dequant_fp8`); an `impl Ops` block beside the bf16 launchers.
//!
//! Numerics: an FP8 weight stands for the bf16 weight `dequant_fp8` writes (each element
//! bf16(e4m3 · its block's scale)), and every path computes `linear` of that bf16 weight with
//! `linear`'s reduction order, so an FP8 projection's rows are bitwise the bf16 projection's
//! on the dequantized weight, whatever the row count and the path:
//! - up to [`FP8_STREAM_M_MAX`] rows (decode, verify), the decode kernels, which convert the
//!   weight in registers as they stream it (one byte an element from memory instead of two):
//!   `linear_stream_tma_fp8` (`linear_stream_tma` with the e4m3 bytes through the weight's
//!   tensor map) from [`FP8_STREAM_TMA_M_MIN`] rows, where `linear_stream_tma` serves the rows
//!   and the weight has a map (a slot of the staging memory, `k` a multiple of 16, aligned
//!   operands); otherwise
//!   `linear_stream_fp8` (persistent blocks of one row tile a unit) up to
//!   `LINEAR_NARROW_M_MAX` rows and `linear_stream_wide_fp8` (clusters of 128 columns by 64 rows
//!   through a shared-memory ring, each weight fragment converted once for four row tiles)
//!   above;
//! - more rows (prefill): `permute_k32_tiles` then `linear_tma_fp8` (`linear_tma` converting
//!   each weight fragment as its MMAs load it) where the staging memory takes x's images and
//!   the weight has a map; else, where the model gave scratch memory large enough
//!   ([`Ops::set_fp8_scratch`]), `dequant_fp8` into it, then the bf16 `linear`;
//! - otherwise the decode kernels.

use metrale_gpu_runtime::{DType, DevicePtr, GpuResult, LaunchConfig, Residency, StreamHandle};
use metrale_kernel_abi::{
    DequantFp8Params, FP8_BLOCK, FP8_BLOCK_ROW_SHIFT, FP8_CONVERT_THREADS, LinearFp8Params,
    LinearParams, LinearStreamTmaFp8Params, LinearTmaFp8Params, QuantizeFp8Params,
};

use super::{
    LINEAR_NARROW_M_MAX, LINEAR_NARROW_RESIDENT, LINEAR_NARROW_THREADS, LinearPath,
    geometry::LINEAR_TMA_SMEM, linear_geometry, linear_stream_tma_row_blocks,
    linear_stream_tma_takes_images, linear_tma_geometry, linear_wide_fp8_geometry,
};
use crate::ops::Ops;
use crate::ops_view::{BlockScales, Matrix, Operands};

/// The most rows `linear` of an FP8 weight streams with `linear_stream_fp8`; more rows
/// dequantize the weight into the scratch memory and run the bf16 kernels, where there is some.
pub const FP8_STREAM_M_MAX: u32 = 128;

/// The fewest rows `linear_stream_tma_fp8` serves. Below, `linear_stream_fp8` is faster: each
/// warp converts only the weight fragments its rows need, where the tensor-map kernel converts a
/// whole 64-row wgmma fragment for every k step whatever the rows (Qwen3-8B's projections,
/// weights rotated past L2: at 16 rows gate_up 51.5 us against 66.2, o 10.8 against 18.3; at 32
/// rows 90.9 against 67.3 and 21.5 against 19.3, `lab/fp8_tma_lab.cu`).
pub const FP8_STREAM_TMA_M_MIN: u32 = LINEAR_NARROW_M_MAX + 1;

/// Whether an FP8 weight of `k` inputs can have a tensor map: its map's rows are its bytes, and a
/// map's row stride must be a multiple of 16 bytes. The others run the map-less kernels (and
/// dequantize into scratch memory at prefill sizes).
pub fn fp8_weight_takes_map(k: u32) -> bool {
    k.is_multiple_of(16)
}

/// Blocks of a `dequant_fp8` launch: enough to keep every multiprocessor streaming.
const DEQUANT_BLOCKS: u32 = 1056;

/// Scratch memory for the bf16 image of one FP8 weight (prefill-sized `linear`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fp8Scratch {
    /// Its start (16-byte aligned).
    pub ptr: DevicePtr,
    /// Its bytes: 2 per element of the largest FP8 weight it should serve.
    pub bytes: usize,
}

/// The checked operands of `linear` with an FP8 weight: x bf16 `[m, k]`, w fp8 `[n, k]` with
/// its scales, out bf16 `[m, n]`.
pub(super) fn linear_fp8_operands(
    out: &Matrix,
    x: &Matrix,
    w: &Matrix,
) -> GpuResult<(LinearFp8Params, BlockScales)> {
    let check = Operands {
        kernel: "gemm::linear_stream_fp8",
    };
    check.dtype("x", x, DType::Bf16)?;
    check.exactly("w", w, DType::F8E4M3, (w.rows, x.cols), "x")?;
    check.exactly("out", out, DType::Bf16, (x.rows, w.rows), "x and w")?;
    let scales = fp8_scales(&check, "w", w)?;
    let p = LinearFp8Params {
        out: out.ptr,
        x: x.ptr,
        w: w.ptr,
        scales: scales.ptr,
        m: x.rows,
        n: w.rows,
        k: x.cols,
        scale_row_shift: scales.row_shift,
    };
    Ok((p, scales))
}

/// The scales of FP8 operand `m`, which it must have.
fn fp8_scales(check: &Operands, operand: &'static str, m: &Matrix) -> GpuResult<BlockScales> {
    match m.scales {
        Some(s) if s.row_shift == 0 || s.row_shift == FP8_BLOCK_ROW_SHIFT => Ok(s),
        Some(s) => Err(check.bad(
            operand,
            format!(
                "has scale rows of 2^{} rows; the kernels read 1 or {FP8_BLOCK}",
                s.row_shift
            ),
        )),
        None => Err(check.bad(operand, "is fp8_e4m3 without block scales".into())),
    }
}

impl Ops {
    /// Gives prefill-sized `linear` of FP8 weights scratch memory for their bf16 image (see
    /// the module header); `None` takes it back. The memory must stay allocated, and be used by
    /// nothing else, while this `Ops` (or a clone) launches `linear` with it.
    pub fn set_fp8_scratch(&self, scratch: Option<Fp8Scratch>) {
        self.tma.state.lock().fp8_scratch = scratch;
    }

    /// `out[m, n] = x[m, k] · w[n, k]ᵀ` for a block-FP8 `w`, bf16 out (see the module header for
    /// the path).
    pub(super) fn linear_fp8(
        &self,
        s: StreamHandle,
        out: Matrix,
        x: Matrix,
        w: Matrix,
    ) -> GpuResult<()> {
        let (p, scales) = linear_fp8_operands(&out, &x, &w)?;
        if self.linear_fp8_mapped(s, &p, None)? {
            return Ok(());
        }
        let need = 2 * p.n as usize * p.k as usize;
        let scratch = self.tma.state.lock().fp8_scratch;
        if p.m > FP8_STREAM_M_MAX
            && let Some(scratch) = scratch.filter(|sc| sc.bytes >= need)
        {
            let image = Matrix::bf16(scratch.ptr, p.n, p.k);
            self.dequant_fp8(
                s,
                image,
                Matrix {
                    scales: Some(scales),
                    ..w
                },
            )?;
            let q = LinearParams {
                out: p.out,
                x: p.x,
                w: scratch.ptr,
                m: p.m,
                n: p.n,
                k: p.k,
            };
            return self.gemm(s, false, &q);
        }
        if p.m > LINEAR_NARROW_M_MAX {
            return self.go(
                self.k.linear_stream_wide_fp8,
                linear_wide_fp8_geometry(p.m, p.n),
                &p,
                s,
            );
        }
        let kernel = self.k.linear_stream_fp8;
        let resident = self.resident(
            kernel,
            LINEAR_NARROW_THREADS,
            0,
            LINEAR_NARROW_RESIDENT,
            Residency::Blocks,
        )?;
        self.go(
            kernel,
            linear_geometry(LinearPath::Narrow, p.m, p.n, resident),
            &p,
            s,
        )
    }

    /// `linear` of `p` through the tensor-map kernels where they serve it (see the module
    /// header); whether they did. `images`: x's stage images, written by its producer
    /// (`Ops::linear_staged`), which the prefill kernel reads instead of permuting x and the
    /// decode kernel beside x's rows where its segments are whole stages; without them the
    /// decode kernel reads x's rows. An FP8 weight's map rows are its bytes, so `k` must be a
    /// multiple of 16.
    pub(super) fn linear_fp8_mapped(
        &self,
        s: StreamHandle,
        p: &LinearFp8Params,
        images: Option<DevicePtr>,
    ) -> GpuResult<bool> {
        let (m, n, k) = (p.m, p.n, p.k);
        let aligned = p.x.0.is_multiple_of(16) && p.w.0.is_multiple_of(16);
        if !fp8_weight_takes_map(k) || !aligned || m < FP8_STREAM_TMA_M_MIN {
            return Ok(false);
        }
        let prefill = m > FP8_STREAM_M_MAX;
        let row_blocks = linear_stream_tma_row_blocks(m, k);
        let xt = match images {
            Some(images) => Some(images),
            None if prefill => self.staging_for(p.w, m, k, 16).map(|st| st.images),
            None => None,
        };
        let ximg = match images {
            Some(images) if linear_stream_tma_takes_images(m, k) => images,
            Some(_) if !prefill => return Ok(false),
            _ => DevicePtr::NULL,
        };
        if (prefill && xt.is_none()) || (!prefill && row_blocks.is_none()) {
            return Ok(false);
        }
        let Some(wmap) = self.linear_tma_map(s, p.w, DType::F8E4M3, n, k)? else {
            return Ok(false);
        };
        match (xt, row_blocks) {
            (Some(xt), _) if prefill => {
                if images.is_none() {
                    self.permute_k32_tiles(s, xt, p.x, (m, k))?;
                }
                let q = LinearTmaFp8Params {
                    out: p.out,
                    xt,
                    w: p.w,
                    scales: p.scales,
                    wmap,
                    sched: self.linear_tma_sched(s)?,
                    m,
                    n,
                    k,
                    scale_row_shift: p.scale_row_shift,
                };
                let resident = self.linear_tma_resident(self.k.linear_tma_fp8, LINEAR_TMA_SMEM)?;
                self.go(
                    self.k.linear_tma_fp8,
                    linear_tma_geometry(m, n, resident),
                    &q,
                    s,
                )?;
            }
            (_, Some(row_blocks)) => {
                let q = LinearStreamTmaFp8Params {
                    out: p.out,
                    x: p.x,
                    ximg,
                    w: p.w,
                    scales: p.scales,
                    wmap,
                    m,
                    n,
                    k,
                    scale_row_shift: p.scale_row_shift,
                };
                let kernel = self.k.linear_stream_tma_fp8;
                self.linear_stream_tma_launch(s, kernel, (&q, n), row_blocks)?;
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// `out = bf16(w · its block scales)`: FP8 `w` `[n, k]` as the bf16 `[n, k]` it stands for.
    pub fn dequant_fp8(&self, s: StreamHandle, out: Matrix, w: Matrix) -> GpuResult<()> {
        let check = Operands {
            kernel: "gemm::dequant_fp8",
        };
        check.dtype("w", &w, DType::F8E4M3)?;
        check.exactly("out", &out, DType::Bf16, w.shape(), "w")?;
        let scales = fp8_scales(&check, "w", &w)?;
        let p = DequantFp8Params {
            out: out.ptr,
            w: w.ptr,
            scales: scales.ptr,
            n: w.rows,
            k: w.cols,
            scale_row_shift: scales.row_shift,
        };
        let blocks = (w.rows as u64 * w.cols as u64)
            .div_ceil(u64::from(FP8_CONVERT_THREADS))
            .clamp(1, u64::from(DEQUANT_BLOCKS)) as u32;
        let cfg = LaunchConfig::grid2(blocks, 1, FP8_CONVERT_THREADS).with_programmatic();
        self.go(self.k.dequant_fp8, cfg, &p, s)
    }

    /// Quantize bf16 `w` `[n, k]` into FP8 `out` `[n, k]` and its scales (which must be
    /// 128-row blocks: `[ceil(n / 128), ceil(k / 128)]`), with the checkpoints' block recipe.
    pub fn quantize_fp8(&self, s: StreamHandle, out: Matrix, w: Matrix) -> GpuResult<()> {
        let check = Operands {
            kernel: "gemm::quantize_fp8",
        };
        check.dtype("w", &w, DType::Bf16)?;
        check.exactly("out", &out, DType::F8E4M3, w.shape(), "w")?;
        let scales = fp8_scales(&check, "out", &out)?;
        if scales.row_shift != FP8_BLOCK_ROW_SHIFT {
            return Err(check.bad("out", "must have 128-row scale blocks".into()));
        }
        let p = QuantizeFp8Params {
            out: out.ptr,
            scales: scales.ptr,
            w: w.ptr,
            n: w.rows,
            k: w.cols,
        };
        if w.rows == 0 || w.cols == 0 {
            return Ok(());
        }
        let cfg = LaunchConfig::grid2(
            w.cols.div_ceil(FP8_BLOCK),
            w.rows.div_ceil(FP8_BLOCK),
            FP8_CONVERT_THREADS,
        )
        .with_programmatic();
        self.go(self.k.quantize_fp8, cfg, &p, s)
    }
}

/// Bytes of the scales of an `[n, k]` FP8 matrix whose scale rows cover `2^row_shift` rows.
pub fn fp8_scale_bytes(n: u32, k: u32, row_shift: u32) -> usize {
    let rows = if n == 0 {
        0
    } else {
        ((n - 1) >> row_shift) + 1
    };
    4 * rows as usize * k.div_ceil(FP8_BLOCK) as usize
}
