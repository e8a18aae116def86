//! The `linear` launchers (bf16 and f32 out): one entry per output type, picking among the
//! narrow, wide and tiled kernels of `kernels/gemm.cu` by `m` (all give bitwise the same rows);
//! a fourth `impl Ops` block beside `ops`, `ops_hybrid` and `ops_fused`, under `ops`'s rules.
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
//! `silu_mul_staged`) and [`Ops::linear_staged`] runs the projection from them.
//!
//! Decode-sized calls of 9..128 rows run `linear_stream_tma` where the weight has a map (the same
//! slots) and x fits it ([`linear_stream_tma_fits`]); from 17 rows, where every k segment is
//! whole stages ([`linear_stream_tma_takes_images`]), `linear_staging` offers the buffer at
//! decode sizes too, and the kernel's blocks bulk-copy their segments of x from the images
//! instead of copying x's rows (which the producer writes as well). Which kernel serves a shape,
//! and each kernel's launch geometry, are in `geometry` (re-exported here).

use std::collections::HashMap;
use std::sync::Arc;

use metrale_gpu_runtime::{DevicePtr, GpuBackend, GpuError, GpuResult, KernelHandle, StreamHandle};
use parking_lot::Mutex;

use crate::ops::Ops;

mod geometry;

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
}

/// Bytes of one weight's tensor map.
pub const LINEAR_TMA_MAP_BYTES: usize = 128;

impl LinearStaging {
    /// Bytes of one allocation holding `image_bytes` of images (a [`linear_staging_bytes`],
    /// a multiple of 16 KiB) and then `map_slots` maps.
    pub fn bytes(image_bytes: usize, map_slots: usize) -> usize {
        image_bytes + map_slots * LINEAR_TMA_MAP_BYTES
    }

    /// The staging memory laid out in one allocation of [`LinearStaging::bytes`] at `base`
    /// (128-byte aligned): the images, then the maps.
    pub fn at(base: DevicePtr, image_bytes: usize, map_slots: usize) -> LinearStaging {
        LinearStaging {
            images: base,
            image_bytes,
            maps: DevicePtr(base.0 + image_bytes as u64),
            map_slots,
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
    /// Map slots by (weight address, rows, columns).
    maps: HashMap<(u64, u32, u32), DevicePtr>,
}

impl LinearTma {
    pub(crate) fn new(gpu: Arc<dyn GpuBackend>) -> LinearTma {
        LinearTma {
            gpu,
            state: Mutex::default(),
        }
    }
}

/// `linear_stream_tma`'s x: its rows, and its stage images or NULL.
#[derive(Debug, Clone, Copy)]
struct StreamTmaX {
    rows: DevicePtr,
    images: DevicePtr,
}

/// Rows of `linear_tma`'s output tile (x rows and weight rows; `LIN_TMA_TILE`).
const LINEAR_TMA_TILE: u32 = 128;

/// Bytes of the stage images of an `[m, k]` x (`permute_k32_tiles`): 16 KiB per 128-row tile
/// and stage of 64 k.
pub fn linear_staging_bytes(m: u32, k: u32) -> usize {
    m.div_ceil(LINEAR_TMA_TILE) as usize * k.div_ceil(64) as usize * 16384
}

impl Ops {
    /// `out[m, n] = x[m, k] · w[n, k]ᵀ`, bf16 out.
    #[allow(clippy::too_many_arguments)]
    pub fn linear(
        &self,
        s: StreamHandle,
        out: DevicePtr,
        x: DevicePtr,
        w: DevicePtr,
        m: u32,
        n: u32,
        k: u32,
    ) -> GpuResult<()> {
        self.gemm(s, false, out, x, w, m, n, k)
    }

    /// `out[m, n] = x[m, k] · w[n, k]ᵀ`, f32 out (logits).
    #[allow(clippy::too_many_arguments)]
    pub fn linear_f32out(
        &self,
        s: StreamHandle,
        out: DevicePtr,
        x: DevicePtr,
        w: DevicePtr,
        m: u32,
        n: u32,
        k: u32,
    ) -> GpuResult<()> {
        self.gemm(s, true, out, x, w, m, n, k)
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

    /// The device copy of `w`'s tensor map (`[n, k]`, boxes of 64 k by 128 rows) in a slot of
    /// the staging memory, encoded and uploaded on first use through the backend the state was
    /// made with (a circuit recorder's launchers share it, so the upload is never recorded). A
    /// backend without tensor maps (the CPU) gets zeros, which its twins do not read. `None`
    /// where there is no staging memory, every slot is taken, or the stream is capturing a
    /// graph (an upload is refused then, before it reaches the driver); the caller then runs
    /// the tiled kernel, whose rows are the same.
    fn linear_tma_map(
        &self,
        s: StreamHandle,
        w: DevicePtr,
        n: u32,
        k: u32,
    ) -> GpuResult<Option<DevicePtr>> {
        let mut state = self.tma.state.lock();
        if let Some(&map) = state.maps.get(&(w.0, n, k)) {
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
        let bytes = match gpu.tensor_map_bf16(w, n, k, LINEAR_TMA_TILE, 64) {
            Some(encoded) => encoded?,
            None => [0u8; LINEAR_TMA_MAP_BYTES],
        };
        let map = DevicePtr(staging.maps.0 + (slot * LINEAR_TMA_MAP_BYTES) as u64);
        match gpu.copy_h2d(map, &bytes, s) {
            Ok(()) => {}
            Err(GpuError::Capture(_)) => return Ok(None),
            Err(e) => return Err(e),
        }
        state.maps.insert((w.0, n, k), map);
        Ok(Some(map))
    }

    /// The staging buffer, where a projection of `m` rows by `k` inputs on weight `w` (`n`
    /// rows) can read x written as stage images by its producer (`_staged` launchers, then
    /// [`Ops::linear_staged`]): prefill-sized `m` (`linear_tma` reads the images), or decode
    /// rows that `linear_stream_tma` serves with every k segment whole stages
    /// ([`linear_stream_tma_takes_images`]: its blocks bulk-copy their segments); `k` a multiple
    /// of 64 (the producers write every k of every stage, no padding), a 16-byte aligned weight,
    /// images that fit, and the weight's tensor map in place (made here if need be). `None`:
    /// the producer writes rows only and the projection runs [`Ops::linear`].
    pub fn linear_staging(
        &self,
        s: StreamHandle,
        w: DevicePtr,
        m: u32,
        n: u32,
        k: u32,
    ) -> GpuResult<Option<DevicePtr>> {
        if m <= LINEAR_SMALL_M_MAX && !linear_stream_tma_takes_images(m, k) {
            return Ok(None);
        }
        let Some(staging) = self.staging_for(w, m, k, 64) else {
            return Ok(None);
        };
        Ok(self.linear_tma_map(s, w, n, k)?.map(|_| staging.images))
    }

    /// `linear` (bf16 out) of an x that its producer wrote as stage images at `images` (see
    /// [`Ops::linear_staging`]): `linear_tma` at prefill sizes (from the images alone),
    /// `linear_stream_tma` at decode sizes (the images, and x's rows at `x`, which the kernel
    /// reads where it cannot take the images: the producer wrote both).
    #[allow(clippy::too_many_arguments)]
    pub fn linear_staged(
        &self,
        s: StreamHandle,
        out: DevicePtr,
        x: DevicePtr,
        images: DevicePtr,
        w: DevicePtr,
        m: u32,
        n: u32,
        k: u32,
    ) -> GpuResult<()> {
        let decode = m <= LINEAR_SMALL_M_MAX;
        let map = self.linear_tma_map(s, w, n, k)?;
        match (
            map,
            decode.then(|| linear_stream_tma_row_blocks(m, k)).flatten(),
        ) {
            (Some(map), None) if !decode => {
                self.linear_tma_launch(s, self.k.linear_tma, out, images, w, map, (m, n, k))
            }
            (Some(map), Some(row_blocks))
                if linear_stream_tma_takes_images(m, k) && x.0.is_multiple_of(16) =>
            {
                let kernel = self.k.linear_stream_tma;
                let x = StreamTmaX { rows: x, images };
                self.linear_stream_tma_launch(s, kernel, out, x, w, map, (m, n, k), row_blocks)
            }
            _ => Err(GpuError::KernelFailed {
                kernel: "linear_staged".into(),
                problem: format!(
                    "{m} rows of the [{n}, {k}] weight at {:#x} cannot be read from stage \
                     images (no tensor map, a shape `linear_staging` does not offer, or x's rows \
                     not 16-byte aligned)",
                    w.0
                ),
            }),
        }
    }

    /// `linear_stream_tma` (`kernel`: bf16 or f32 out) in `row_blocks` row blocks, the weight
    /// through its tensor map.
    #[allow(clippy::too_many_arguments)]
    fn linear_stream_tma_launch(
        &self,
        s: StreamHandle,
        kernel: KernelHandle,
        out: DevicePtr,
        x: StreamTmaX,
        w: DevicePtr,
        map: DevicePtr,
        (m, n, k): (u32, u32, u32),
        row_blocks: u32,
    ) -> GpuResult<()> {
        let resident = self.resident_clusters(
            kernel,
            LINEAR_STREAM_TMA_THREADS,
            LINEAR_STREAM_TMA_SMEM,
            LINEAR_STREAM_TMA_CLUSTERS,
        )?;
        self.go(
            kernel,
            linear_stream_tma_geometry(n, row_blocks, resident),
            &[
                out.into(),
                x.rows.into(),
                x.images.into(),
                w.into(),
                map.into(),
                m.into(),
                n.into(),
                k.into(),
            ],
            s,
        )
    }

    /// `linear_tma` (`kernel`: bf16 or f32 out) of x's stage images, the weight read through its
    /// tensor map.
    #[allow(clippy::too_many_arguments)]
    fn linear_tma_launch(
        &self,
        s: StreamHandle,
        kernel: KernelHandle,
        out: DevicePtr,
        images: DevicePtr,
        w: DevicePtr,
        map: DevicePtr,
        (m, n, k): (u32, u32, u32),
    ) -> GpuResult<()> {
        self.go(
            kernel,
            linear_tma_geometry(m, n),
            &[
                out.into(),
                images.into(),
                w.into(),
                map.into(),
                m.into(),
                n.into(),
                k.into(),
            ],
            s,
        )
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

    /// One `linear` launch through [`Ops::gemm_kernels`]`(f32_out)`; the shape picks which
    /// serves.
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        s: StreamHandle,
        f32_out: bool,
        out: DevicePtr,
        x: DevicePtr,
        w: DevicePtr,
        m: u32,
        n: u32,
        k: u32,
    ) -> GpuResult<()> {
        let kernels = self.gemm_kernels(f32_out);
        let path = linear_path(m, n);
        // `linear_tma` where it can: `permute_k32_tiles` writes any k % 8 == 0 (zeros past k)
        // from a 16-byte aligned x.
        if path == LinearPath::Tiled
            && x.0.is_multiple_of(16)
            && let Some(staging) = self.staging_for(w, m, k, 8)
            && let Some(map) = self.linear_tma_map(s, w, n, k)?
        {
            let images = staging.images;
            self.go(
                self.k.permute_k32_tiles,
                permute_geometry(m, k),
                &[images.into(), x.into(), m.into(), k.into()],
                s,
            )?;
            return self.linear_tma_launch(s, kernels[4], out, images, w, map, (m, n, k));
        }
        // `linear_stream_tma` for the decode rows it serves (see [`linear_stream_tma_fits`])
        // where the weight has a map.
        if path != LinearPath::Tiled
            && let Some(row_blocks) = linear_stream_tma_row_blocks(m, k)
            && x.0.is_multiple_of(16)
            && w.0.is_multiple_of(16)
            && let Some(map) = self.linear_tma_map(s, w, n, k)?
        {
            let x = StreamTmaX {
                rows: x,
                images: DevicePtr::NULL,
            };
            return self.linear_stream_tma_launch(
                s,
                kernels[5],
                out,
                x,
                w,
                map,
                (m, n, k),
                row_blocks,
            );
        }
        let kernel = match path {
            LinearPath::Narrow => kernels[0],
            LinearPath::NarrowB4 => kernels[1],
            LinearPath::Wide => kernels[2],
            LinearPath::Tiled => kernels[3],
        };
        self.go(
            kernel,
            linear_geometry(path, m, n),
            &[out.into(), x.into(), w.into(), m.into(), n.into(), k.into()],
            s,
        )
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use metrale_gpu_runtime::{CpuBackend, GpuBackend, KernelHandle};

    use super::*;
    use crate::circuit_exec::Recorder;

    /// The kernels `f` launches through launchers recording over `ops`.
    fn kernels_of(ops: &Ops, f: impl Fn(&Ops) -> GpuResult<()>) -> Vec<KernelHandle> {
        let (recorder, recording) = Recorder::over(ops);
        f(&recording).expect("the launches record");
        recorder.take().into_iter().map(|l| l.kernel).collect()
    }

    #[test]
    fn linear_tma_runs_where_its_map_can_be_made_and_the_tiled_kernel_elsewhere() {
        let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::default());
        let ops = Ops::new(gpu.clone()).expect("kernels resolve");
        let s = gpu.default_stream();
        let (m, n, k) = (130u32, 8u32, 64u32);
        let alloc = |bytes: usize| gpu.alloc(bytes).expect("alloc");
        let (x, out) = (alloc((m * k * 2) as usize), alloc((m * n * 2) as usize));
        let (w1, w2) = (alloc((n * k * 2) as usize), alloc((n * k * 2) as usize));
        let images = linear_staging_bytes(m, k);
        let base = alloc(LinearStaging::bytes(images, 4));
        let tma = vec![ops.k.permute_k32_tiles, ops.k.linear_tma];
        let tiled = vec![ops.k.linear];
        let linear = |w: DevicePtr| move |o: &Ops| o.linear(s, out, x, w, m, n, k);

        // Without staging memory, and with it while the weight's map has no slot left.
        assert_eq!(kernels_of(&ops, linear(w1)), tiled);
        ops.set_linear_staging(Some(LinearStaging::at(base, images, 1)));
        assert_eq!(kernels_of(&ops, linear(w1)), tma);
        assert_eq!(kernels_of(&ops, linear(w2)), tiled, "the one slot is w1's");
        assert_eq!(kernels_of(&ops, linear(w1)), tma, "w1's map stays");

        // While the stream captures a graph no map can be uploaded: the tiled kernel serves, and
        // the launch does not fail. Afterwards the map is made.
        ops.set_linear_staging(Some(LinearStaging::at(base, images, 4)));
        gpu.begin_capture(s).expect("capture");
        assert_eq!(kernels_of(&ops, linear(w2)), tiled);
        let graph = gpu.end_capture(s).expect("capture ends");
        gpu.destroy_graph(graph).expect("destroy");
        assert_eq!(kernels_of(&ops, linear(w2)), tma);

        // A producer stages prefill-sized calls with k a multiple of 64 (and decode sizes whose
        // segments are whole stages: not k = 64, two chunks for eight segments).
        let staging = |m: u32, k: u32| ops.linear_staging(s, w1, m, n, k).expect("no error");
        assert_eq!(staging(m, k), Some(base));
        assert_eq!(staging(LINEAR_SMALL_M_MAX, k), None);
        assert_eq!(staging(m, 32), None);
        assert_eq!(staging(4 * m, k), None, "the images would not fit");
        // Without a map (here, no slots), a staged projection is refused, not run unmapped.
        ops.set_linear_staging(Some(LinearStaging::at(base, images, 0)));
        let refused = ops.linear_staged(s, out, x, base, w1, m, n, k);
        assert!(
            matches!(&refused, Err(GpuError::KernelFailed { problem, .. }) if problem.contains("no tensor map")),
            "{refused:?}"
        );
    }

    #[test]
    fn linear_stream_tma_serves_9_to_128_rows_in_four_row_blocks_at_most_where_a_map_exists() {
        let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::default());
        let ops = Ops::new(gpu.clone()).expect("kernels resolve");
        let s = gpu.default_stream();
        let n = 8u32;
        let alloc = |bytes: usize| gpu.alloc(bytes).expect("alloc");
        let (x, out) = (alloc(64 * 12288 * 2), alloc(64 * 8 * 4));
        let w = alloc(8 * 12288 * 2);
        let tma = vec![ops.k.linear_stream_tma];
        let wide = vec![ops.k.linear_stream_wide];
        let linear = |m: u32, k: u32| move |o: &Ops| o.linear(s, out, x, w, m, n, k);

        // No staging memory, so no map: the wide kernel.
        assert_eq!(kernels_of(&ops, linear(32, 4096)), wide);
        let base = alloc(LinearStaging::bytes(0, 4));
        ops.set_linear_staging(Some(LinearStaging::at(base, 0, 4)));
        assert_eq!(kernels_of(&ops, linear(17, 4096)), tma);
        assert_eq!(kernels_of(&ops, linear(64, 4096)), tma);
        let f32out = kernels_of(&ops, |o: &Ops| o.linear_f32out(s, out, x, w, 40, n, 4096));
        assert_eq!(f32out, vec![ops.k.linear_stream_tma_f32out]);
        // 12288 inputs: 32 rows fit, 64 go in two row blocks of 32 (x's whole segment would
        // take 192 KiB); a k whose 8 rows do not fit runs the wide kernel.
        assert_eq!(kernels_of(&ops, linear(32, 12288)), tma);
        assert_eq!(kernels_of(&ops, linear(64, 12288)), tma);
        assert_eq!(linear_stream_tma_rows(64, 12288), Some((32, 2)));
        assert_eq!(linear_stream_tma_rows(64, 4096), Some((64, 1)));
        assert_eq!(linear_stream_tma_rows(5, 4096), Some((8, 1)));
        assert_eq!(linear_stream_tma_rows(64, 40960), Some((8, 8)));
        assert!(
            !linear_stream_tma_fits(64, 40960),
            "eight row blocks: eight weight reads"
        );
        assert!(!linear_stream_tma_fits(129, 4096), "past the decode sizes");
        assert_eq!(linear_stream_tma_rows(1, 1 << 20), None);
        // Outside its rows, and k off the tensor map's 16-byte strides.
        assert_eq!(kernels_of(&ops, linear(9, 4096)), tma);
        assert_eq!(kernels_of(&ops, linear(8, 4096)), vec![ops.k.linear_stream]);
        assert_eq!(kernels_of(&ops, linear(65, 4096)), tma);
        assert_eq!(kernels_of(&ops, linear(128, 4096)), tma);
        assert_eq!(linear_stream_tma_rows(128, 4096), Some((64, 2)));
        // 128 rows of 12288 inputs: four row blocks of 32.
        assert_eq!(kernels_of(&ops, linear(128, 12288)), tma);
        assert_eq!(linear_stream_tma_rows(128, 12288), Some((32, 4)));
        assert_eq!(kernels_of(&ops, linear(32, 4092)), wide);
        assert!(linear_stream_tma_fits(64, 4096) && linear_stream_tma_fits(64, 12288));
        assert!(!linear_stream_tma_fits(64, 0) && !linear_stream_tma_fits(8, 4096));
        // Which clusters run a tile never changes its rows; at most one a tile of 128 columns
        // and row block, a multiple of the row blocks.
        assert_eq!(linear_stream_tma_geometry(4096, 1, 15).grid.0, 8 * 15);
        assert_eq!(linear_stream_tma_geometry(200, 1, 15).grid.0, 8 * 2);
        assert_eq!(linear_stream_tma_geometry(4096, 2, 15).grid.0, 8 * 14);
        assert_eq!(linear_stream_tma_geometry(4096, 2, 1).grid.0, 8 * 2);
    }

    #[test]
    fn decode_projections_take_x_from_images_where_every_segment_is_whole_stages() {
        let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::default());
        let ops = Ops::new(gpu.clone()).expect("kernels resolve");
        let s = gpu.default_stream();
        let (m, n, k) = (64u32, 8u32, 1024u32);
        let alloc = |bytes: usize| gpu.alloc(bytes).expect("alloc");
        let (x, out, w) = (
            alloc((m * k * 2) as usize),
            alloc((m * n * 2) as usize),
            alloc((n * k * 2) as usize),
        );
        let images = linear_staging_bytes(LINEAR_SMALL_M_MAX, k);
        let base = alloc(LinearStaging::bytes(images, 4));
        ops.set_linear_staging(Some(LinearStaging::at(base, images, 4)));
        let staging = |m: u32, k: u32| ops.linear_staging(s, w, m, n, k).expect("no error");
        // 17..128 rows of k = 1024 (32 chunks: segments of 4) stage; 16 rows, k = 1000 and
        // k = 256 (segments of one chunk) do not.
        for rows in [LINEAR_STREAM_TMA_IMAGES_M_MIN, 64, LINEAR_SMALL_M_MAX] {
            assert_eq!(staging(rows, k), Some(base), "{rows} rows");
        }
        assert_eq!(staging(16, k), None);
        assert_eq!(staging(m, 1000), None);
        assert_eq!(staging(m, 256), None);
        // The projection is `linear_stream_tma` given both x's rows and the images; where the
        // shape takes none, `linear_staged` refuses.
        let (recorder, recording) = Recorder::over(&ops);
        recording
            .linear_staged(s, out, x, base, w, m, n, k)
            .expect("staged");
        let launches = recorder.take();
        assert_eq!(launches.len(), 1);
        assert_eq!(launches[0].kernel, ops.k.linear_stream_tma);
        assert!(
            ops.linear_staged(s, out, x, base, w, 16, n, k).is_err(),
            "16 rows are not read from images"
        );
    }

    #[test]
    fn staged_producers_refuse_operands_off_their_vector_path() {
        let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::default());
        let ops = Ops::new(gpu.clone()).expect("kernels resolve");
        let s = gpu.default_stream();
        let (rows, cols) = (2u32, 64u32);
        let alloc = |bytes: usize| gpu.alloc(bytes).expect("alloc");
        let images = alloc(linear_staging_bytes(rows, cols));
        let gate_up = alloc((rows * 2 * cols * 2) as usize);
        gpu.memset(gate_up, 0x3c, (rows * 2 * cols * 2) as usize, s)
            .expect("fill");
        let problem = |r: GpuResult<()>| match r {
            Err(GpuError::KernelFailed { problem, .. }) => problem,
            other => panic!("expected a refusal, got {other:?}"),
        };
        let act = alloc((rows * cols * 2) as usize);
        ops.silu_mul_staged(s, images, Some(act), gate_up, rows, cols)
            .expect("aligned operands stage");
        let shifted = DevicePtr(gate_up.0 + 2);
        let silu = |act, gate_up, cols| ops.silu_mul_staged(s, images, act, gate_up, rows, cols);
        assert!(problem(silu(None, shifted, cols)).contains("gate_up"));
        assert!(problem(silu(Some(DevicePtr(act.0 + 2)), gate_up, cols)).contains("act"));
        assert!(problem(silu(None, gate_up, 60)).contains("60 columns"));

        let residual = alloc((rows * cols * 4) as usize);
        let (delta, out) = (
            alloc((rows * cols * 2) as usize),
            alloc((rows * cols * 2) as usize),
        );
        let w = alloc(cols as usize * 2);
        for (p, bytes) in [
            (residual, rows * cols * 4),
            (delta, rows * cols * 2),
            (w, cols * 2),
        ] {
            gpu.memset(p, 0x3c, bytes as usize, s).expect("fill");
        }
        let norm = |out: DevicePtr| {
            ops.add_rms_norm_staged(s, residual, delta, w, out, images, rows, cols, 1e-6, false)
        };
        norm(out).expect("aligned operands stage");
        assert!(problem(norm(DevicePtr(out.0 + 8))).contains("out at"));
    }
}
