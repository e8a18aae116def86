//! The serving ladder's speculative runs (`ServeOptions::speculative`): after a rung's plain
//! run, the same requests through the same scheduler with speculative decoding on, once drafted
//! by an `OracleDrafter` holding each request's plain output (every draft right) and once by the
//! MTP head, each behind a fresh `SpeculationGate` that decides per batch-width class from the
//! step times it measures, as a server's gate would.
//!
//! Reported per run: output tokens per second (its ratio to the plain run's is
//! `ServePoint::speculative_ratio`), the drafts accepted per sequence verify, and the decode
//! steps that speculated (verify steps) against those that ran plain (the gate's choice, its
//! probes, or no sequence with drafts), with the gate's switches and its final mode at the
//! rung's width.
//!
//! Invariants:
//! - A speculative run generates exactly the plain run's tokens, request by request (greedy
//!   decoding; a verify row computes what a decode row computes); a difference fails the
//!   ladder with `ModelError::SpeculativeMismatch`.
//! - Each run starts with its own drafter's acceptance counts and a gate that has measured
//!   nothing, so no run inherits another's decisions.

use metrale_config::ModelConfig;

use super::{ServeOptions, ServePoint, run_once};
use crate::error::ModelError;
use crate::options::{MAX_DRAFT_TOKENS, ModelOptions};
use crate::runner::ForwardSelect;
use crate::scheduler::Scheduler;
use crate::speculative::{Drafter, GateOptions, MtpDrafter, OracleDrafter};

/// How the ladder's rungs speculate. Every field has a documented default.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct ServeSpeculation {
    /// Drafts per sequence and verify step, 1 to [`MAX_DRAFT_TOKENS`]. Default 3.
    pub num_draft_tokens: usize,
    /// The forward every run of the ladder steps, the plain runs included. Default legacy.
    pub forward: ForwardSelect,
    /// The gate each speculative run starts afresh with. Default [`GateOptions::default`]
    /// (on).
    pub gate: GateOptions,
    /// The model's bound on graphs of verify and MTP steps
    /// (`ModelOptions::max_speculative_graphs`): a verify step's graph is keyed by its exact
    /// rows and sequences, so a rung meets many shapes (every width while its requests are
    /// admitted), and past the bound a step of a new shape runs eagerly. Default the engine's
    /// (64).
    pub max_speculative_graphs: usize,
    /// Meetings of a verify or MTP step shape before its graph is captured
    /// (`ModelOptions::speculative_graph_after`). Default the engine's (2).
    pub speculative_graph_after: u32,
}

impl Default for ServeSpeculation {
    fn default() -> Self {
        ServeSpeculation {
            num_draft_tokens: 3,
            forward: ForwardSelect::Legacy,
            gate: GateOptions::default(),
            max_speculative_graphs: ModelOptions::default().max_speculative_graphs,
            speculative_graph_after: ModelOptions::default().speculative_graph_after,
        }
    }
}

impl ServeSpeculation {
    /// Set `num_draft_tokens`.
    pub fn num_draft_tokens(mut self, k: usize) -> Self {
        self.num_draft_tokens = k;
        self
    }

    /// Set `forward`.
    pub fn forward(mut self, forward: ForwardSelect) -> Self {
        self.forward = forward;
        self
    }

    /// Set `gate`.
    pub fn gate(mut self, gate: GateOptions) -> Self {
        self.gate = gate;
        self
    }

    /// Set `max_speculative_graphs`.
    pub fn max_speculative_graphs(mut self, n: usize) -> Self {
        self.max_speculative_graphs = n;
        self
    }

    /// Set `speculative_graph_after`.
    pub fn speculative_graph_after(mut self, n: u32) -> Self {
        self.speculative_graph_after = n;
        self
    }

    /// Refuse settings the model cannot be built for.
    pub(super) fn check(&self) -> Result<(), ModelError> {
        let k = self.num_draft_tokens;
        if !(1..=MAX_DRAFT_TOKENS).contains(&k) {
            return Err(ModelError::Options {
                option: "num_draft_tokens",
                problem: format!("{k}; 1 to {MAX_DRAFT_TOKENS} are allowed"),
            });
        }
        Ok(())
    }
}

/// One speculative run of a rung.
#[derive(Debug, Clone, PartialEq)]
pub struct SpeculativeRun {
    /// What drafted: `oracle` (each request's plain output) or `mtp` (the MTP head).
    pub drafter: &'static str,
    /// Wall time from submission to the last token, s.
    pub wall_s: f64,
    /// Output tokens over `wall_s`.
    pub tok_s: f64,
    /// Steps the scheduler ran (prefill, decode and verify).
    pub steps: usize,
    /// Decode steps that speculated: verify steps.
    pub verify_steps: usize,
    /// Decode steps that ran plain (mixed steps included): the gate had speculation off or
    /// probed plain decoding, or no sequence had drafts.
    pub plain_steps: usize,
    /// Sequence verifies that checked drafts (a verify step holds one per sequence with
    /// drafts).
    pub draft_verifies: usize,
    /// Drafts those checked.
    pub drafted: usize,
    /// Drafts the model accepted.
    pub accepted: usize,
    /// Times the gate switched speculation on or off, every width class together.
    pub switches: u64,
    /// Whether the gate had speculation on at the rung's width at the end (probes aside).
    pub gate_on: bool,
    /// Graphs captured during the run (near `max_speculative_graphs`: some verify or MTP
    /// steps of later shapes ran eagerly).
    pub captures: u64,
    /// Plain decode steps that ran all the rung's sequences.
    pub full_steps: usize,
    /// Median wall time of those steps (the drafter's take-in after each included), ms; NaN
    /// without one.
    pub step_ms: f64,
    /// Their mean (above the median: some steps cost more, such as a take-in that flushed the
    /// head's archive or checked its drafts), ms; NaN without one.
    pub step_mean_ms: f64,
    /// Wall time outside those steps (verify steps, prefill chunks, mixed and narrower steps), s.
    pub rest_s: f64,
    /// Host time in the drafter after each step (its take-ins and drafts), s.
    pub drafter_s: f64,
}

impl SpeculativeRun {
    /// Drafts accepted per sequence verify that checked drafts (each such verify also yields
    /// the model's own token); `None` without one.
    pub fn accepted_per_verify(&self) -> Option<f64> {
        (self.draft_verifies > 0).then(|| self.accepted as f64 / self.draft_verifies as f64)
    }
}

/// The speculative runs of one rung (see the module header): `prompts` again, drafted by the
/// oracle (`plain[i]`, request `i`'s plain output, after its prompt) and by the MTP head.
pub(super) fn runs(
    sched: &mut Scheduler,
    spec: &ServeSpeculation,
    prompts: &[Vec<u32>],
    plain: &[Vec<u32>],
    opts: &ServeOptions,
) -> Result<Vec<SpeculativeRun>, ModelError> {
    let scripts = (prompts.iter().zip(plain))
        .map(|(p, o)| p.iter().chain(o).copied().collect())
        .collect();
    let drafters: [(&'static str, Box<dyn Drafter + Send>); 2] = [
        ("oracle", Box::new(OracleDrafter::new(scripts))),
        ("mtp", Box::new(MtpDrafter::default())),
    ];
    let mut out = Vec::with_capacity(drafters.len());
    for (drafter, d) in drafters {
        sched.set_drafter(Some(d))?;
        if let Some(s) = sched.speculation() {
            s.set_gate(spec.gate);
        }
        let before = sched.stats().steps;
        let drafter_before =
            (sched.stats().speculation).map_or(Default::default(), |s| s.drafter_time);
        let captures = sched.runner().graphs().captures();
        let run = run_once(sched, prompts, Vec::new(), opts.output_tokens)?;
        let after = sched.stats();
        same_tokens(drafter, plain, &run.outputs)?;
        let accepts = after.speculation.unwrap_or_default();
        let verify_steps = (after.steps.verify_steps - before.verify_steps) as usize;
        let decode_steps = (after.steps.decode_steps - before.decode_steps) as usize;
        let n = prompts.len();
        let (switches, gate_on) = match sched.speculation() {
            Some(s) => (s.gate().switches(), s.gate().is_on(n)),
            None => (0, false),
        };
        out.push(SpeculativeRun {
            drafter,
            wall_s: run.wall_s,
            tok_s: run.tokens as f64 / run.wall_s,
            steps: run.steps,
            verify_steps,
            plain_steps: decode_steps - verify_steps,
            draft_verifies: accepts.draft_verifies(),
            drafted: accepts.drafted(),
            accepted: accepts.accepted(),
            switches,
            gate_on,
            captures: sched.runner().graphs().captures() - captures,
            full_steps: run.full_ms.len(),
            step_ms: run.step_ms(),
            step_mean_ms: run.step_mean_ms(),
            rest_s: run.rest_s(),
            drafter_s: (accepts.drafter_time.saturating_sub(drafter_before)).as_secs_f64(),
        });
    }
    sched.set_drafter(None)?;
    Ok(out)
}

/// Fail unless every request's `speculative` output equals its `plain` one, naming the first
/// request and output position that differ.
pub(super) fn same_tokens(
    drafter: &'static str,
    plain: &[Vec<u32>],
    speculative: &[Vec<u32>],
) -> Result<(), ModelError> {
    let requests = plain.len().max(speculative.len());
    for request in 0..requests {
        let (p, s) = (
            plain.get(request).map_or(&[][..], Vec::as_slice),
            speculative.get(request).map_or(&[][..], Vec::as_slice),
        );
        let Some(position) = (0..p.len().max(s.len())).find(|&i| p.get(i) != s.get(i)) else {
            continue;
        };
        return Err(ModelError::SpeculativeMismatch {
            drafter,
            concurrency: plain.len(),
            request,
            position,
            plain: p.get(position).copied(),
            speculative: s.get(position).copied(),
        });
    }
    Ok(())
}

/// The model shape the speculative ladder builds: `config` with at least a one-layer MTP head.
pub(super) fn with_head(config: &ModelConfig) -> ModelConfig {
    let mut c = config.clone();
    c.mtp_num_layers = c.mtp_num_layers.max(1);
    c
}

/// The table's speculative section: each rung's runs beside its plain run.
pub(super) fn table(spec: &ServeSpeculation, points: &[ServePoint]) -> String {
    let mut s = format!(
        "speculative runs: K = {} drafts, {} forward, a fresh gate each run (on: {}), at most {} speculative graphs, each captured at its shape's meeting {}; oracle: each request's plain tokens drafted, mtp: the MTP head; every run's tokens equal the plain run's\n",
        spec.num_draft_tokens,
        spec.forward.name(),
        spec.gate.enabled,
        spec.max_speculative_graphs,
        spec.speculative_graph_after
    );
    s += "spec   conc.  drafter    tok/s   x plain   acc/verify   verify steps   plain steps   switches   gate at conc.   captures   full steps   median ms   mean ms   rest s   drafter s\n";
    for p in points {
        for r in &p.speculative {
            let acc = r
                .accepted_per_verify()
                .map_or_else(|| "-".to_string(), |a| format!("{a:.2}"));
            s += &format!(
                "       {:>5}  {:<7} {:>8.0} {:>9.3} {:>12} {:>14} {:>13} {:>10} {:>15} {:>10} {:>12} {:>11.3} {:>9.3} {:>8.3} {:>11.3}\n",
                p.concurrency,
                r.drafter,
                r.tok_s,
                p.speculative_ratio(r),
                acc,
                r.verify_steps,
                r.plain_steps,
                r.switches,
                if r.gate_on { "on" } else { "off" },
                r.captures,
                r.full_steps,
                r.step_ms,
                r.step_mean_ms,
                r.rest_s,
                r.drafter_s
            );
        }
    }
    s
}
