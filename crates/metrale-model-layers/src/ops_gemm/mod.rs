//! The `linear` launchers (bf16 and f32 out): one entry per output type, picking among the
//! narrow, wide and tiled kernels of `kernels/gemm.cu` by `m` (all give bitwise the same rows);
//! an `impl Ops` block beside `ops_rows`, `ops_hybrid` and `ops_fused`, under `ops`'s rules.
//! The operands are typed views (`Matrix`), checked against each other before anything runs.
//!
//! Prefill-sized calls run `linear_tma` where they can: x is first written as the stage images
//! the kernel copies whole (`permute_k32_tiles`, into the staging memory the model gives with
//! [`Ops::set_linear_staging`]), and the weight is read through a tensor map, encoded by the
//! backend and uploaded once per (weight, shape) into a slot of that memory. Without staging
//! memory large enough, an unaligned operand, `k % 8 != 0`, no free map slot, or a map that
//! would have to be uploaded while the stream captures a graph, the tiled kernel `linear` runs
//! instead (bitwise the same rows).
//!
//! A layer may skip the permute: where [`Ops::linear_staging`] offers the buffer, the producer
//! of a projection's input writes the images itself (`add_rms_norm_staged`,
//! `silu_mul_staged`) and [`Ops::linear_staged`] runs the projection from them. At prefill
//! sizes [`Ops::linear_swiglu_staged`] runs the gate/up projection and the SwiGLU as one
//! launch that writes only the down projection's images (`swiglu`).
//!
//! Decode-sized calls of 9..128 rows run `linear_stream_tma` where the weight has a map (the same
//! slots) and x fits it ([`linear_stream_tma_fits`]); from 17 rows, where every k segment is
//! whole stages ([`linear_stream_tma_takes_images`]), `linear_staging` offers the buffer at
//! decode sizes too, and the kernel's blocks bulk-copy their segments of x from the images
//! instead of copying x's rows (which the producer writes as well). Which kernel serves a shape,
//! and each kernel's launch geometry, are in `geometry` (re-exported here).

use std::collections::HashMap;
use std::sync::Arc;

use metrale_gpu_runtime::{
    DType, DevicePtr, GpuBackend, GpuError, GpuResult, KernelHandle, Residency, StreamHandle,
};
use metrale_kernel_abi::{
    KernelParams, LIN_KC, LIN_TMA_IMG_BYTES, LIN_TMA_THREADS, LIN_TMA_TILE, LinearParams,
    LinearStreamTmaParams, LinearTmaParams, PermuteK32TilesParams,
};
use parking_lot::Mutex;

use crate::ops::Ops;
use crate::ops_view::{Matrix, Operands};

mod fp8;
mod geometry;
mod swiglu;

pub use fp8::{
    FP8_STREAM_M_MAX, FP8_STREAM_TMA_M_MIN, Fp8Scratch, fp8_scale_bytes, fp8_weight_takes_map,
};
pub use geometry::*;

/// What `linear_tma` needs beside its operands, in device memory the caller owns (a model's
/// arena): room for x's stage images and for the weights' tensor maps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinearStaging {
    /// x's stage images (`permute_k32_tiles` or a `_staged` producer writes them).
    pub images: DevicePtr,
    /// Their bytes: [`linear_staging_bytes`] of the largest call that should run `linear_tma`.
    pub image_bytes: usize,
    /// Room for `map_slots` tensor maps of [`LINEAR_TMA_MAP_BYTES`] (128-byte aligned), one per
    /// weight `linear_tma` has read.
    pub maps: DevicePtr,
    /// How many maps fit; once they are taken, other weights run `linear`'s tiled kernel.
    pub map_slots: usize,
    /// `linear_tma`'s tile counter (`LinearTmaParams::sched`), zeroed before its first use.
    pub sched: DevicePtr,
}

/// Bytes of `linear_tma`'s tile counter in the staging memory (two u32, and room to keep the
/// maps after it 128-byte aligned).
const LINEAR_TMA_SCHED_BYTES: usize = 128;

/// Bytes of one weight's tensor map.
pub const LINEAR_TMA_MAP_BYTES: usize = 128;

impl LinearStaging {
    /// Bytes of one allocation holding `image_bytes` of images (a [`linear_staging_bytes`],
    /// a multiple of 16 KiB), the tile counter and then `map_slots` maps.
    pub fn bytes(image_bytes: usize, map_slots: usize) -> usize {
        image_bytes + LINEAR_TMA_SCHED_BYTES + map_slots * LINEAR_TMA_MAP_BYTES
    }

    /// The staging memory laid out in one allocation of [`LinearStaging::bytes`] at `base`
    /// (128-byte aligned): the images, the tile counter, then the maps.
    pub fn at(base: DevicePtr, image_bytes: usize, map_slots: usize) -> LinearStaging {
        let sched = base.0 + image_bytes as u64;
        LinearStaging {
            images: base,
            image_bytes,
            maps: DevicePtr(sched + LINEAR_TMA_SCHED_BYTES as u64),
            map_slots,
            sched: DevicePtr(sched),
        }
    }
}

/// `linear_tma`'s state, shared by an `Ops` and its clones: the staging memory and which map
/// slot holds which weight's tensor map.
#[derive(Debug)]
pub(crate) struct LinearTma {
    gpu: Arc<dyn GpuBackend>,
    state: Mutex<TmaState>,
}

#[derive(Debug, Default)]
struct TmaState {
    staging: Option<LinearStaging>,
    /// Map slots by (weight address, rows, columns, box rows).
    maps: HashMap<(u64, u32, u32, u32), DevicePtr>,
    /// Where prefill-sized `linear` of an FP8 weight writes its bf16 image (`ops_gemm::fp8`).
    fp8_scratch: Option<Fp8Scratch>,
    /// The staging memory's tile counter has been zeroed.
    sched_zeroed: bool,
}

impl LinearTma {
    pub(crate) fn new(gpu: Arc<dyn GpuBackend>) -> LinearTma {
        LinearTma {
            gpu,
            state: Mutex::default(),
        }
    }
}

/// Bytes of the stage images of an `[m, k]` x (`permute_k32_tiles`): `LIN_TMA_IMG_BYTES` per
/// 128-row tile and stage of 64 k.
pub fn linear_staging_bytes(m: u32, k: u32) -> usize {
    m.div_ceil(LIN_TMA_TILE) as usize * k.div_ceil(2 * LIN_KC) as usize * LIN_TMA_IMG_BYTES as usize
}

/// The shape of `out = x · wᵀ` from its checked operands: x bf16 `[m, k]`, w bf16 `[n, k]`, out
/// `out_dtype` `[m, n]`.
fn linear_operands(
    kernel: &'static str,
    out_dtype: DType,
    out: &Matrix,
    x: &Matrix,
    w: &Matrix,
) -> GpuResult<LinearParams> {
    let check = Operands { kernel };
    check.dtype("x", x, DType::Bf16)?;
    check.exactly("w", w, DType::Bf16, (w.rows, x.cols), "x")?;
    check.exactly("out", out, out_dtype, (x.rows, w.rows), "x and w")?;
    Ok(LinearParams {
        out: out.ptr,
        x: x.ptr,
        w: w.ptr,
        m: x.rows,
        n: w.rows,
        k: x.cols,
    })
}

impl Ops {
    /// `out[m, n] = x[m, k] · w[n, k]ᵀ`, bf16 out; `w` bf16, or block FP8 with its scales
    /// (`ops_gemm::fp8`).
    pub fn linear(&self, s: StreamHandle, out: Matrix, x: Matrix, w: Matrix) -> GpuResult<()> {
        if w.dtype == DType::F8E4M3 {
            return self.linear_fp8(s, out, x, w);
        }
        let p = linear_operands("gemm::linear", DType::Bf16, &out, &x, &w)?;
        self.gemm(s, false, &p)
    }

    /// `out[m, n] = x[m, k] · w[n, k]ᵀ`, f32 out (logits).
    pub fn linear_f32out(
        &self,
        s: StreamHandle,
        out: Matrix,
        x: Matrix,
        w: Matrix,
    ) -> GpuResult<()> {
        let p = linear_operands("gemm::linear_f32out", DType::F32, &out, &x, &w)?;
        self.gemm(s, true, &p)
    }

    /// Gives `linear` its prefill kernel's staging memory (see [`LinearStaging`]), so calls of
    /// more than [`LINEAR_SMALL_M_MAX`] rows whose images fit ([`linear_staging_bytes`]) run
    /// `linear_tma`; `None` takes it back (and with it every map). The memory must stay
    /// allocated, and be used by nothing else, while this `Ops` (or a clone) launches `linear`
    /// with it; one stream at a time may use it.
    pub fn set_linear_staging(&self, staging: Option<LinearStaging>) {
        let mut state = self.tma.state.lock();
        state.staging = staging;
        state.maps.clear();
        state.sched_zeroed = false;
    }

    /// The staging memory's tile counter for a `linear_tma` launch on `s`, zeroed on first use
    /// outside a graph capture; null (the blocks walk their share of the tiles) before that or
    /// without staging memory.
    pub(super) fn linear_tma_sched(&self, s: StreamHandle) -> GpuResult<DevicePtr> {
        let mut state = self.tma.state.lock();
        let Some(staging) = state.staging else {
            return Ok(DevicePtr::NULL);
        };
        if !state.sched_zeroed {
            match self.tma.gpu.copy_h2d(staging.sched, &[0u8; 8], s) {
                Ok(()) => state.sched_zeroed = true,
                Err(GpuError::Capture(_)) => return Ok(DevicePtr::NULL),
                Err(e) => return Err(e),
            }
        }
        Ok(staging.sched)
    }

    /// The staging memory, where a call of `m` rows by `k` inputs on weight `w` fits it: staging
    /// memory given, `k` a positive multiple of `k_step`, a 16-byte aligned weight, images that
    /// fit.
    fn staging_for(&self, w: DevicePtr, m: u32, k: u32, k_step: u32) -> Option<LinearStaging> {
        let staging = self.tma.state.lock().staging?;
        let fits = k > 0
            && k.is_multiple_of(k_step)
            && w.0.is_multiple_of(16)
            && staging.image_bytes >= linear_staging_bytes(m, k);
        fits.then_some(staging)
    }

    /// The device copy of `w`'s tensor map (`[n, k]` of `dtype`, bf16 or the bytes of an FP8
    /// weight; boxes of 64 k by 128 rows) in a slot of the staging memory, encoded and uploaded on
    /// first use through the backend the state was made with (a circuit recorder's launchers share
    /// it, so the upload is never recorded). A backend without tensor maps (the CPU) gets zeros,
    /// which its twins do not read. `None` where there is no staging memory, every slot is taken,
    /// or the stream is capturing a graph (an upload is refused then, before it reaches the
    /// driver); the caller then runs the tiled kernel, whose rows are the same.
    fn linear_tma_map(
        &self,
        s: StreamHandle,
        w: DevicePtr,
        dtype: DType,
        n: u32,
        k: u32,
    ) -> GpuResult<Option<DevicePtr>> {
        self.tma_map_boxed(s, (w, dtype, n, k), LIN_TMA_TILE)
    }

    /// [`Ops::linear_tma_map`] with boxes of `box_rows` rows (`linear_tma_swiglu`'s maps have
    /// 64); a weight may have a map of each.
    fn tma_map_boxed(
        &self,
        s: StreamHandle,
        (w, dtype, n, k): (DevicePtr, DType, u32, u32),
        box_rows: u32,
    ) -> GpuResult<Option<DevicePtr>> {
        let mut state = self.tma.state.lock();
        if let Some(&map) = state.maps.get(&(w.0, n, k, box_rows)) {
            return Ok(Some(map));
        }
        let Some(staging) = state.staging else {
            return Ok(None);
        };
        let slot = state.maps.len();
        if slot >= staging.map_slots {
            return Ok(None);
        }
        let gpu = &self.tma.gpu;
        let bytes = match gpu.tensor_map_2d(w, dtype, n, k, box_rows, 2 * LIN_KC) {
            Some(encoded) => encoded?,
            None => [0u8; LINEAR_TMA_MAP_BYTES],
        };
        let map = DevicePtr(staging.maps.0 + (slot * LINEAR_TMA_MAP_BYTES) as u64);
        match gpu.copy_h2d(map, &bytes, s) {
            Ok(()) => {}
            Err(GpuError::Capture(_)) => return Ok(None),
            Err(e) => return Err(e),
        }
        state.maps.insert((w.0, n, k, box_rows), map);
        Ok(Some(map))
    }

    /// The staging buffer, where a projection of `m` rows by the weight `w` (`[n, k]`, bf16 or
    /// block FP8 with its scales) can read x written as stage images by its producer (`_staged`
    /// launchers, then [`Ops::linear_staged`]): prefill-sized `m` (`linear_tma` or
    /// `linear_tma_fp8` reads the images), or decode rows that `linear_stream_tma` serves with
    /// every k segment whole stages ([`linear_stream_tma_takes_images`]: its blocks bulk-copy
    /// their segments); `k` a multiple of 64 (the producers write every k of every stage, no
    /// padding), a 16-byte aligned weight, images that fit, and the weight's tensor map in place
    /// (made here if need be). `None`: the producer writes rows only and the projection runs
    /// [`Ops::linear`].
    pub fn linear_staging(
        &self,
        s: StreamHandle,
        w: Matrix,
        m: u32,
    ) -> GpuResult<Option<DevicePtr>> {
        let (n, k) = w.shape();
        let mapped = match w.dtype {
            DType::Bf16 => true,
            DType::F8E4M3 => w.scales.is_some(),
            _ => false,
        };
        if !mapped || (m <= LINEAR_SMALL_M_MAX && !linear_stream_tma_takes_images(m, k)) {
            return Ok(None);
        }
        let Some(staging) = self.staging_for(w.ptr, m, k, 2 * LIN_KC) else {
            return Ok(None);
        };
        Ok(self
            .linear_tma_map(s, w.ptr, w.dtype, n, k)?
            .map(|_| staging.images))
    }

    /// `linear` (bf16 out) of an x that its producer wrote as stage images at `images` (see
    /// [`Ops::linear_staging`]): `linear_tma` (`linear_tma_fp8`) at prefill sizes (from the
    /// images alone), `linear_stream_tma` (`linear_stream_tma_fp8`) at decode sizes (the images,
    /// and x's rows, which the kernel reads where it cannot take the images: the producer wrote
    /// both).
    pub fn linear_staged(
        &self,
        s: StreamHandle,
        (out, x, w): (Matrix, Matrix, Matrix),
        images: DevicePtr,
    ) -> GpuResult<()> {
        let (m, n, k) = (x.rows, w.rows, x.cols);
        let refused = || GpuError::KernelFailed {
            kernel: "linear_staged".into(),
            problem: format!(
                "{m} rows of the [{n}, {k}] weight at {:#x} cannot be read from stage images (no \
                 tensor map, a shape `linear_staging` does not offer, or x's rows not 16-byte \
                 aligned)",
                w.ptr.0
            ),
        };
        if w.dtype == DType::F8E4M3 {
            let (p, _) = fp8::linear_fp8_operands(&out, &x, &w)?;
            return match self.linear_fp8_mapped(s, &p, Some(images))? {
                true => Ok(()),
                false => Err(refused()),
            };
        }
        let p = linear_operands("gemm::linear", DType::Bf16, &out, &x, &w)?;
        let map = self
            .linear_tma_map(s, p.w, DType::Bf16, n, k)?
            .ok_or_else(refused)?;
        if m > LINEAR_SMALL_M_MAX {
            return self.linear_tma_launch(s, self.k.linear_tma, &p, images, map);
        }
        match linear_stream_tma_row_blocks(m, k) {
            Some(row_blocks)
                if linear_stream_tma_takes_images(m, k) && p.x.0.is_multiple_of(16) =>
            {
                let q = LinearStreamTmaParams {
                    out: p.out,
                    x: p.x,
                    ximg: images,
                    w: p.w,
                    wmap: map,
                    m,
                    n,
                    k,
                };
                self.linear_stream_tma_launch(s, self.k.linear_stream_tma, (&q, n), row_blocks)
            }
            _ => Err(refused()),
        }
    }

    /// x `[m, k]` as the stage images `linear_tma` copies whole, into `images`.
    fn permute_k32_tiles(
        &self,
        s: StreamHandle,
        images: DevicePtr,
        x: DevicePtr,
        (m, k): (u32, u32),
    ) -> GpuResult<()> {
        let p = PermuteK32TilesParams {
            out: images,
            x,
            m,
            k,
        };
        self.go(self.k.permute_k32_tiles, permute_geometry(m, k), &p, s)
    }

    /// `linear_stream_tma` (`kernel`: bf16 or f32 out, or its FP8 twin) of `p`, `n` output
    /// columns, x in `row_blocks` row blocks.
    fn linear_stream_tma_launch<P: KernelParams>(
        &self,
        s: StreamHandle,
        kernel: KernelHandle,
        (p, n): (&P, u32),
        row_blocks: u32,
    ) -> GpuResult<()> {
        let resident = self.resident(
            kernel,
            LINEAR_STREAM_TMA_THREADS,
            LINEAR_STREAM_TMA_SMEM,
            LINEAR_STREAM_TMA_CLUSTERS,
            Residency::Clusters,
        )?;
        let cfg = linear_stream_tma_geometry(n, row_blocks, resident);
        self.go(kernel, cfg, p, s)
    }

    /// `linear_tma` (`kernel`: bf16 or f32 out) of `p`'s x from its stage images at `images`,
    /// the weight read through its tensor map `map`.
    fn linear_tma_launch(
        &self,
        s: StreamHandle,
        kernel: KernelHandle,
        p: &LinearParams,
        images: DevicePtr,
        map: DevicePtr,
    ) -> GpuResult<()> {
        let q = LinearTmaParams {
            out: p.out,
            xt: images,
            w: p.w,
            wmap: map,
            sched: self.linear_tma_sched(s)?,
            m: p.m,
            n: p.n,
            k: p.k,
        };
        let resident = self.linear_tma_resident(kernel, LINEAR_TMA_SMEM)?;
        let cfg = linear_tma_geometry(p.m, p.n, resident);
        self.go(kernel, cfg, &q, s)
    }

    /// How many blocks of `kernel` (`linear_tma` or a twin of its geometry) are resident at once
    /// (0 where the backend cannot say: a block a tile).
    fn linear_tma_resident(&self, kernel: KernelHandle, smem: u32) -> GpuResult<u32> {
        self.resident(kernel, LIN_TMA_THREADS, smem, 0, Residency::Blocks)
    }

    /// The narrow, narrow-b4, wide, tiled, tensor-map prefill and tensor-map decode variants of
    /// `linear` (bitwise the same rows), bf16 or f32 out.
    fn gemm_kernels(&self, f32_out: bool) -> [KernelHandle; 6] {
        let k = &self.k;
        if f32_out {
            [
                k.linear_stream_f32out,
                k.linear_stream_b4_f32out,
                k.linear_stream_wide_f32out,
                k.linear_f32out,
                k.linear_tma_f32out,
                k.linear_stream_tma_f32out,
            ]
        } else {
            [
                k.linear_stream,
                k.linear_stream_b4,
                k.linear_stream_wide,
                k.linear,
                k.linear_tma,
                k.linear_stream_tma,
            ]
        }
    }

    /// One `linear` launch of checked operands `p` through [`Ops::gemm_kernels`]`(f32_out)`;
    /// the shape picks which serves.
    fn gemm(&self, s: StreamHandle, f32_out: bool, p: &LinearParams) -> GpuResult<()> {
        let kernels = self.gemm_kernels(f32_out);
        let (m, n, k, x, w) = (p.m, p.n, p.k, p.x, p.w);
        let path = linear_path(m, n);
        // `linear_tma` where it can: `permute_k32_tiles` writes any k % 8 == 0 (zeros past k)
        // from a 16-byte aligned x.
        if path == LinearPath::Tiled
            && x.0.is_multiple_of(16)
            && let Some(staging) = self.staging_for(w, m, k, 8)
            && let Some(map) = self.linear_tma_map(s, w, DType::Bf16, n, k)?
        {
            let images = staging.images;
            self.permute_k32_tiles(s, images, x, (m, k))?;
            return self.linear_tma_launch(s, kernels[4], p, images, map);
        }
        // `linear_stream_tma` for the decode rows it serves (see [`linear_stream_tma_fits`])
        // where the weight has a map.
        if path != LinearPath::Tiled
            && let Some(row_blocks) = linear_stream_tma_row_blocks(m, k)
            && x.0.is_multiple_of(16)
            && w.0.is_multiple_of(16)
            && let Some(map) = self.linear_tma_map(s, w, DType::Bf16, n, k)?
        {
            let q = LinearStreamTmaParams {
                out: p.out,
                x,
                ximg: DevicePtr::NULL,
                w,
                wmap: map,
                m,
                n,
                k,
            };
            return self.linear_stream_tma_launch(s, kernels[5], (&q, n), row_blocks);
        }
        let kernel = match path {
            LinearPath::Narrow => kernels[0],
            LinearPath::NarrowB4 => kernels[1],
            LinearPath::Wide => kernels[2],
            LinearPath::Tiled => kernels[3],
        };
        self.linear_direct_launch(s, kernel, path, p)
    }

    /// `kernel`, a direct-load kernel of `path`, with `linear`'s parameters `p`: the grid from
    /// the shapes, the narrow kernels' on as many blocks as are resident.
    pub(crate) fn linear_direct_launch(
        &self,
        s: StreamHandle,
        kernel: KernelHandle,
        path: LinearPath,
        p: &LinearParams,
    ) -> GpuResult<()> {
        let resident = match path {
            LinearPath::Narrow | LinearPath::NarrowB4 => self.resident(
                kernel,
                LINEAR_NARROW_THREADS,
                0,
                LINEAR_NARROW_RESIDENT,
                Residency::Blocks,
            )?,
            LinearPath::Wide | LinearPath::Tiled => 0,
        };
        self.go(kernel, linear_geometry(path, p.m, p.n, resident), p, s)
    }
}

#[cfg(test)]
mod tests;
