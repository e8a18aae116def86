//! What the CPU kernel tests share besides their inputs' generator (`metrale_testkit::Rng`): a
//! rig that uploads, poisons, launches a kernel with its parameter struct and downloads, and a
//! tolerance check.

use half::bf16;
use metrale_kernel_abi::{
    KernelParams, LIN_DEC_THREADS, LIN_STREAM_WARPS, LIN_THREADS, LIN_TMA_THREADS,
};

use crate::backend::{GpuBackend, GpuBackendExt};
use crate::cpu::CpuBackend;
use crate::error::GpuResult;
use crate::types::{DevicePtr, KernelArg, LaunchConfig, StreamHandle};

/// The CPU backend and its default stream.
pub(crate) struct Rig {
    pub gpu: CpuBackend,
    pub s: StreamHandle,
}

/// The block size a kernel is written for (the `linear` family checks it; the others take any
/// multiple of 32).
fn threads_of(name: &str) -> u32 {
    match name {
        "linear" | "linear_f32out" => LIN_THREADS,
        "linear_tma"
        | "linear_tma_f32out"
        | "linear_tma_fp8"
        | "linear_tma_swiglu"
        | "linear_tma_swiglu_fp8" => LIN_TMA_THREADS,
        "linear_stream_tma" | "linear_stream_tma_f32out" | "linear_stream_tma_fp8" => {
            LIN_DEC_THREADS
        }
        n if n.starts_with("linear") => LIN_STREAM_WARPS * 32,
        _ => 32,
    }
}

impl Rig {
    pub fn new() -> Rig {
        Rig {
            gpu: CpuBackend::default(),
            s: StreamHandle::DEFAULT,
        }
    }
    pub fn put<T: bytemuck::Pod>(&self, v: &[T]) -> DevicePtr {
        self.gpu.alloc_upload(v, self.s).expect("upload")
    }
    /// An output buffer, poisoned with 0xFF (NaN in every float format).
    pub fn out(&self, bytes: usize) -> DevicePtr {
        let p = self.gpu.alloc(bytes).expect("alloc");
        self.gpu.memset(p, 0xFF, bytes, self.s).expect("memset");
        p
    }
    /// Launch `module::name` with `params` on one block of the size it is written for.
    pub fn run<P: KernelParams>(&self, module: &str, name: &str, params: &P) -> GpuResult<()> {
        self.run_with(
            module,
            name,
            LaunchConfig::linear(1, threads_of(name)),
            params,
        )
    }
    /// Launch `module::name` with `params` and `config`.
    pub fn run_with<P: KernelParams>(
        &self,
        module: &str,
        name: &str,
        config: LaunchConfig,
        params: &P,
    ) -> GpuResult<()> {
        let k = self.gpu.kernel(module, name)?;
        self.gpu
            .launch(k, &config, &[KernelArg::params(params)], self.s)
    }
    pub fn bf(&self, p: DevicePtr, n: usize) -> Vec<bf16> {
        self.gpu.download::<bf16>(p, n, self.s).expect("download")
    }
    pub fn get_bf(&self, p: DevicePtr, n: usize) -> Vec<f64> {
        tof(&self.bf(p, n))
    }
    pub fn f32s(&self, p: DevicePtr, n: usize) -> Vec<f32> {
        self.gpu.download::<f32>(p, n, self.s).expect("download")
    }
    pub fn bytes(&self, p: DevicePtr, n: usize) -> Vec<u8> {
        self.gpu.download::<u8>(p, n, self.s).expect("download")
    }
}

/// bf16 widened to f64.
pub(crate) fn tof(v: &[bf16]) -> Vec<f64> {
    v.iter().map(|x| x.to_f64()).collect()
}

/// `|got - want| <= rel * max(|want|, floor)`, and no poison left.
pub(crate) fn assert_close(got: &[f64], want: &[f64], rel: f64, floor: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(g.is_finite(), "{what}[{i}] = {g} (poison left?)");
        let tol = rel * w.abs().max(floor);
        assert!((g - w).abs() <= tol, "{what}[{i}]: got {g}, want {w}");
    }
}

/// Byte offset of element `col` of row `row` in the stage images of a matrix of `k` columns,
/// from the layout kernels/common.cuh documents (independently of the twins' own helpers): per
/// 128-row tile and stage of two 32-k chunks a 16 KiB image of 128 rows of 128 bytes; in a row,
/// chunk `c`'s 16-byte unit `t` sits at `(4 (c % 2) + t) ^ (row % 8)` and holds the chunk's
/// 4-byte pairs `t, t + 4, t + 8, t + 12`.
pub(crate) fn image_byte(row: usize, col: usize, k: usize) -> usize {
    let steps = k.div_ceil(64);
    let (c, pair) = (col / 32, (col % 32) / 2);
    let (unit, place) = (pair % 4, pair / 4);
    let image = (row / 128) * steps + c / 2;
    let r = row % 128;
    image * 16384 + r * 128 + (((c % 2) * 4 + unit) ^ (r % 8)) * 16 + place * 4 + (col % 2) * 2
}
