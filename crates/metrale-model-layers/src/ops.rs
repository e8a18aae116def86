//! `Ops`: exactly one typed launcher per kernel. Each launcher checks its operands (typed views,
//! `ops_view::Matrix`, or its own parameter struct), fills its kernel's parameter struct
//! (`metrale-kernel-abi`, whose bytes are the kernel's parameter buffer) and chooses the launch
//! geometry the CUDA source expects. Nothing else in the engine builds a kernel's parameters.
//! The launchers live beside this file by family: `ops_rows` (embedding, norms, rotary, cache
//! store, SwiGLU, argmax, sample, fill), `ops_gemm`, `ops_attention`, `ops_hybrid` and
//! `ops_gdn_decode`, `ops_moe`, `ops_fused`.
//!
//! Invariants:
//! - A kernel's parameters are its struct in `metrale-kernel-abi`; changing one means changing
//!   the struct (and so `kernels/abi.cuh`), the `.cu` source, the CPU twin and the launcher
//!   together, and the build checks the compiled kernels against the structs.
//! - Launch geometry depends only on the shapes passed in, never on data, so a captured launch
//!   stays valid when the inputs at its addresses change.
//! - Kernels launched as programmatic dependents (`LaunchConfig::programmatic`: every kernel of
//!   a decode step: the `linear` family, the norms, `silu_mul`, and at decode sizes
//!   (`step_launch`) rotary and cache stores, decode attention, the gated-delta-net kernels, the
//!   gathers and `argmax`) wait in-kernel (`pdl_wait`, kernels/common.cuh) for the kernel ahead
//!   of them before they touch memory, so each one's launch overlaps the tail of the one before.
//!   A launcher may set the flag only for a kernel that waits first. Decode attention's
//!   persistent clusters are sized to be resident at once, so the cache stores ahead of it
//!   (`kv_store`, `qk_norm_rope_kv_store`) do not trigger early: placed beside their blocks,
//!   the attention's clusters could not all be resident. Prefill attention launches plainly.
//!   The `linear` decode kernels load their weight before the wait, so a weight must never be
//!   written by the kernel launched just before a projection on its stream.

use std::collections::HashMap;
use std::sync::Arc;

use metrale_gpu_runtime::{
    GpuBackend, GpuResult, KernelArg, KernelHandle, LaunchConfig, StreamHandle,
};
use metrale_kernel_abi::KernelParams;
use parking_lot::Mutex;

pub use crate::ops_attention::{
    ATTENTION_SPLITS, DecodeAttention, PagedAttention, RowGroups, StepPlan, attention_blocks_fit,
    attention_prefill_plan, attention_row_groups, attention_step_plan,
};
pub use crate::ops_rows::{KvStore, Norm, QkNormRope, SampleOperands, VocabRows};
pub use crate::ops_view::{BlockScales, Matrix};

/// Rows up to which the step's small kernels (rotary and cache stores, the gated-delta-net
/// kernels, the gathers, `argmax`) and decode attention launch as programmatic dependents: the
/// decode sizes the `linear` decode kernels serve, where overlapping the kernel ahead saves its
/// launch latency. Above it they launch plainly: at prefill sizes the overlap only delays the
/// kernel ahead.
pub(crate) const STEP_PROGRAMMATIC_ROWS: u32 = crate::ops_gemm::LINEAR_SMALL_M_MAX;

/// `config` as a programmatic dependent launch when `rows` is decode-sized
/// ([`STEP_PROGRAMMATIC_ROWS`]); the kernel waits in-kernel either way.
pub(crate) fn step_launch(config: LaunchConfig, rows: u32) -> LaunchConfig {
    if rows <= STEP_PROGRAMMATIC_ROWS {
        config.with_programmatic()
    } else {
        config
    }
}

macro_rules! kernel_table {
    ($( $(#[$meta:meta])* $module:ident :: $name:ident => $konst:ident($params:ty) ),* $(,)?) => {
        /// Every kernel of the manifest (`metrale_kernel_abi::for_each_kernel!`), resolved once
        /// at load.
        #[derive(Debug, Clone, Copy)]
        pub struct Kernels {
            $(
                $(#[$meta])*
                pub $name: KernelHandle,
            )*
        }

        impl Kernels {
            /// Resolve every kernel; fails naming the first one the backend lacks.
            pub fn resolve(gpu: &dyn GpuBackend) -> GpuResult<Kernels> {
                Ok(Kernels { $($name: gpu.kernel(stringify!($module), stringify!($name))?,)* })
            }

            /// Every `(module, name)` the model needs.
            pub const NAMES: &'static [(&'static str, &'static str)] =
                &[$((stringify!($module), stringify!($name)),)*];
        }
    };
}

metrale_kernel_abi::for_each_kernel!(kernel_table);

/// Resident clusters (or, for kernels without a cluster size, blocks) by (kernel, threads,
/// dynamic shared memory bytes): the backend's answers, shared by an `Ops` and its clones.
pub(crate) type ResidentClusters = Arc<Mutex<HashMap<(KernelHandle, u32, u32), u32>>>;

/// The launchers, bound to a backend and its resolved kernels.
#[derive(Debug, Clone)]
pub struct Ops {
    pub(crate) gpu: Arc<dyn GpuBackend>,
    pub(crate) k: Kernels,
    /// Asked of the backend once per key (the persistent launches of `ops_attention`,
    /// `ops_gemm` and `ops_gdn_decode`).
    pub(crate) resident: ResidentClusters,
    /// `linear`'s prefill kernel: x's staging buffer and the weights' tensor maps
    /// (`ops_gemm`).
    pub(crate) tma: Arc<crate::ops_gemm::LinearTma>,
}

impl Ops {
    /// Resolve every kernel on `gpu`.
    pub fn new(gpu: Arc<dyn GpuBackend>) -> GpuResult<Ops> {
        let k = Kernels::resolve(gpu.as_ref())?;
        Ok(Ops {
            tma: Arc::new(crate::ops_gemm::LinearTma::new(gpu.clone())),
            gpu,
            k,
            resident: Arc::default(),
        })
    }

    /// The backend.
    pub fn gpu(&self) -> &Arc<dyn GpuBackend> {
        &self.gpu
    }

    /// Launch `k` with its parameter struct `params`.
    pub(crate) fn go<P: KernelParams>(
        &self,
        k: KernelHandle,
        cfg: LaunchConfig,
        params: &P,
        s: StreamHandle,
    ) -> GpuResult<()> {
        self.gpu.launch(k, &cfg, &[KernelArg::params(params)], s)
    }
}
