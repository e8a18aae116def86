//! The circuit executor: a model's decode step compiled from its circuit (`metrale-circuit`)
//! into fixed-address launch programs, one per decode width, and, with speculative decoding,
//! one per single-sequence verify row count (`Instance::verify_rows`, `Step::Verify`) and per
//! batched verify shape of several sequences (`Instance::verify_batches`) and,
//! when the MTP head drafts, one per single-sequence draft row count (`Instance::draft_rows`,
//! `Step::Draft`) and per batched draft shape (`Instance::draft_batches`).
//!
//! - `bindings`: how layers hand the executor their weights and facts ([`CircuitBindings`],
//!   the supertrait of `TransformerLayer`), and [`check_bindings`], which refuses a model the
//!   circuit would misdescribe, listing every problem at once; `weights_check`, the weight
//!   part of that check; `draft`: [`DraftBinding`], the MTP head's binding, and its checks.
//! - `fixed`: [`Fixed`], the step buffers and state pools a program is bound to, and
//!   [`DraftFixed`], the draft head's.
//! - `instance`: the circuit [`Instance`] of a config, and the kernels a plan may lower to.
//! - `record`: [`Recorder`], a backend that records launches instead of running them.
//! - `emit` (with `resolve`, which binding a block reads, `emit_hybrid`, the GDN and MoE ops'
//!   emitters, `emit_staged`, the staged producers', and `emit_draft`, the draft step's own
//!   emitters), `compile`: each plan group through the same typed `ops` launchers the
//!   legacy forward calls, into a [`Program`] whose launch count is checked against the plan's.
//!
//! [`CircuitExec::build`] does it all once, at boot: bind, check (the draft head's problems in
//! the same error as the layers'), lower the decode circuit at every width, the verify circuit
//! at every verify row count and batched verify shape and the draft circuit at every draft row
//! count and batched draft shape (`Fusions::All` against every launcher kernel the backend
//! resolves that serves that width: `kernels_at`), allocate one workspace sized for the
//! largest program (none: every emitter writes only the step buffers), and compile a program
//! per plan. The digest it discloses covers the decode plans, then the verify plans, then the
//! draft plans.
//!
//! Invariants:
//! - Every address a program reads is fixed after boot, so replaying it, or a CUDA graph
//!   captured from it, is valid for the model's life. The owner drops captured graphs before
//!   it drops (or [`CircuitExec::free`]s) the executor.
//! - With `Fusions::ReferenceOnly` the programs launch exactly what the legacy forward
//!   launches for the same step, argument for argument, so decode is bitwise the same.

mod bindings;
mod compile;
mod draft;
mod emit;
mod emit_draft;
mod emit_hybrid;
mod emit_staged;
mod error;
mod fixed;
mod instance;
mod record;
mod resolve;
mod weights_check;

#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::sync::Arc;

use metrale_circuit::Circuit;
use metrale_gpu_runtime::{DevicePtr, GpuBackend, GpuResult, StreamHandle};

pub use bindings::{
    AttnFacts, BoundWeight, CircuitBindings, CircuitLayer, FfnFacts, GdnFacts, HeadBinding,
    MixerFacts, MoeFacts, RopeFacts, SharedFacts, WeightSlot, check_bindings, kv_format,
};
pub use compile::Program;
pub use draft::DraftBinding;
pub use error::{BindingProblem, CircuitExecError, Part};
pub use fixed::{DraftFixed, Fixed, LayerPools};
use instance::plans_by_width;
pub use instance::{
    StepWidths, architecture, kernels_at, launcher_kernels, model_instance, plan_at, rules_of,
    weight_format,
};
pub use metrale_circuit::{
    Architecture, Block, Digest, Fusions, Instance, KernelSet, KvFormat, LinearRole, NormWeight,
    Numerics, Plan, Step, Width, plans_digest,
};
pub use record::{Launch, Recorder};

use crate::layer::ModelDims;
use crate::ops::{Kernels, Ops};

/// What [`CircuitExec::build`] binds and compiles.
#[derive(Debug)]
pub struct Boot<'a> {
    /// The model's launchers (their backend resolves the plan's kernels).
    pub ops: &'a Ops,
    /// The stream the emitters are told (recording ignores it; programs replay on any).
    pub stream: StreamHandle,
    /// The model's circuit instance; its widths and verify rows are the programs compiled.
    pub instance: Instance,
    /// Which rules the plans may use.
    pub fusions: Fusions,
    /// The model's dimensions.
    pub dims: ModelDims,
    /// Each decoder layer's binding (`CircuitBindings::circuit_layer`), in order.
    pub layers: Vec<Option<CircuitLayer>>,
    /// The model's own weights.
    pub head: HeadBinding,
    /// The MTP draft head's binding (`MtpHead::circuit_binding`); needed when the instance
    /// has draft rows, ignored otherwise.
    pub draft: Option<DraftBinding>,
    /// The fixed addresses.
    pub fixed: Fixed,
    /// Model-level features the circuit does not model (refused with the layers' problems).
    pub unmodelled: Vec<String>,
}

/// See the module header.
#[derive(Debug)]
pub struct CircuitExec {
    gpu: Arc<dyn GpuBackend>,
    fusions: Fusions,
    plans: Vec<Plan>,
    programs: Vec<Program>,
    verify_plans: Vec<Plan>,
    verify_programs: Vec<Program>,
    draft_plans: Vec<Plan>,
    draft_programs: Vec<Program>,
    digest: Digest,
    workspace: Option<DevicePtr>,
    workspace_bytes: u64,
}

/// The launcher kernels `gpu` resolves: what a plan may lower to on it.
fn available_kernels(gpu: &dyn GpuBackend) -> KernelSet {
    KernelSet::from_names(
        Kernels::NAMES
            .iter()
            .copied()
            .filter(|(m, n)| gpu.kernel(m, n).is_ok()),
    )
}

impl CircuitExec {
    /// Bind, check, lower and compile; see the module header. A model the circuit misdescribes
    /// is refused with every problem in one [`CircuitExecError::Bindings`].
    pub fn build(boot: Boot<'_>) -> Result<CircuitExec, CircuitExecError> {
        let gpu = boot.ops.gpu().clone();
        let circuit = Arc::new(Circuit::new(&boot.instance)?);
        let (mut problems, layers) = bindings::binding_problems(
            &circuit,
            &boot.layers,
            &boot.head,
            Some(&boot.fixed.pools),
        )?;
        problems.splice(
            0..0,
            boot.unmodelled
                .iter()
                .map(|feature| BindingProblem::Unmodelled {
                    part: Part::Model,
                    feature: feature.clone(),
                }),
        );
        let (draft, draft_layers) = if boot.instance.widths_of(Step::Draft).is_empty() {
            (None, Vec::new())
        } else {
            let draft = Arc::new(Circuit::for_step(&boot.instance, Step::Draft)?);
            let pools = boot.fixed.draft.as_ref().map_or(&[][..], |d| &d.pools[..]);
            let (more, bound) =
                draft::draft_problems(&draft, boot.draft.as_ref(), &boot.head, pools)?;
            problems.extend(more);
            (Some(draft), bound)
        };
        if !problems.is_empty() {
            return Err(CircuitExecError::Bindings { problems });
        }

        let kernels = available_kernels(gpu.as_ref());
        let lower = |c: &Arc<Circuit>| plans_by_width(c, &boot.instance, boot.fusions, &kernels);
        let plans = lower(&circuit)?;
        let verify_plans = if boot.instance.widths_of(Step::Verify).is_empty() {
            Vec::new()
        } else {
            lower(&Arc::new(Circuit::for_step(&boot.instance, Step::Verify)?))?
        };
        let draft_plans = match &draft {
            Some(d) => lower(d)?,
            None => Vec::new(),
        };
        let workspace_bytes = plans
            .iter()
            .chain(&verify_plans)
            .chain(&draft_plans)
            .map(|p| p.groups().iter().map(|g| emit::scratch_bytes(p, g)).sum())
            .max()
            .unwrap_or(0);

        // Allocated before the programs are compiled, which would bind its addresses.
        let workspace = if workspace_bytes > 0 {
            // An unaddressable size fails as the allocation it is.
            Some(gpu.alloc(usize::try_from(workspace_bytes).unwrap_or(usize::MAX))?)
        } else {
            None
        };
        let (recorder, recording) = Recorder::over(boot.ops);
        let mut handles = BTreeMap::new();
        let compiled = plans
            .iter()
            .chain(&verify_plans)
            .chain(&draft_plans)
            .map(|plan| {
                let emitter = emit::Emitter {
                    ops: &recording,
                    stream: boot.stream,
                    plan,
                    dims: &boot.dims,
                    layers: &layers,
                    head: &boot.head,
                    draft: boot.draft.as_ref(),
                    draft_layers: &draft_layers,
                    fixed: &boot.fixed,
                };
                compile::compile(&emitter, &recorder, &mut handles)
            })
            .collect::<Result<Vec<_>, _>>();
        let mut programs = match compiled {
            Ok(p) => p,
            Err(e) => {
                if let Some(ptr) = workspace
                    && let Err(f) = gpu.free(ptr)
                {
                    tracing::warn!("CircuitExec: freeing the workspace failed: {f}");
                }
                return Err(e);
            }
        };
        let draft_programs = programs.split_off(plans.len() + verify_plans.len());
        let verify_programs = programs.split_off(plans.len());
        let all: Vec<Plan> = (plans.iter().chain(&verify_plans).chain(&draft_plans))
            .cloned()
            .collect();
        Ok(CircuitExec {
            digest: plans_digest(&all),
            gpu,
            fusions: boot.fusions,
            plans,
            programs,
            verify_plans,
            verify_programs,
            draft_plans,
            draft_programs,
            workspace,
            workspace_bytes,
        })
    }

    /// The fusions its plans were lowered with.
    pub fn fusions(&self) -> Fusions {
        self.fusions
    }

    /// The loosest numerics of its plans (decode, verify and draft): `Reference` when every
    /// group launches the legacy kernels, `BitIdentical` when every fusion is byte-identical to
    /// them, else `Differs`.
    pub fn numerics(&self) -> Numerics {
        (self
            .plans
            .iter()
            .chain(&self.verify_plans)
            .chain(&self.draft_plans))
        .map(Plan::numerics)
        .max()
        .unwrap_or(Numerics::Reference)
    }

    /// Its plans, one per width, ascending.
    pub fn plans(&self) -> &[Plan] {
        &self.plans
    }

    /// Its programs, one per width, ascending.
    pub fn programs(&self) -> &[Program] {
        &self.programs
    }

    /// The program of a `rows`-row step, when that width was compiled.
    pub fn program(&self, rows: u64) -> Option<&Program> {
        self.programs.iter().find(|p| p.rows() == rows)
    }

    /// Its verify plans, one per single-sequence verify row count, ascending, then one per
    /// batched verify shape (empty without speculation).
    pub fn verify_plans(&self) -> &[Plan] {
        &self.verify_plans
    }

    /// Its verify programs, in the order of its verify plans.
    pub fn verify_programs(&self) -> &[Program] {
        &self.verify_programs
    }

    /// The program of a verify step of `width` (rows and sequences), when that shape was
    /// compiled.
    pub fn verify_program(&self, width: Width) -> Option<&Program> {
        self.verify_programs.iter().find(|p| p.width() == width)
    }

    /// Its draft plans, one per single-sequence draft row count, ascending, then one per
    /// batched draft shape (empty without an MTP head that drafts).
    pub fn draft_plans(&self) -> &[Plan] {
        &self.draft_plans
    }

    /// Its draft programs, in the order of its draft plans.
    pub fn draft_programs(&self) -> &[Program] {
        &self.draft_programs
    }

    /// The program of a draft step of `width` (each sequence's last row with logits), when
    /// that shape was compiled.
    pub fn draft_program(&self, width: Width) -> Option<&Program> {
        self.draft_programs.iter().find(|p| p.width() == width)
    }

    /// The digest of every plan's text, the decode plans in width order, then the verify
    /// plans, then the draft plans (`plans_digest`).
    pub fn plans_digest(&self) -> Digest {
        self.digest
    }

    /// Launches of the narrowest program (single-sequence decode).
    pub fn launches_per_step(&self) -> usize {
        self.programs.first().map_or(0, |p| p.launches().len())
    }

    /// Bytes of the workspace allocated at build (0: none).
    pub fn workspace_bytes(&self) -> u64 {
        self.workspace_bytes
    }

    /// Free the workspace now, reporting a failure (dropping frees it too, logging one).
    /// Every graph captured from a program must be destroyed first.
    pub fn free(mut self) -> GpuResult<()> {
        match self.workspace.take() {
            Some(ptr) => self.gpu.free(ptr),
            None => Ok(()),
        }
    }
}

impl Drop for CircuitExec {
    fn drop(&mut self) {
        if let Some(ptr) = self.workspace.take()
            && let Err(e) = self.gpu.free(ptr)
        {
            tracing::warn!("CircuitExec: freeing the workspace failed: {e}");
        }
    }
}
