//! The gate/up projection of a prefill and the SwiGLU after it in one launch
//! (`linear_tma_swiglu`, `linear_tma_swiglu_fp8`): the projection's `[m, 2 ffn]` output is never
//! written, and the SwiGLU is written only as the down projection's stage images, bitwise what
//! `linear` then `silu_mul_staged` write.

use metrale_gpu_runtime::{DType, DevicePtr, GpuResult, StreamHandle};
use metrale_kernel_abi::{LIN_KC, LIN_TMA_TILE, LinearTmaSwigluFp8Params, LinearTmaSwigluParams};

use super::fp8::{FP8_STREAM_M_MAX, fp8_weight_takes_map, linear_fp8_operands};
use super::geometry::LINEAR_TMA_SWIGLU_SMEM;
use super::{
    LINEAR_SMALL_M_MAX, linear_operands, linear_staging_bytes, linear_tma_swiglu_geometry,
};
use crate::ops::Ops;
use crate::ops_view::Matrix;

impl Ops {
    /// The SwiGLU of `x` (`[m, k]`, whose stage images its producer wrote at `x_images`, see
    /// [`Ops::linear_staging`]) by the gate/up weight `w` (`[2 ffn, k]`, gate rows then up rows;
    /// bf16, or block FP8 with its scales), written as the stage images of `[m, ffn]` into the
    /// memory of `gate_up`, the bf16 `[m, 2 ffn]` projection the two launches would write (not
    /// overlapping `x_images`; above 128 rows it holds the images), for [`Ops::linear_staged`]
    /// of the down projection. Runs where the one-launch kernel serves the call: prefill rows
    /// (above the decode kernels' `m`), `ffn` a multiple of 64, `k` of 64, aligned operands,
    /// room for [`super::linear_staging_bytes`]`(m, ffn)`, and the weight's map of 64-row boxes
    /// in place (made here if need be). Returns whether it ran; if not, nothing was launched and
    /// the caller runs the projection and `silu_mul_staged`, whose images are the same.
    pub fn linear_swiglu_staged(
        &self,
        s: StreamHandle,
        (gate_up, x, w): (Matrix, Matrix, Matrix),
        x_images: DevicePtr,
    ) -> GpuResult<bool> {
        let (m, k) = (x.rows, x.cols);
        let ffn = w.rows / 2;
        // The operands as the two launches check them.
        let fp8 = w.dtype == DType::F8E4M3;
        let (wptr, scales) = if fp8 {
            let (p, _) = linear_fp8_operands(&gate_up, &x, &w)?;
            (p.w, Some((p.scales, p.scale_row_shift)))
        } else {
            (
                linear_operands("gemm::linear", DType::Bf16, &gate_up, &x, &w)?.w,
                None,
            )
        };
        let act_images = gate_up.ptr;
        let room = linear_staging_bytes(m, ffn) <= 2 * m as usize * w.rows as usize;
        let rows_ok = m > LINEAR_SMALL_M_MAX && (!fp8 || m > FP8_STREAM_M_MAX);
        // Gate and up of 64 columns a block: 2 ffn a multiple of 128.
        let shape_ok = w.rows.is_multiple_of(LIN_TMA_TILE)
            && k.is_multiple_of(2 * LIN_KC)
            && (!fp8 || fp8_weight_takes_map(k));
        let aligned = [act_images, x_images, wptr]
            .iter()
            .all(|p| p.0.is_multiple_of(16));
        if !(rows_ok && shape_ok && aligned && room && ffn > 0) {
            return Ok(false);
        }
        let Some(wmap) = self.tma_map_boxed(s, (wptr, w.dtype, w.rows, k), LIN_TMA_TILE / 2)?
        else {
            return Ok(false);
        };
        let kernel = match scales {
            None => self.k.linear_tma_swiglu,
            Some(_) => self.k.linear_tma_swiglu_fp8,
        };
        let sched = self.linear_tma_sched(s)?;
        let resident = self.linear_tma_resident(kernel, LINEAR_TMA_SWIGLU_SMEM)?;
        let cfg = linear_tma_swiglu_geometry(m, ffn, resident);
        match scales {
            None => {
                let q = LinearTmaSwigluParams {
                    img: act_images,
                    xt: x_images,
                    w: wptr,
                    wmap,
                    sched,
                    m,
                    n: ffn,
                    k,
                };
                self.go(kernel, cfg, &q, s)?;
            }
            Some((scales, scale_row_shift)) => {
                let q = LinearTmaSwigluFp8Params {
                    img: act_images,
                    xt: x_images,
                    w: wptr,
                    scales,
                    wmap,
                    sched,
                    m,
                    n: ffn,
                    k,
                    scale_row_shift,
                };
                self.go(kernel, cfg, &q, s)?;
            }
        }
        Ok(true)
    }
}
