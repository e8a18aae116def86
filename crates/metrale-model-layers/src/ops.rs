//! `Ops`: exactly one typed launcher per kernel. Each launcher builds its kernel's flat argument
//! list (device pointers, then scalars, in the order the CUDA source and its CPU twin read them)
//! and chooses the launch geometry the CUDA source expects. Nothing else in the engine builds an
//! argument list.
//!
//! Invariants:
//! - A launcher's argument order is the kernel's signature; changing one means changing the
//!   `.cu` source, the CPU twin in `metrale-gpu-runtime::cpu::kernels`, and the launcher together.
//! - Launch geometry depends only on the shapes passed in, never on data, so a captured launch
//!   stays valid when the inputs at its addresses change.
//! - Kernels launched as programmatic dependents (`LaunchConfig::programmatic`: every kernel of
//!   a decode step: the `linear` family, the norms, `silu_mul`, and at decode sizes
//!   (`step_launch`) rotary and cache stores, decode attention, the gated-delta-net kernels, the
//!   gathers and `argmax`) wait in-kernel (`pdl_wait`, kernels/common.cuh) for the kernel ahead
//!   of them before they touch memory, so each one's launch overlaps the tail of the one before.
//!   A launcher may set the flag only for a kernel that waits first. Decode attention's
//!   persistent clusters are sized to be resident at once, so the cache stores ahead of it
//!   (`kv_store`, `qk_norm_rope_kv_store`) do not trigger early: its clusters are placed once
//!   their blocks have left (placed beside them, some did not fit: Qwen3-8B batch 128 took 28.4
//!   against 23.1 ms a step, H200). Prefill attention launches plainly. The `linear` decode
//!   kernels load their weight before the wait, so a weight must never be written by the kernel
//!   launched just before a projection on its stream.

use std::collections::HashMap;
use std::sync::Arc;

use metrale_gpu_runtime::{
    DevicePtr, GpuBackend, GpuError, GpuResult, KernelArg, KernelHandle, LaunchConfig, StreamHandle,
};
use parking_lot::Mutex;

/// Rows up to which the step's small kernels (rotary and cache stores, the gated-delta-net
/// kernels, the gathers, `argmax`) and decode attention launch as programmatic dependents:
/// decode-sized launches (the rows the `linear` decode kernels serve), where overlapping the
/// kernel ahead saved 1-2 % of a step (H200). Above it they launch
/// plainly: a Qwen3.5-9B prefill of 2048 tokens took 178 ms with every one programmatic against
/// 158 without.
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

/// The launch of `qk_norm_rope` and `qk_norm_rope_kv_store` over `heads` warps a row: one warp
/// per head, 8 in a block at prefill sizes (one-warp blocks there were block-scheduling bound)
/// and 1 at decode sizes; shared memory for the row's rotation table and each warp's head.
pub(crate) fn rope_launch(p: &QkNormRope, heads: u32) -> LaunchConfig {
    let warps = if p.rows > STEP_PROGRAMMATIC_ROWS {
        8
    } else {
        1
    };
    step_launch(
        LaunchConfig::grid2(p.rows, heads.div_ceil(warps), 32 * warps)
            .with_shared((warps + 1) * p.head_dim * 4),
        p.rows,
    )
}

/// Threads per block of the row-wise kernels (embedding, activation).
const ROW_THREADS: u32 = 256;

/// Threads per block of the RMSNorm kernels: one 8-wide vector per thread for a 4096-wide row,
/// so a decode row is one round of loads. (The reduction order follows the block size, the same
/// for every row whatever the batch.)
const NORM_THREADS: u32 = 512;

/// Threads per block of `silu_mul`; a row is cut over `ceil(ffn / (8 * SILU_THREADS))` blocks.
const SILU_THREADS: u32 = 128;

pub use crate::ops_attention::{
    ATTENTION_SPLITS, DecodeAttention, PagedAttention, attention_blocks_fit, attention_row_groups,
};

macro_rules! kernel_table {
    ($($field:ident => ($module:literal, $name:literal)),* $(,)?) => {
        /// Every kernel the model launches, resolved once at load.
        #[derive(Debug, Clone, Copy)]
        pub struct Kernels {
            $(
                #[doc = concat!("`", $module, "::", $name, "`")]
                pub $field: KernelHandle,
            )*
        }

        impl Kernels {
            /// Resolve every kernel; fails naming the first one the backend lacks.
            pub fn resolve(gpu: &dyn GpuBackend) -> GpuResult<Kernels> {
                Ok(Kernels { $($field: gpu.kernel($module, $name)?,)* })
            }

            /// Every `(module, name)` the model needs.
            pub const NAMES: &'static [(&'static str, &'static str)] = &[$(($module, $name),)*];
        }
    };
}

kernel_table! {
    embedding_gather => ("embed", "embedding_gather"),
    gather_rows => ("embed", "gather_rows"),
    rms_norm => ("norm", "rms_norm"),
    add_rms_norm => ("norm", "add_rms_norm"),
    add_rms_norm_staged => ("norm", "add_rms_norm_staged"),
    qk_norm_rope => ("rope", "qk_norm_rope"),
    qk_norm_rope_kv_store => ("rope", "qk_norm_rope_kv_store"),
    kv_store => ("cache", "kv_store"),
    paged_attention => ("attention", "paged_attention"),
    paged_attention_flat => ("attention", "paged_attention_flat"),
    paged_attention_prefill => ("attention", "paged_attention_prefill"),
    paged_attention_prefill_staged => ("attention", "paged_attention_prefill_staged"),
    linear => ("gemm", "linear"),
    linear_f32out => ("gemm", "linear_f32out"),
    linear_stream => ("gemm", "linear_stream"),
    linear_stream_f32out => ("gemm", "linear_stream_f32out"),
    linear_stream_b4 => ("gemm", "linear_stream_b4"),
    linear_stream_b4_f32out => ("gemm", "linear_stream_b4_f32out"),
    linear_stream_wide => ("gemm", "linear_stream_wide"),
    linear_stream_wide_f32out => ("gemm", "linear_stream_wide_f32out"),
    permute_k32_tiles => ("gemm", "permute_k32_tiles"),
    linear_tma => ("gemm", "linear_tma"),
    linear_tma_f32out => ("gemm", "linear_tma_f32out"),
    linear_stream_tma => ("gemm", "linear_stream_tma"),
    linear_stream_tma_f32out => ("gemm", "linear_stream_tma_f32out"),
    linear_swiglu => ("gemm", "linear_swiglu"),
    silu_mul => ("activation", "silu_mul"),
    silu_mul_staged => ("activation", "silu_mul_staged"),
    argmax => ("sampling", "argmax"),
    causal_conv1d => ("gdn", "causal_conv1d"),
    conv_state_update => ("gdn", "conv_state_update"),
    conv_state_verify => ("gdn", "conv_state_verify"),
    gdn_prepare => ("gdn", "gdn_prepare"),
    gated_delta_recurrent => ("gdn", "gated_delta_recurrent"),
    gated_delta_streamed => ("gdn", "gated_delta_streamed"),
    gated_delta_chunked => ("gdn", "gated_delta_chunked"),
    gated_delta_verify => ("gdn", "gated_delta_verify"),
    gated_rms_norm => ("gdn", "gated_rms_norm"),
    topk_route => ("moe", "topk_route"),
    expert_linear => ("moe", "expert_linear"),
    expert_linear_f32out => ("moe", "expert_linear_f32out"),
    moe_combine => ("moe", "moe_combine"),
    fill_uniform_bf16 => ("init", "fill_uniform_bf16"),
}

/// The parameters of `qk_norm_rope`.
#[derive(Debug, Clone, Copy)]
pub struct QkNormRope {
    /// Projection output rows, normalised and rotated in place.
    pub qkv: DevicePtr,
    /// Per-head q norm weight, or NULL for none (Llama).
    pub q_norm: DevicePtr,
    /// Per-head k norm weight, or NULL.
    pub k_norm: DevicePtr,
    /// `rotary_dim / 2` inverse frequencies, f32.
    pub inv_freq: DevicePtr,
    /// Position of each row.
    pub positions: DevicePtr,
    /// Rows.
    pub rows: u32,
    /// Elements per row of `qkv`.
    pub row_stride: u32,
    /// Query heads.
    pub num_q_heads: u32,
    /// Elements from one query head to the next.
    pub q_head_stride: u32,
    /// Element offset of the first key head.
    pub k_offset: u32,
    /// Key heads.
    pub num_kv_heads: u32,
    /// Head dimension.
    pub head_dim: u32,
    /// Rotated dimensions per head.
    pub rotary_dim: u32,
    /// Norm epsilon.
    pub eps: f32,
    /// Zero-centred norm weights (`1 + w`).
    pub unit_offset: bool,
}

/// The parameters of `kv_store`.
#[derive(Debug, Clone, Copy)]
pub struct KvStore {
    /// K pool.
    pub k_cache: DevicePtr,
    /// V pool.
    pub v_cache: DevicePtr,
    /// Projection output rows holding k and v.
    pub qkv: DevicePtr,
    /// Slot of each row (`u32::MAX`: padding, nothing written).
    pub slot_mapping: DevicePtr,
    /// Rows.
    pub rows: u32,
    /// Elements per row of `qkv`.
    pub row_stride: u32,
    /// Element offset of k in a row.
    pub k_offset: u32,
    /// Element offset of v in a row.
    pub v_offset: u32,
    /// KV heads.
    pub num_kv_heads: u32,
    /// Head dimension.
    pub head_dim: u32,
    /// Slots per pool.
    pub num_slots: u32,
}

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

    pub(crate) fn go(
        &self,
        k: KernelHandle,
        cfg: LaunchConfig,
        args: &[KernelArg],
        s: StreamHandle,
    ) -> GpuResult<()> {
        self.gpu.launch(k, &cfg, args, s)
    }

    /// `out[r] = table[ids[r]]` as f32.
    #[allow(clippy::too_many_arguments)]
    pub fn embedding_gather(
        &self,
        s: StreamHandle,
        out: DevicePtr,
        table: DevicePtr,
        ids: DevicePtr,
        rows: u32,
        hidden: u32,
        vocab: u32,
    ) -> GpuResult<()> {
        self.go(
            self.k.embedding_gather,
            step_launch(LaunchConfig::linear(rows, ROW_THREADS), rows),
            &[
                out.into(),
                table.into(),
                ids.into(),
                rows.into(),
                hidden.into(),
                vocab.into(),
            ],
            s,
        )
    }

    /// `out[i] = x[row_ids[i]]`.
    #[allow(clippy::too_many_arguments)]
    pub fn gather_rows(
        &self,
        s: StreamHandle,
        out: DevicePtr,
        x: DevicePtr,
        row_ids: DevicePtr,
        n: u32,
        cols: u32,
        src_rows: u32,
    ) -> GpuResult<()> {
        self.go(
            self.k.gather_rows,
            step_launch(LaunchConfig::linear(n, ROW_THREADS), n),
            &[
                out.into(),
                x.into(),
                row_ids.into(),
                n.into(),
                cols.into(),
                src_rows.into(),
            ],
            s,
        )
    }

    /// `out = rms_norm(x) * w` (or `* (1 + w)`), x f32, out bf16.
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm(
        &self,
        s: StreamHandle,
        out: DevicePtr,
        x: DevicePtr,
        w: DevicePtr,
        rows: u32,
        cols: u32,
        eps: f32,
        unit_offset: bool,
    ) -> GpuResult<()> {
        self.go(
            self.k.rms_norm,
            LaunchConfig::linear(rows, NORM_THREADS).with_programmatic(),
            &[
                out.into(),
                x.into(),
                w.into(),
                rows.into(),
                cols.into(),
                eps.into(),
                (unit_offset as u32).into(),
            ],
            s,
        )
    }

    /// `residual += delta; out = rms_norm(residual) * w`.
    #[allow(clippy::too_many_arguments)]
    pub fn add_rms_norm(
        &self,
        s: StreamHandle,
        residual: DevicePtr,
        delta: DevicePtr,
        w: DevicePtr,
        out: DevicePtr,
        rows: u32,
        cols: u32,
        eps: f32,
        unit_offset: bool,
    ) -> GpuResult<()> {
        self.add_rms_norm_into(
            s,
            None,
            residual,
            delta,
            w,
            out,
            rows,
            cols,
            eps,
            unit_offset,
        )
    }

    /// `add_rms_norm` that also writes `out`'s rows as stage images at `images`, for the
    /// projection after it (`add_rms_norm_staged`; see `Ops::linear_staging`). The kernel stages
    /// on its vector path only, so unaligned operands or `cols % 8 != 0` are an error here
    /// rather than rows left unwritten.
    #[allow(clippy::too_many_arguments)]
    pub fn add_rms_norm_staged(
        &self,
        s: StreamHandle,
        residual: DevicePtr,
        delta: DevicePtr,
        w: DevicePtr,
        out: DevicePtr,
        images: DevicePtr,
        rows: u32,
        cols: u32,
        eps: f32,
        unit_offset: bool,
    ) -> GpuResult<()> {
        let operands = [
            ("residual", residual),
            ("delta", delta),
            ("w", w),
            ("out", out),
            ("images", images),
        ];
        check_staged("add_rms_norm_staged", &operands, cols)?;
        let staged = Some(images);
        self.add_rms_norm_into(
            s,
            staged,
            residual,
            delta,
            w,
            out,
            rows,
            cols,
            eps,
            unit_offset,
        )
    }

    /// `add_rms_norm`, or `add_rms_norm_staged` with `images` (its argument after `out`).
    #[allow(clippy::too_many_arguments)]
    fn add_rms_norm_into(
        &self,
        s: StreamHandle,
        images: Option<DevicePtr>,
        residual: DevicePtr,
        delta: DevicePtr,
        w: DevicePtr,
        out: DevicePtr,
        rows: u32,
        cols: u32,
        eps: f32,
        unit_offset: bool,
    ) -> GpuResult<()> {
        let kernel = match images {
            Some(_) => self.k.add_rms_norm_staged,
            None => self.k.add_rms_norm,
        };
        let mut args: Vec<KernelArg> = vec![residual.into(), delta.into(), w.into(), out.into()];
        args.extend(images.map(KernelArg::from));
        args.extend::<[KernelArg; 4]>([
            rows.into(),
            cols.into(),
            eps.into(),
            (unit_offset as u32).into(),
        ]);
        self.go(
            kernel,
            LaunchConfig::linear(rows, NORM_THREADS).with_programmatic(),
            &args,
            s,
        )
    }

    /// Per-head q/k RMSNorm and rotary embedding, in place. One warp per head, a block's warps
    /// on one row (`rope_launch`).
    pub fn qk_norm_rope(&self, s: StreamHandle, p: &QkNormRope) -> GpuResult<()> {
        self.go(
            self.k.qk_norm_rope,
            rope_launch(p, p.num_q_heads + p.num_kv_heads),
            &[
                p.qkv.into(),
                p.q_norm.into(),
                p.k_norm.into(),
                p.inv_freq.into(),
                p.positions.into(),
                p.rows.into(),
                p.row_stride.into(),
                p.num_q_heads.into(),
                p.q_head_stride.into(),
                p.k_offset.into(),
                p.num_kv_heads.into(),
                p.head_dim.into(),
                p.rotary_dim.into(),
                p.eps.into(),
                (p.unit_offset as u32).into(),
            ],
            s,
        )
    }

    /// Store each row's k and v at its slot.
    pub fn kv_store(&self, s: StreamHandle, p: &KvStore) -> GpuResult<()> {
        self.go(
            self.k.kv_store,
            step_launch(LaunchConfig::linear(p.rows, 128), p.rows),
            &[
                p.k_cache.into(),
                p.v_cache.into(),
                p.qkv.into(),
                p.slot_mapping.into(),
                p.rows.into(),
                p.row_stride.into(),
                p.k_offset.into(),
                p.v_offset.into(),
                p.num_kv_heads.into(),
                p.head_dim.into(),
                p.num_slots.into(),
            ],
            s,
        )
    }

    /// `out = silu(gate) * up` over rows of `[gate | up]`.
    pub fn silu_mul(
        &self,
        s: StreamHandle,
        out: DevicePtr,
        gate_up: DevicePtr,
        rows: u32,
        ffn: u32,
    ) -> GpuResult<()> {
        self.go(
            self.k.silu_mul,
            silu_geometry(rows, ffn),
            &[out.into(), gate_up.into(), rows.into(), ffn.into()],
            s,
        )
    }

    /// `silu_mul` written as stage images at `images` for the down projection (`silu_mul_staged`;
    /// see `Ops::linear_staging`), and at decode sizes (up to `LINEAR_SMALL_M_MAX` rows) as rows
    /// at `act` too, which `linear_stream_tma` reads where it cannot take the images; prefill
    /// sizes (`linear_tma`, images only) leave `act` alone. The kernel has only a vector path, so
    /// an unaligned `gate_up` or `act` or `ffn % 8 != 0` is an error here rather than rows left
    /// unwritten.
    pub fn silu_mul_staged(
        &self,
        s: StreamHandle,
        images: DevicePtr,
        act: DevicePtr,
        gate_up: DevicePtr,
        rows: u32,
        ffn: u32,
    ) -> GpuResult<()> {
        let act = if rows <= crate::ops_gemm::LINEAR_SMALL_M_MAX {
            act
        } else {
            DevicePtr::NULL
        };
        let operands = [("images", images), ("act", act), ("gate_up", gate_up)];
        check_staged("silu_mul_staged", &operands, ffn)?;
        self.go(
            self.k.silu_mul_staged,
            silu_geometry(rows, ffn),
            &[
                images.into(),
                act.into(),
                gate_up.into(),
                rows.into(),
                ffn.into(),
            ],
            s,
        )
    }

    /// Greedy token of each row.
    pub fn argmax(
        &self,
        s: StreamHandle,
        out: DevicePtr,
        logits: DevicePtr,
        rows: u32,
        vocab: u32,
    ) -> GpuResult<()> {
        self.go(
            self.k.argmax,
            step_launch(LaunchConfig::linear(rows, 1024), rows),
            &[out.into(), logits.into(), rows.into(), vocab.into()],
            s,
        )
    }

    /// `out[i] = offset + uniform(i, seed) * scale` over `n` bf16 values (benchmark weights).
    pub fn fill_uniform_bf16(
        &self,
        s: StreamHandle,
        out: DevicePtr,
        n: u64,
        seed: u64,
        offset: f32,
        scale: f32,
    ) -> GpuResult<()> {
        let blocks = n.div_ceil(256 * 8).min(65_535 * 8) as u32;
        self.go(
            self.k.fill_uniform_bf16,
            LaunchConfig::linear(blocks, 256),
            &[
                out.into(),
                n.into(),
                seed.into(),
                offset.into(),
                scale.into(),
            ],
            s,
        )
    }
}

/// `silu_mul`'s (and `silu_mul_staged`'s) geometry: a row per grid row, 8-column vectors split
/// over blocks of `SILU_THREADS`; a programmatic dependent.
fn silu_geometry(rows: u32, ffn: u32) -> LaunchConfig {
    LaunchConfig::grid2(rows, ffn.div_ceil(8 * SILU_THREADS), SILU_THREADS).with_programmatic()
}

/// A staged producer's operands (`_staged` kernels stage on their 16-byte vector path only):
/// each 16-byte aligned, rows of a multiple of 8 columns; else an error naming the first that
/// is not.
fn check_staged(kernel: &str, operands: &[(&str, DevicePtr)], cols: u32) -> GpuResult<()> {
    let problem = if let Some((name, p)) = operands.iter().find(|(_, p)| !p.0.is_multiple_of(16)) {
        format!("{name} at {:#x} is not 16-byte aligned", p.0)
    } else if !cols.is_multiple_of(8) {
        format!("rows of {cols} columns are not a multiple of 8")
    } else {
        return Ok(());
    };
    Err(GpuError::KernelFailed {
        kernel: kernel.into(),
        problem,
    })
}
