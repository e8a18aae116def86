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
            self.k.linear_stream_wide_f32out,
            self.k.linear_f32out,
        ];
        self.gemm(s, kernels, out, x, w, m, n, k)
    }

    /// One `linear` launch: `kernels` are the narrow, wide and tiled variants of one output type
    /// (same arguments, bitwise the same rows); `m` picks which serves.
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        s: StreamHandle,
        kernels: [KernelHandle; 3],
        out: DevicePtr,
        x: DevicePtr,
        w: DevicePtr,
        m: u32,
        n: u32,
        k: u32,
    ) -> GpuResult<()> {
        let kernel = match linear_path(m) {
            LinearPath::Narrow => kernels[0],
            LinearPath::Wide => kernels[1],
            LinearPath::Tiled => kernels[2],
        };
        self.go(
            kernel,
            linear_geometry(m, n),
            &[out.into(), x.into(), w.into(), m.into(), n.into(), k.into()],
            s,
        )
    }
}

/// Largest `m` that `linear` serves with its decode kernels (`linear_stream` up to
/// `LINEAR_NARROW_M_MAX`, `linear_stream_wide` above, `kernels/gemm.cu`); above it the tiled
/// tensor-core kernel runs. All give bitwise the same rows.
pub const LINEAR_SMALL_M_MAX: u32 = 64;

/// Largest `m` that `linear_stream` (one row tile per unit) serves.
pub const LINEAR_NARROW_M_MAX: u32 = 16;

/// Which `linear` kernel serves `m` rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LinearPath {
    Narrow,
    Wide,
    Tiled,
}

fn linear_path(m: u32) -> LinearPath {
    if m <= LINEAR_NARROW_M_MAX {
        LinearPath::Narrow
    } else if m <= LINEAR_SMALL_M_MAX {
        LinearPath::Wide
    } else {
        LinearPath::Tiled
    }
}

/// Multiprocessors of an H200: the persistent wide decode kernel's grid is sized by it. Any
/// value computes the same result; this one spreads the weight streams over the whole chip.
const SM_COUNT: u32 = 132;

/// Dynamic shared memory of `linear_stream_wide`: a 192 KiB weight ring and 32 KiB for the
/// warps' segment partials.
const LINEAR_WIDE_SMEM: u32 = (192 + 32) * 1024;

/// `linear`'s geometry, mirroring `kernels/gemm.cu` (256 threads on every path, launched as
/// programmatic dependents: each kernel waits for the one before it in-kernel, and
/// `linear_stream` loads its first weight fragments before that wait):
/// - `linear_stream` (m <= 16): one block per unit of 8 columns by 16 rows, no dynamic shared
///   memory (two blocks per multiprocessor).
/// - `linear_stream_wide` (m <= 64): units of 16 columns by 64 rows; min(units, SM_COUNT)
///   persistent blocks, each taking every G-th unit.
/// - `linear`: 128 x 64 output tiles, grid (ceil(n / 64), ceil(m / 128)), a 4-stage pipeline of
///   (128 + 64) x 32 bf16 tiles in shared memory.
fn linear_geometry(m: u32, n: u32) -> LaunchConfig {
    let config = match linear_path(m) {
        LinearPath::Narrow => LaunchConfig::grid2(n.div_ceil(8) * m.div_ceil(16), 1, 256),
        LinearPath::Wide => {
            let units = n.div_ceil(16) * m.div_ceil(64);
            LaunchConfig::grid2(units.min(SM_COUNT), 1, 256).with_shared(LINEAR_WIDE_SMEM)
        }
        LinearPath::Tiled => LaunchConfig::grid2(n.div_ceil(64), m.div_ceil(128), 256)
            .with_shared(4 * (128 + 64) * 32 * 2),
    };
    config.with_programmatic()
}
