//! Compilation: a plan to a [`Program`], the flat list of launches one step (decode, verify or
//! draft) makes at the plan's width, each group emitted through the typed launchers into a
//! [`Recorder`].
//!
//! Invariants:
//! - Each group emits exactly its plan kernels, in order, and the program has exactly
//!   `Plan::launches_per_step` launches plus the preludes it emitted; anything else is an
//!   error, never a silent program. A plan kernel whose launcher picks among shape variants
//!   ([`VARIANTS`]) is matched by any of them, one whose launcher may first launch kernels that
//!   prepare its input ([`PRELUDES`]) by those launches then the kernel.
//! - A program reads and writes only addresses fixed at boot, so replaying it, launch by launch
//!   or as a captured graph, needs only the step's metadata uploaded first.

use std::collections::BTreeMap;

use metrale_circuit::{Digest, Kernel, Plan, Step, Width};
use metrale_gpu_runtime::{GpuBackend, GpuResult, KernelHandle, StreamHandle};

use super::emit::Emitter;
use super::error::CircuitExecError;
use super::record::{Launch, Recorder};

/// The launches of one step at one width.
#[derive(Debug, Clone, PartialEq)]
pub struct Program {
    step: Step,
    width: Width,
    plan_digest: Digest,
    launches: Vec<Launch>,
}

impl Program {
    /// The step it runs.
    pub fn step(&self) -> Step {
        self.step
    }

    /// Rows of the step it runs (one per sequence in decode).
    pub fn rows(&self) -> u64 {
        self.width.rows
    }

    /// Rows and sequences of the step it runs.
    pub fn width(&self) -> Width {
        self.width
    }

    /// The digest of the plan it was compiled from.
    pub fn plan_digest(&self) -> Digest {
        self.plan_digest
    }

    /// Its launches, in order.
    pub fn launches(&self) -> &[Launch] {
        &self.launches
    }

    /// Launch it on `stream`, in order; under `begin_capture` this records the graph.
    pub fn replay(&self, gpu: &dyn GpuBackend, stream: StreamHandle) -> GpuResult<()> {
        self.launches.iter().try_for_each(|l| l.run(gpu, stream))
    }
}

/// Plan kernels whose launcher picks another kernel by shape, and those variants: `ops::linear`
/// (and its f32-out twin) launches `linear_stream` / `linear_stream_b4` (m <= 16),
/// `linear_stream_tma` (9..128 rows where x's segment fits and the weight has a tensor map) or
/// `linear_stream_wide` (m <= 128) for decode-sized row counts, which give bitwise the rows
/// `linear` gives; `linear` of a block-FP8 weight (`linear_stream_fp8`) launches
/// `linear_stream_tma_fp8` or `linear_stream_wide_fp8` at decode sizes and `linear_tma_fp8` above
/// them where the weight has a map, else the bf16 kernels on its dequantized image (the rows of
/// `linear` on that image, every one); `ops::paged_attention` launches `paged_attention_flat` where
/// a step has items enough for every block, and `ops::gated_delta_recurrent` launches
/// `gated_delta_streamed` where it has several items a block (bitwise the same rows and states);
/// `ops::add_rms_norm` and `ops::silu_mul` launch their `_staged` variants where the projection
/// after them reads its x as stage images (`Ops::linear_staging`: the same rows, and the images).
/// The plan names the family's kernel.
pub(crate) const VARIANTS: &[(Kernel, &[Kernel])] = &[
    (
        metrale_circuit::kernels::ADD_RMS_NORM,
        &[Kernel::new("norm", "add_rms_norm_staged")],
    ),
    (
        metrale_circuit::kernels::SILU_MUL,
        &[Kernel::new("activation", "silu_mul_staged")],
    ),
    (
        metrale_circuit::kernels::PAGED_ATTENTION,
        &[Kernel::new("attention", "paged_attention_flat")],
    ),
    (
        metrale_circuit::kernels::GATED_DELTA_RECURRENT,
        &[Kernel::new("gdn", "gated_delta_streamed")],
    ),
    (
        metrale_circuit::kernels::LINEAR,
        &[
            Kernel::new("gemm", "linear_stream"),
            Kernel::new("gemm", "linear_stream_b4"),
            Kernel::new("gemm", "linear_stream_wide"),
            Kernel::new("gemm", "linear_stream_tma"),
            Kernel::new("gemm", "linear_tma"),
        ],
    ),
    (
        metrale_circuit::kernels::LINEAR_STREAM_FP8,
        &[
            Kernel::new("gemm", "linear_stream_wide_fp8"),
            Kernel::new("gemm", "linear_stream_tma_fp8"),
            Kernel::new("gemm", "linear_tma_fp8"),
            Kernel::new("gemm", "linear"),
            Kernel::new("gemm", "linear_tma"),
        ],
    ),
    (
        metrale_circuit::kernels::LINEAR_F32OUT,
        &[
            Kernel::new("gemm", "linear_stream_f32out"),
            Kernel::new("gemm", "linear_stream_b4_f32out"),
            Kernel::new("gemm", "linear_stream_wide_f32out"),
            Kernel::new("gemm", "linear_stream_tma_f32out"),
            Kernel::new("gemm", "linear_tma_f32out"),
        ],
    ),
];

/// Plan kernels whose launcher may first launch kernels preparing the input, and those kernels
/// (each at most once, in this order): above the decode rows `ops::linear` (and its f32-out
/// twin) runs `linear_tma` where the weight has a tensor map, after `permute_k32_tiles` writes x
/// as its stage images; `linear` of a block-FP8 weight above them runs `linear_tma_fp8` the same
/// way, or else first writes the weight's bf16 image (`dequant_fp8`) for the bf16 kernels.
pub(crate) const PRELUDES: &[(Kernel, Kernel)] = &[
    (
        metrale_circuit::kernels::LINEAR_STREAM_FP8,
        Kernel::new("gemm", "dequant_fp8"),
    ),
    (
        metrale_circuit::kernels::LINEAR_STREAM_FP8,
        Kernel::new("gemm", "permute_k32_tiles"),
    ),
    (
        metrale_circuit::kernels::LINEAR,
        Kernel::new("gemm", "permute_k32_tiles"),
    ),
    (
        metrale_circuit::kernels::LINEAR_F32OUT,
        Kernel::new("gemm", "permute_k32_tiles"),
    ),
];

/// The handles a launch of plan kernel `kernel` may carry on `gpu`: its own and those of its
/// shape variants the backend has; resolved once.
fn handles<'c>(
    gpu: &dyn GpuBackend,
    cache: &'c mut BTreeMap<Kernel, Vec<KernelHandle>>,
    kernel: Kernel,
) -> Result<&'c [KernelHandle], CircuitExecError> {
    if let std::collections::btree_map::Entry::Vacant(slot) = cache.entry(kernel) {
        let mut hs = vec![gpu.kernel(kernel.module, kernel.name)?];
        let variants = VARIANTS.iter().filter(|(k, _)| *k == kernel);
        for v in variants.flat_map(|(_, vs)| vs.iter()) {
            if let Ok(h) = gpu.kernel(v.module, v.name) {
                hs.push(h);
            }
        }
        slot.insert(hs);
    }
    Ok(cache.get(&kernel).map(Vec::as_slice).unwrap_or_default())
}

/// Compile `emitter.plan` into a program, recording into `recorder` (which `emitter.ops`
/// launches into).
pub(crate) fn compile(
    emitter: &Emitter<'_>,
    recorder: &Recorder,
    cache: &mut BTreeMap<Kernel, Vec<KernelHandle>>,
) -> Result<Program, CircuitExecError> {
    let plan: &Plan = emitter.plan;
    let gpu = emitter.ops.gpu().as_ref();
    recorder.take();
    let mut preludes = 0;
    for group in plan.groups() {
        let before = recorder.len();
        emitter.group(group)?;
        let emitted: Vec<KernelHandle> = recorder.since(before).iter().map(|l| l.kernel).collect();
        let mut at = 0;
        let mut matches = true;
        for &kernel in &group.kernels {
            for (_, p) in PRELUDES.iter().filter(|(k, _)| *k == kernel) {
                if emitted.len() > at + 1
                    && gpu.kernel(p.module, p.name).ok() == emitted.get(at).copied()
                {
                    at += 1;
                    preludes += 1;
                }
            }
            matches &= match emitted.get(at) {
                Some(launched) => handles(gpu, cache, kernel)?.contains(launched),
                None => false,
            };
            at += 1;
        }
        matches &= at == emitted.len();
        if !matches {
            let names: Vec<String> = group.kernels.iter().map(ToString::to_string).collect();
            let chain: Vec<String> = group.ops.iter().map(ToString::to_string).collect();
            return Err(CircuitExecError::GroupLaunches {
                rows: plan.rows(),
                block: group.block,
                chain: chain.join(" > "),
                planned: names.join(", "),
                emitted: format!("{emitted:?}"),
            });
        }
    }
    let launches = recorder.take();
    if launches.len() != plan.launches_per_step() + preludes {
        return Err(CircuitExecError::LaunchCount {
            rows: plan.rows(),
            planned: plan.launches_per_step() + preludes,
            emitted: launches.len(),
        });
    }
    Ok(Program {
        step: plan.circuit().step(),
        width: plan.width(),
        plan_digest: plan.digest(),
        launches,
    })
}
