//! The `linear` launchers (bf16 and f32 out): one entry per output type, picking among the
//! narrow, wide and tiled kernels of `kernels/gemm.cu` by `m` (all give bitwise the same rows);
//! a fourth `impl Ops` block beside `ops`, `ops_hybrid` and `ops_fused`, under `ops`'s rules.

use metrale_gpu_runtime::{DevicePtr, GpuResult, KernelHandle, LaunchConfig, StreamHandle};

use crate::ops::Ops;

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
        let kernels = [
            self.k.linear_stream,
            self.k.linear_stream_b4,
            self.k.linear_stream_wide,
            self.k.linear,
        ];
        self.gemm(s, kernels, out, x, w, m, n, k)
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
        let kernels = [
            self.k.linear_stream_f32out,
            self.k.linear_stream_b4_f32out,
            self.k.linear_stream_wide_f32out,
            self.k.linear_f32out,
        ];
        self.gemm(s, kernels, out, x, w, m, n, k)
    }

    /// One `linear` launch: `kernels` are the narrow, narrow-b4, wide and tiled variants of one
    /// output type (same arguments, bitwise the same rows); the shape picks which serves.
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        s: StreamHandle,
        kernels: [KernelHandle; 4],
        out: DevicePtr,
        x: DevicePtr,
        w: DevicePtr,
        m: u32,
        n: u32,
        k: u32,
    ) -> GpuResult<()> {
        let path = linear_path(m, n);
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

/// Largest `m` that `linear` serves with its decode kernels (`linear_stream` up to
/// `LINEAR_NARROW_M_MAX`, `linear_stream_wide` above, `kernels/gemm.cu`); above it the tiled
/// tensor-core kernel runs. All give bitwise the same rows.
pub const LINEAR_SMALL_M_MAX: u32 = 128;

/// Largest `m` that `linear_stream` (one row tile per unit) serves.
pub const LINEAR_NARROW_M_MAX: u32 = 16;

/// `linear_stream_b4` serves m <= 16 from this many output columns up: with three blocks per
/// multiprocessor it is 5-14 % faster at m = 1, 19-33 % at m = 8 and 6-9 % at m = 16 on the wide
/// projections (qkv, gate_up, the GDN input, the LM head), and up to 20 % slower where few units
/// leave a partial last wave (o, down; H200, lab/gemm_lab.cu).
const LINEAR_B4_MIN_N: u32 = 6144;

/// The `linear` kernels: which one serves `m` rows is [`linear_path`]'s choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinearPath {
    /// `linear_stream` (one block per 8 columns by 16 rows).
    Narrow,
    /// `linear_stream_b4`: `linear_stream`'s grid with smaller batches, three blocks per
    /// multiprocessor (m <= 16 on wide projections).
    NarrowB4,
    /// `linear_stream_wide` (a cluster of 8 blocks per 128 columns by 64 rows).
    Wide,
    /// `linear` (the tiled prefill kernel: warp-specialized wgmma).
    Tiled,
}

/// The kernel the launchers run for `m` rows and `n` output columns.
pub fn linear_path(m: u32, n: u32) -> LinearPath {
    if m <= LINEAR_NARROW_M_MAX && n >= LINEAR_B4_MIN_N {
        LinearPath::NarrowB4
    } else if m <= LINEAR_NARROW_M_MAX {
        LinearPath::Narrow
    } else if m <= LINEAR_SMALL_M_MAX {
        LinearPath::Wide
    } else {
        LinearPath::Tiled
    }
}

/// Blocks per cluster of `linear_stream_wide`: one per k segment (`LIN_SEGS`, kernels/gemm.cu).
const LINEAR_WIDE_CLUSTER: u32 = 8;

/// Dynamic shared memory of `linear_stream_wide`: 3 stages of 2 chunks of (128 weight + 64 x)
/// rows of 64 bytes (the segment partials reuse the ring at the end).
const LINEAR_WIDE_SMEM: u32 = 3 * 2 * (128 + 64) * 64;

/// Rows per block of `linear` (`LIN_BM`: three consumer warpgroups of 64 rows).
const LINEAR_TILED_ROWS: u32 = 192;

/// Threads per block of `linear` (`LIN_THREADS`: a producer warpgroup and three consumers).
const LINEAR_TILED_THREADS: u32 = 512;

/// Dynamic shared memory of `linear`: a ring of 5 stages of (192 x + 128 weight) rows of 128
/// bytes (2 chunks), 1 KiB to align it to the swizzle atoms and 1 KiB for its mbarriers.
const LINEAR_TILED_SMEM: u32 = 5 * (192 + 128) * 128 + 2048;

/// `linear`'s geometry, mirroring `kernels/gemm.cu` (every path launched as programmatic
/// dependents: each kernel waits for the one before it in-kernel, and the decode kernels load
/// their first weight fragments before that wait):
/// - `linear_stream` and `linear_stream_b4` (m <= 16, n >= 6144): one block of 256 threads per
///   unit of 8 columns by 16 rows, no dynamic shared memory (two and three blocks per
///   multiprocessor).
/// - `linear_stream_wide` (m <= 128): tiles of 128 columns by 64 rows, a cluster of 8 blocks of
///   256 threads (one per k segment, compiled into the kernel) per tile.
/// - `linear`: 192 x 128 output tiles, grid (ceil(n / 128), ceil(m / 192)), 512 threads (a
///   producer warpgroup filling a 5-stage ring of 202 KiB and three warpgroups of wgmma), one
///   block per multiprocessor.
///
/// Every kernel computes the whole function at any `m` with its own geometry (the tests run
/// each of them at every m).
pub fn linear_geometry(path: LinearPath, m: u32, n: u32) -> LaunchConfig {
    let config = match path {
        LinearPath::Narrow | LinearPath::NarrowB4 => {
            LaunchConfig::grid2(n.div_ceil(8) * m.div_ceil(16), 1, 256)
        }
        LinearPath::Wide => {
            let tiles = n.div_ceil(128) * m.div_ceil(64);
            LaunchConfig::grid2(LINEAR_WIDE_CLUSTER * tiles, 1, 256).with_shared(LINEAR_WIDE_SMEM)
        }
        LinearPath::Tiled => LaunchConfig::grid2(
            n.div_ceil(128),
            m.div_ceil(LINEAR_TILED_ROWS),
            LINEAR_TILED_THREADS,
        )
        .with_shared(LINEAR_TILED_SMEM),
    };
    config.with_programmatic()
}
