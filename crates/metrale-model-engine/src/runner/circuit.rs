//! `ModelCircuit`: which forward runs a `StepRunner`'s decode, verify and draft steps, the
//! legacy layer walk (`Model::launch_step`) or the circuit executor's programs, and what the
//! runner discloses about it (forward name, plan digest, launches per step). Also
//! [`checkpoint_plan`], the plan of a config without a model, for `metrale circuit plan`.
//!
//! The executor is built from the live runner: each layer's binding
//! (`CircuitBindings::circuit_layer`), the model's own weights, the step buffers and the cache's
//! KV and SSM pools, compiled at every width of the decode ladder and, with speculation on
//! (`ModelOptions::speculative`), at every single-sequence verify row count `2..=1 + K`
//! ([`verify_rows`]), at every verify shape of `2..=circuit_speculative_seqs` sequences
//! ([`verify_batches`]) and, when the MTP head drafts (`Speculative::Mtp`), at every
//! single-sequence draft row count `1..=1 + K` ([`draft_rows`]) and every draft shape of
//! `2..=circuit_speculative_seqs` sequences ([`draft_batches`]). `decode()` then replays the
//! program of the step's padded width, `verify()` the verify program of its rows and
//! sequences, and `mtp_step()` with a logit row per sequence the draft program of its rows and
//! sequences, launch by launch or from a graph captured from it.
//!
//! Invariants:
//! - A switch builds the next executor first, so a refused build leaves the current forward
//!   running; then it destroys every captured graph (decode, verify, MTP), then frees the
//!   previous executor: no graph ever replays freed memory, nor the previous forward.
//! - Features the circuit does not model refuse the build, named with every other binding
//!   problem in one [`CircuitExecError::Bindings`](metrale_model_layers::circuit_exec::CircuitExecError).
//! - Prefill (`forward`), verify and MTP steps of more than `circuit_speculative_seqs`
//!   sequences or past `1 + K` rows a sequence, and MTP steps where a sequence has no logit
//!   row, run the legacy launches whichever forward is selected.

use metrale_config::ModelConfig;
use metrale_model_layers::StepShape;
use metrale_model_layers::circuit_exec::{
    Architecture, BindingProblem, Boot, CircuitBindings, CircuitExec, CircuitExecError, DraftFixed,
    Fixed, HeadBinding, Launch, LayerPools, NormWeight, Part, Plan, Recorder, Step, StepWidths,
    Width, kv_format, launcher_kernels, model_instance, plan_at, weight_format,
};

pub use metrale_model_layers::circuit_exec::{Digest, Fusions, plans_digest};

use metrale_model_layers::ModelDims;

use super::StepRunner;
use super::forward::Forward;
use super::sizes::{StepSizes, max_blocks};
use crate::error::ModelError;
use crate::options::{ModelOptions, Quantization, Speculative};

/// Which forward runs decode steps. Default: [`ForwardSelect::Legacy`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ForwardSelect {
    /// The layers' own forwards, step by step (`legacy`).
    #[default]
    Legacy,
    /// The circuit executor's programs: `circuit` with [`Fusions::All`] (every rule whose
    /// kernels the backend has), `circuit-reference` with [`Fusions::ReferenceOnly`] (bitwise
    /// the legacy forward).
    Circuit {
        /// Which rules the plans may use.
        fusions: Fusions,
    },
}

impl ForwardSelect {
    /// Every forward's name, as [`ForwardSelect::name`] spells it.
    pub const NAMES: [&'static str; 3] = ["legacy", "circuit", "circuit-reference"];

    /// `legacy`, `circuit` or `circuit-reference`.
    pub fn name(self) -> &'static str {
        match self {
            ForwardSelect::Legacy => "legacy",
            ForwardSelect::Circuit {
                fusions: Fusions::All,
            } => "circuit",
            ForwardSelect::Circuit {
                fusions: Fusions::ReferenceOnly,
            } => "circuit-reference",
        }
    }

    /// The forward named `name` (one of [`ForwardSelect::NAMES`]).
    pub fn from_name(name: &str) -> Option<ForwardSelect> {
        Some(match name {
            "legacy" => ForwardSelect::Legacy,
            "circuit" => ForwardSelect::Circuit {
                fusions: Fusions::All,
            },
            "circuit-reference" => ForwardSelect::Circuit {
                fusions: Fusions::ReferenceOnly,
            },
            _ => return None,
        })
    }
}

/// What runs a model's decode steps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForwardDisclosure {
    /// `legacy`, `circuit` or `circuit-reference`.
    pub forward: &'static str,
    /// The digest of the circuit's plans at every decode width, then at every verify row
    /// count, then at every draft row count (`plans_digest`); `None` for the legacy forward.
    pub plan_digest: Option<Digest>,
    /// Kernel launches of a single-sequence decode step.
    pub launches_per_step: usize,
}

/// Choosing and disclosing the forward; see the module header.
pub trait ModelCircuit {
    /// Run decode steps with `select` from now on. Building a circuit executor can fail
    /// (refusing a model it would misdescribe); the current forward then stays.
    fn set_forward(&mut self, select: ForwardSelect) -> Result<(), ModelError>;

    /// The forward running decode steps.
    fn forward_select(&self) -> ForwardSelect;

    /// What runs decode steps, with its plan digest and launches per step.
    fn forward_disclosure(&self) -> Result<ForwardDisclosure, ModelError>;

    /// The launches one decode step of `width` rows (a rung of the decode ladder) makes under
    /// the selected forward, recorded without running anything.
    fn decode_launches(&self, width: usize) -> Result<Vec<Launch>, ModelError>;

    /// The launches a verify step of `rows` rows of `seqs` sequences (`seqs..=seqs * (1 + K)`
    /// rows) makes under the selected forward, recorded without running anything.
    fn verify_launches(&self, rows: usize, seqs: usize) -> Result<Vec<Launch>, ModelError>;

    /// The launches an MTP step of `rows` rows of `seqs` sequences (`seqs..=seqs * (1 + K)`
    /// rows) with a logit row per sequence makes under the selected forward after its
    /// hidden-row gather (which stays outside programs and graphs), recorded without running
    /// anything; needs the MTP head set up.
    fn draft_launches(&self, rows: usize, seqs: usize) -> Result<Vec<Launch>, ModelError>;
}

/// The single-sequence verify row counts compiled with `draft_tokens` drafts per step:
/// `2..=1 + draft_tokens` (none without speculation).
pub fn verify_rows(draft_tokens: usize) -> Vec<u64> {
    (2..=1 + draft_tokens as u64).collect()
}

/// The verify shapes of several sequences compiled with `draft_tokens` drafts per step for
/// verify steps of up to `max_seqs` sequences: `s` sequences of `s + 1..=s * (1 + K)` rows (at
/// least one draft) for each `s` in `2..=max_seqs`, ascending (none without speculation).
pub fn verify_batches(draft_tokens: usize, max_seqs: usize) -> Vec<Width> {
    batches(draft_tokens, max_seqs, 1)
}

/// `s` sequences of `s + least..=s * (1 + K)` rows for each `s` in `2..=max_seqs`, ascending;
/// none with `draft_tokens` 0.
fn batches(draft_tokens: usize, max_seqs: usize, least: u64) -> Vec<Width> {
    let per_seq = 1 + draft_tokens as u64;
    let seqs = if draft_tokens == 0 {
        0
    } else {
        max_seqs as u64
    };
    (2..=seqs)
        .flat_map(|s| (s + least..=s * per_seq).map(move |rows| Width::new(rows, s)))
        .collect()
}

/// The single-sequence draft (MTP) row counts compiled with `draft_tokens` drafts per step:
/// `1..=1 + draft_tokens`, the take-in after a verify step that accepted `0..=K` drafts and
/// each further draft's single row (none without drafting).
pub fn draft_rows(draft_tokens: usize) -> Vec<u64> {
    if draft_tokens == 0 {
        return Vec::new();
    }
    (1..=1 + draft_tokens as u64).collect()
}

/// The draft (MTP) shapes of several sequences compiled with `draft_tokens` drafts per step
/// for draft steps of up to `max_seqs` sequences, each sequence's last row with logits: `s`
/// sequences of `s..=s * (1 + K)` rows for each `s` in `2..=max_seqs` (a take-in after a verify
/// step adds 1 to `1 + K` rows a sequence; each further draft, one), ascending (none without
/// drafting).
pub fn draft_batches(draft_tokens: usize, max_seqs: usize) -> Vec<Width> {
    batches(draft_tokens, max_seqs, 0)
}

/// A `what` (verify or draft) step of `seqs` sequences (1 to the runner's most) has `seqs` to
/// `seqs * (1 + K)` rows.
fn check_speculative_rows(
    sizes: &StepSizes,
    what: &str,
    rows: usize,
    seqs: usize,
) -> Result<(), ModelError> {
    if seqs == 0 || seqs > sizes.max_seqs {
        return Err(ModelError::Step(format!(
            "a {what} step has 1 to {} sequences, not {seqs}",
            sizes.max_seqs
        )));
    }
    let most = seqs * (1 + sizes.drafts);
    if rows < seqs || rows > most {
        return Err(ModelError::Step(format!(
            "a {what} step of {seqs} sequences has {seqs} to {most} rows, not {rows}"
        )));
    }
    Ok(())
}

/// The sequences of the verify steps a runner compiles circuit programs for.
fn circuit_speculative_seqs(options: &ModelOptions) -> usize {
    options
        .circuit_speculative_seqs
        .min(options.max_decode_seqs)
}

/// Model features the `arch` circuit does not model.
fn circuit_unmodelled(dims: &ModelDims, arch: Architecture) -> Vec<String> {
    let convention = |zero_centred: bool| if zero_centred { "x * (1 + w)" } else { "x * w" };
    let circuit_zc = arch.norm_weight() == NormWeight::ZeroCentred;
    let mut out = Vec::new();
    if dims.unit_offset != circuit_zc {
        out.push(format!(
            "RMSNorm weights applied as {} (the {arch} circuit applies {})",
            convention(dims.unit_offset),
            convention(circuit_zc)
        ));
    }
    if dims.attn_gated != arch.attention_gated() {
        out.push(format!(
            "an attention output gate set to {} (the {arch} circuit's is {})",
            dims.attn_gated,
            arch.attention_gated()
        ));
    }
    out
}

impl Forward {
    /// Build the executor of this forward's model with `fusions` at the runner's decode ladder
    /// and speculative row counts; see the module header.
    fn build_circuit(
        &self,
        fusions: Fusions,
        options: &ModelOptions,
        sizes: &StepSizes,
    ) -> Result<CircuitExec, ModelError> {
        let model = &self.model;
        let (ops, stream, dims) = (model.ops(), model.stream(), model.dims());
        if dims.tp_size > 1 {
            return Err(CircuitExecError::Bindings {
                problems: vec![BindingProblem::Unmodelled {
                    part: Part::Model,
                    feature: format!(
                        "tensor parallelism over {} ranks (a circuit program has no collective \
                         steps; every rank runs the legacy forward)",
                        dims.tp_size
                    ),
                }],
            }
            .into());
        }
        let widths = options.decode_ladder();
        // The drafts the runner was built for (`set_num_draft_tokens` may lower `K` later).
        let drafting = if self.mtp.is_some() { sizes.drafts } else { 0 };
        let seqs = circuit_speculative_seqs(options);
        let instance = model_instance(
            model.config(),
            sizes.max_blocks as u64,
            StepWidths {
                decode: widths.into_iter().map(|w| w as u64).collect(),
                verify_rows: verify_rows(sizes.drafts),
                verify_batches: verify_batches(sizes.drafts, seqs),
                draft_rows: draft_rows(drafting),
                draft_batches: draft_batches(drafting, seqs),
            },
            weight_format(model.config(), options.quantization == Quantization::Fp8),
            kv_format(options.kv_cache_dtype.resolve(model.config())),
        )?;
        for layer in model.layers() {
            layer.circuit_prepare(ops, stream)?;
        }
        let layers = model
            .layers()
            .iter()
            .map(|l| l.circuit_layer(dims))
            .collect();
        let weights = model.weights();
        let head = HeadBinding {
            embedding: (&weights.embed).into(),
            final_norm: (&weights.final_norm).into(),
            lm_head: (&weights.lm_head).into(),
            unmodelled: Vec::new(),
        };
        let (draft, draft_fixed) = match (&self.mtp, model.mtp_head()) {
            (Some(mb), Some(head)) => {
                for layer in &head.layers {
                    layer.circuit_prepare(ops, stream)?;
                }
                let fixed = DraftFixed {
                    hidden: mb.hidden,
                    cat_src: mb.cat_src,
                    cat_ids: mb.cat_ids,
                    cat: mb.cat,
                    pools: (self.head_pools.iter())
                        .map(|&kv| LayerPools {
                            kv: Some(kv),
                            ssm: None,
                        })
                        .collect(),
                };
                (Some(head.circuit_binding(dims)), Some(fixed))
            }
            _ => (None, None),
        };
        model.gpu().synchronize(stream)?;
        let fixed = Fixed {
            buffers: self.buf,
            pools: self.pools.clone(),
            draft: draft_fixed,
        };
        let unmodelled = circuit_unmodelled(dims, instance.architecture);
        Ok(CircuitExec::build(Boot {
            ops,
            stream,
            instance,
            fusions,
            dims: *dims,
            layers,
            head,
            draft,
            fixed,
            unmodelled,
        })?)
    }
}

impl ModelCircuit for StepRunner {
    fn set_forward(&mut self, select: ForwardSelect) -> Result<(), ModelError> {
        let next = match select {
            ForwardSelect::Legacy => None,
            ForwardSelect::Circuit { fusions } => Some(self.forward.build_circuit(
                fusions,
                &self.options,
                &self.sizes,
            )?),
        };
        let destroyed = self.graphs.clear();
        let previous = std::mem::replace(&mut self.forward.circuit, next);
        let freed = previous.map_or(Ok(()), CircuitExec::free);
        destroyed?;
        Ok(freed?)
    }

    fn forward_select(&self) -> ForwardSelect {
        match &self.forward.circuit {
            None => ForwardSelect::Legacy,
            Some(e) => ForwardSelect::Circuit {
                fusions: e.fusions(),
            },
        }
    }

    fn forward_disclosure(&self) -> Result<ForwardDisclosure, ModelError> {
        let forward = self.forward_select().name();
        Ok(match &self.forward.circuit {
            None => ForwardDisclosure {
                forward,
                plan_digest: None,
                launches_per_step: self.decode_launches(1)?.len(),
            },
            Some(e) => ForwardDisclosure {
                forward,
                plan_digest: Some(e.plans_digest()),
                launches_per_step: e.launches_per_step(),
            },
        })
    }

    fn decode_launches(&self, width: usize) -> Result<Vec<Launch>, ModelError> {
        if !self.options.decode_ladder().contains(&width) {
            return Err(ModelError::Step(format!(
                "{width} is not a decode width (the ladder is {:?})",
                self.options.decode_ladder()
            )));
        }
        if let Some(e) = &self.forward.circuit {
            return e
                .program(width as u64)
                .map(|p| p.launches().to_vec())
                .ok_or_else(|| ModelError::Step(format!("no circuit program for {width} rows")));
        }
        let rows = u32::try_from(width)
            .map_err(|_| ModelError::Step(format!("{width} rows do not fit a step")))?;
        self.forward
            .record_step(self.shape(rows, rows, rows, false))
    }

    fn verify_launches(&self, rows: usize, seqs: usize) -> Result<Vec<Launch>, ModelError> {
        check_speculative_rows(&self.sizes, "verify", rows, seqs)?;
        let width = Width::new(rows as u64, seqs as u64);
        let program = (self.forward.circuit.as_ref()).and_then(|e| e.verify_program(width));
        if let Some(p) = program {
            return Ok(p.launches().to_vec());
        }
        let (rows, seqs) = (rows as u32, seqs as u32);
        self.forward.record_step(self.shape(rows, seqs, rows, true))
    }

    fn draft_launches(&self, rows: usize, seqs: usize) -> Result<Vec<Launch>, ModelError> {
        check_speculative_rows(&self.sizes, "draft", rows, seqs)?;
        let shape = self.shape(rows as u32, seqs as u32, seqs as u32, false);
        if let Some(p) = self.forward.draft_program(shape, 0) {
            return Ok(p.launches().to_vec());
        }
        let (recorder, ops) = Recorder::over(self.model().ops());
        self.forward.legacy_mtp(&ops, shape, 0)?;
        Ok(recorder.take())
    }
}

impl StepRunner {
    /// The shape of a step of `rows` rows of `num_seqs` sequences, without prefill row groups.
    fn shape(&self, rows: u32, num_seqs: u32, logit_rows: u32, verify: bool) -> StepShape {
        StepShape {
            rows,
            num_seqs,
            max_blocks: self.sizes.max_blocks as u32,
            logit_rows,
            verify,
            att_groups: 0,
            att_split: 0,
            att_prompt: 0,
        }
    }
}

/// The circuit instance a model loaded with `options` compiles for `config`: the same
/// block-table width, decode ladder, verify and draft shapes, weight and KV cache formats.
fn checkpoint_instance(
    config: &ModelConfig,
    options: &ModelOptions,
) -> Result<metrale_model_layers::circuit_exec::Instance, ModelError> {
    // As `StepRunner::new` sizes the block tables.
    let blocks_per_seq = max_blocks(config, options)? as u64;
    let widths = options.decode_ladder().into_iter().map(|w| w as u64);
    let (k, seqs) = (options.draft_tokens(), circuit_speculative_seqs(options));
    // As `StepRunner::new` sets the head up: a model loads with MTP drafting only when its
    // checkpoint has the head.
    let drafting = if options.speculative == Speculative::Mtp {
        k
    } else {
        0
    };
    Ok(model_instance(
        config,
        blocks_per_seq,
        StepWidths {
            decode: widths.collect(),
            verify_rows: verify_rows(k),
            verify_batches: verify_batches(k, seqs),
            draft_rows: draft_rows(drafting),
            draft_batches: draft_batches(drafting, seqs),
        },
        weight_format(config, options.quantization == Quantization::Fp8),
        kv_format(options.kv_cache_dtype.resolve(config)),
    )?)
}

/// The plan of `config`'s `step` at `width` (a decode step of `rows` sequences, or a verify or
/// draft step of `rows` rows of one or several sequences), as a model loaded with `options`
/// compiles it (a draft plan needs `options` drafting with MTP), lowered with `fusions` against
/// every kernel the engine has a launcher for. Reads no weights and needs no device.
pub fn checkpoint_plan(
    config: &ModelConfig,
    options: &ModelOptions,
    step: Step,
    fusions: Fusions,
    width: Width,
) -> Result<Plan, ModelError> {
    let instance = checkpoint_instance(config, options)?;
    Ok(plan_at(
        &instance,
        step,
        fusions,
        &launcher_kernels(),
        width,
    )?)
}

/// The plans of `config` at every width of the decode ladder of `options`, ascending, then at
/// every verify row count and shape when `options` turn speculation on, then at every draft row count
/// when they turn MTP drafting on: what a model loaded with them
/// compiles, whose `plans_digest` its [`ForwardDisclosure`] reports (on a backend with every
/// launcher's kernel).
pub fn checkpoint_plans(
    config: &ModelConfig,
    options: &ModelOptions,
    fusions: Fusions,
) -> Result<Vec<Plan>, ModelError> {
    let instance = checkpoint_instance(config, options)?;
    let kernels = launcher_kernels();
    let steps = [Step::Decode, Step::Verify, Step::Draft];
    let plans = (steps.iter())
        .flat_map(|&step| (instance.widths_of(step).into_iter()).map(move |width| (step, width)))
        .map(|(step, width)| plan_at(&instance, step, fusions, &kernels, width))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(plans)
}
