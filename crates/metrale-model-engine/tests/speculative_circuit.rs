//! Speculative decoding under the circuit forward, on the CPU backend: a single-sequence verify
//! step of `circuit-reference` (its verify program) is bitwise the legacy one, logits and the
//! state every row keeps, for K = 1..4, eager and graphed, and launches exactly what the legacy
//! step launches; so is a verify step of two to four sequences (its batched verify program) at
//! K = 3, dense and hybrid, while five sequences run the legacy launches; a batched verify step
//! replayed from a graph captured under another mix of drafts is bitwise the eager step; the
//! draft steps likewise (`draft.rs`); greedy MTP generation under `circuit` is plain greedy,
//! alone and batched, and runs every verify step and some draft steps from circuit programs.
//! The bitwise and graph tests also run on CUDA (module `cuda`, with `--features cuda`).

#![allow(clippy::unwrap_used)]

#[path = "speculative_circuit/draft.rs"]
mod draft;
mod support;

use std::ops::ControlFlow;
use std::sync::Arc;

use metrale_cache::BlockTable;
use metrale_gpu_runtime::{CpuBackend, GpuBackend, GpuBackendExt};
use metrale_model_engine::options::{ModelOptions, Speculative};
use metrale_model_engine::runner::{
    ForwardSelect, Fusions, ModelCircuit, MtpStep, StepInput, StepRow, checkpoint_plan,
    checkpoint_plans, plans_digest, verify_batches,
};
use metrale_model_engine::speculative::GateOptions;
use metrale_model_layers::circuit_exec::Step;
use support::*;

const REFERENCE: ForwardSelect = ForwardSelect::Circuit {
    fusions: Fusions::ReferenceOnly,
};

/// Options for `k` drafts, graphed or not; a speculative step is captured the first time its
/// shape is met, so a test's single step of a shape runs from its graph.
fn spec_options(k: usize, graphs: bool) -> ModelOptions {
    ModelOptions::default()
        .speculative(Speculative::External)
        .num_draft_tokens(k)
        .decode_graphs(graphs)
        .speculative_graph_after(1)
}

fn cpu() -> Arc<dyn GpuBackend> {
    Arc::new(CpuBackend::default())
}

/// Fixture `name` (no MTP head) on `gpu`.
fn load_on(gpu: fn() -> Arc<dyn GpuBackend>, name: &str, options: ModelOptions) -> Rig {
    Rig::load_on(&fixture(name), options, gpu())
}

fn bits(v: &[Vec<f32>]) -> Vec<Vec<u32>> {
    v.iter()
        .map(|r| r.iter().map(|x| x.to_bits()).collect())
        .collect()
}

/// A sequence driven by hand: its table, its SSM slot, and one row slot per verify row.
struct Seq {
    table: BlockTable,
    slot: u32,
    row_slots: Vec<u32>,
}

impl Seq {
    /// A sequence with `prompt` prefilled, keeping verify rows' states in `rows` slots.
    /// On a model without SSM state every slot is `u32::MAX` (none).
    fn prefilled(model: &mut Rig, prompt: &[u32], rows: usize) -> Seq {
        let hybrid = model.cache.ssm_slots().is_some();
        let mut alloc = || match hybrid {
            true => model.cache.alloc_ssm_slot(None).unwrap().unwrap(),
            false => u32::MAX,
        };
        let slot = alloc();
        let row_slots = (0..rows).map(|_| alloc()).collect();
        let slots = [slot];
        let mut seq = Seq {
            table: BlockTable::new(),
            slot,
            row_slots,
        };
        seq.ensure(model, prompt.len() + rows);
        let step: Vec<StepRow> = (prompt.iter().enumerate())
            .map(|(p, &token)| StepRow {
                token,
                position: p as u32,
                seq: 0,
            })
            .collect();
        let input = StepInput {
            rows: &step,
            tables: &[&seq.table],
            logit_rows: &[],
            ssm_slots: if hybrid { &slots[..] } else { &[] },
            prompt_until: &[],
        };
        model.runner.forward(&model.cache, &input).unwrap();
        seq
    }

    fn ensure(&mut self, model: &mut Rig, tokens: usize) {
        model.cache.ensure(&mut self.table, tokens).unwrap();
    }

    fn free(self, model: &mut Rig) {
        let held = self.row_slots.into_iter().chain([self.slot]);
        for s in held.filter(|&s| s != u32::MAX) {
            model.cache.free_ssm_slot(s).unwrap();
        }
        let mut table = self.table;
        model.cache.release(&mut table).unwrap();
    }
}

/// A prompt of `len` tokens, distinct per `salt`.
fn prompt(len: u32, salt: u32) -> Vec<u32> {
    (0..len)
        .map(|t| (t * 29 + salt * 13 + 7) % 250 + 1)
        .collect()
}

/// One verify step over `seqs`, sequence `i` verifying `counts[i]` rows after its prompt of
/// `prompt_len[i]` tokens; returns every row's logits and every row slot's state.
fn verify(
    model: &mut Rig,
    seqs: &[&Seq],
    prompt_lens: &[usize],
    counts: &[usize],
) -> (Vec<Vec<f32>>, Vec<Vec<u8>>) {
    let mut rows = Vec::new();
    let mut row_slots = Vec::new();
    for (i, (&n, &c)) in prompt_lens.iter().zip(counts).enumerate() {
        for t in 0..c {
            rows.push(StepRow {
                token: ((i * 31 + t * 17) % 200 + 3) as u32,
                position: (n + t) as u32,
                seq: i as u32,
            });
            row_slots.push(seqs[i].row_slots[t]);
        }
    }
    let tables: Vec<&BlockTable> = seqs.iter().map(|s| &s.table).collect();
    let slots: Vec<u32> = (seqs.iter().map(|s| s.slot))
        .filter(|&s| s != u32::MAX)
        .collect();
    (model.runner)
        .verify(&model.cache, &rows, &tables, &slots, &row_slots)
        .unwrap();
    let logits = model.runner.logits(rows.len()).unwrap();
    let states = (row_slots.iter().chain(&slots))
        .filter(|&&s| s != u32::MAX)
        .map(|&s| model.cache.ssm_slot_bytes(s).unwrap())
        .collect();
    (logits, states)
}

/// Under circuit-reference (selected here), the `step` (verify or draft) programs of each
/// `(rows, seqs)` of `shapes` launch exactly what the legacy step launches.
fn programs_launch_legacy(model: &mut Rig, name: &str, step: Step, shapes: &[(usize, usize)]) {
    let launches = |m: &Rig, rows, seqs| match step {
        Step::Draft => m.runner.draft_launches(rows, seqs).unwrap(),
        _ => m.runner.verify_launches(rows, seqs).unwrap(),
    };
    let want: Vec<_> = (shapes.iter())
        .map(|&(rows, seqs)| launches(model, rows, seqs))
        .collect();
    model.runner.set_forward(REFERENCE).unwrap();
    for (&(rows, seqs), want) in shapes.iter().zip(&want) {
        let got = launches(model, rows, seqs);
        assert!(
            got == *want,
            "{name}: the {} program of {rows} rows of {seqs} sequences launches {} kernels, \
             legacy {}; first difference at {:?}",
            step.name(),
            got.len(),
            want.len(),
            got.iter().zip(want).position(|(g, w)| g != w)
        );
    }
}

#[test]
fn circuit_reference_verify_is_bitwise_legacy_logits_and_row_states_for_k_1_to_4() {
    verify_is_bitwise_legacy(cpu);
}

fn verify_is_bitwise_legacy(gpu: fn() -> Arc<dyn GpuBackend>) {
    for name in HYBRID {
        for graphs in [false, true] {
            let mut legacy = load_on(gpu, name, spec_options(4, graphs));
            let mut circuit = load_on(gpu, name, spec_options(4, graphs));
            let shapes: Vec<(usize, usize)> = (1..=5).map(|rows| (rows, 1)).collect();
            programs_launch_legacy(&mut circuit, name, Step::Verify, &shapes);
            for k in 1..=4 {
                let p = prompt(12 + k as u32, k as u32);
                let mut want = None;
                for model in [&mut legacy, &mut circuit] {
                    let seq = Seq::prefilled(model, &p, k + 1);
                    let got = verify(model, &[&seq], &[p.len()], &[k + 1]);
                    seq.free(model);
                    let got = (bits(&got.0), got.1);
                    match &want {
                        None => want = Some(got),
                        Some(w) => assert!(
                            *w == got,
                            "{name} K={k} graphs {graphs}: circuit-reference verify differs"
                        ),
                    }
                }
            }
            if graphs {
                let shapes = [(2, 1), (3, 1), (4, 1), (5, 1)];
                assert_eq!(circuit.runner.graphs().verify_shapes(), shapes, "{name}");
            }
        }
    }
}

#[test]
fn circuit_reference_batched_verify_of_up_to_four_sequences_is_bitwise_legacy_at_k_3() {
    batched_verify_is_bitwise_legacy(cpu);
}

fn batched_verify_is_bitwise_legacy(gpu: fn() -> Arc<dyn GpuBackend>) {
    // Every sequence verifies K = 3 drafts, or some fewer; the last mix has five sequences,
    // past `circuit_speculative_seqs` (4), and runs the legacy launches.
    let mixes: [&[usize]; 4] = [&[4, 4, 4, 4], &[4, 1, 2, 3], &[2, 4], &[4, 4, 1, 2, 3]];
    let shape = |c: &[usize]| (c.iter().sum::<usize>(), c.len());
    for name in HYBRID.iter().chain(&["qwen3-tiny"]) {
        for graphs in [false, true] {
            let mut legacy = load_on(gpu, name, spec_options(3, graphs));
            let mut circuit = load_on(gpu, name, spec_options(3, graphs));
            let shapes: Vec<(usize, usize)> = mixes.iter().map(|c| shape(c)).collect();
            programs_launch_legacy(&mut circuit, name, Step::Verify, &shapes);
            for counts in mixes {
                let lens: Vec<usize> = (0..counts.len()).map(|i| 9 + 5 * i).collect();
                let mut want = None;
                for model in [&mut legacy, &mut circuit] {
                    let seqs: Vec<Seq> = (lens.iter().enumerate())
                        .map(|(i, &n)| Seq::prefilled(model, &prompt(n as u32, i as u32), 4))
                        .collect();
                    let refs: Vec<&Seq> = seqs.iter().collect();
                    let got = verify(model, &refs, &lens, counts);
                    for s in seqs {
                        s.free(model);
                    }
                    let got = (bits(&got.0), got.1);
                    match &want {
                        None => want = Some(got),
                        Some(w) => assert!(
                            *w == got,
                            "{name} {counts:?} graphs {graphs}: circuit-reference verify differs"
                        ),
                    }
                }
            }
            assert_eq!(legacy.runner.verify_program_steps(), 0);
            assert_eq!(
                circuit.runner.verify_program_steps(),
                3,
                "{name}: the steps of up to four sequences ran verify programs, five did not"
            );
            if graphs {
                let shapes = [(6, 2), (10, 4), (16, 4), (14, 5)];
                let mut shapes = shapes.to_vec();
                shapes.sort_unstable();
                assert_eq!(circuit.runner.graphs().verify_shapes(), shapes, "{name}");
            }
        }
    }
}

#[test]
fn a_batched_verify_step_replayed_from_its_graph_is_bitwise_the_eager_step() {
    batched_verify_graph_is_eager(cpu);
}

fn batched_verify_graph_is_eager(gpu: fn() -> Arc<dyn GpuBackend>) {
    for name in HYBRID {
        let mut eager = load_on(gpu, name, spec_options(3, false));
        let mut graphed = load_on(gpu, name, spec_options(3, true));
        let mut circuit = load_on(gpu, name, spec_options(3, true));
        circuit.runner.set_forward(REFERENCE).unwrap();
        // No verify graph may be kept: every step runs eagerly, with the same results.
        let capped = spec_options(3, true).max_speculative_graphs(0);
        let mut capped = load_on(gpu, name, capped);
        // Two mixes of drafts with the same rows and sequences: the second replays the graph
        // the first captured, with other positions, sequences and row slots.
        let lens = [9, 14, 21];
        for counts in [[2, 3, 1], [4, 1, 1]] {
            let mut want = None;
            for model in [&mut eager, &mut graphed, &mut circuit, &mut capped] {
                let seqs: Vec<Seq> = (lens.iter().enumerate())
                    .map(|(i, &n)| Seq::prefilled(model, &prompt(n, i as u32), 4))
                    .collect();
                let refs: Vec<&Seq> = seqs.iter().collect();
                let got = verify(model, &refs, &lens.map(|n| n as usize), &counts);
                for s in seqs {
                    s.free(model);
                }
                let got = (bits(&got.0), got.1);
                match &want {
                    None => want = Some(got),
                    Some(w) => assert!(*w == got, "{name} {counts:?}: graphed differs from eager"),
                }
            }
        }
        assert!(eager.runner.graphs().verify_shapes().is_empty());
        assert_eq!(graphed.runner.graphs().verify_shapes(), [(6, 3)], "{name}");
        assert_eq!(circuit.runner.graphs().verify_shapes(), [(6, 3)], "{name}");
        assert!(
            capped.runner.graphs().verify_shapes().is_empty(),
            "{name}: past the cap"
        );
    }
}

#[test]
fn mtp_greedy_under_the_circuit_forward_is_plain_greedy() {
    for name in HYBRID {
        let fx = MtpFixture::new(name);
        let prompts = fx.prompts();
        let mut plain_model = fx.load(ModelOptions::default());
        let plain: Vec<_> = (prompts.iter())
            .map(|p| run(&mut plain_model, p, &greedy(12)))
            .collect();
        for k in [1, 4] {
            let mut model = fx.load(
                ModelOptions::default()
                    .speculative(Speculative::Mtp)
                    .num_draft_tokens(k),
            );
            model
                .runner_mut()
                .set_forward(ForwardSelect::Circuit {
                    fusions: Fusions::All,
                })
                .unwrap();
            // Every decode step verifies (the random head's acceptance would turn the gate off).
            (model.speculation().unwrap()).set_gate(GateOptions::default().enabled(false));
            for (p, want) in prompts.iter().zip(&plain) {
                let got = run(&mut model, p, &greedy(12));
                assert_eq!(got.token_ids, want.token_ids, "{name} K={k}: tokens");
            }
            let gp = greedy(12);
            let reqs = prompts.iter().map(|p| request(p, &gp)).collect();
            let batched = model
                .run(reqs, &mut |_, _| ControlFlow::Continue(()))
                .unwrap();
            for (got, want) in batched.iter().zip(&plain) {
                assert_eq!(got.token_ids, want.token_ids, "{name} K={k} batched");
            }
            let verify_steps = model.stats().steps.verify_steps;
            let runner = model.runner();
            assert!(
                runner.graphs().verify_shapes().contains(&(1 + k as u32, 1)),
                "{name} K={k}: single-sequence verify steps ran"
            );
            // Four prompts at most: every verify step, of one sequence or of the batch, is a
            // shape the circuit compiled.
            assert!(
                (runner.graphs().verify_shapes().iter()).any(|&(_, seqs)| seqs > 1),
                "{name} K={k}: batched verify steps ran"
            );
            assert_eq!(
                runner.verify_program_steps(),
                verify_steps,
                "{name} K={k}: every verify step ran a circuit program"
            );
            assert!(
                runner.draft_program_steps() > 0,
                "{name} K={k}: drafts ran the circuit's draft programs"
            );
            assert!(
                runner
                    .graphs()
                    .mtp_shapes()
                    .iter()
                    .any(|&(_, seqs)| seqs > 1),
                "{name} K={k}: batched MTP steps replayed graphs"
            );
        }
    }
}

#[test]
fn the_disclosed_digest_covers_the_verify_plans_metrale_circuit_plan_prints() {
    for name in HYBRID {
        let options = spec_options(4, true);
        let mut model = Rig::load(&fixture(name), options.clone());
        model.runner.set_forward(REFERENCE).unwrap();
        let d = model.runner.forward_disclosure().unwrap();
        let config = model.runner.model().config();
        let plans = checkpoint_plans(config, &options, Fusions::ReferenceOnly).unwrap();
        let verify: Vec<(u64, u64)> = (plans.iter().skip(4))
            .map(|p| (p.rows(), p.seqs()))
            .collect();
        let batches = verify_batches(4, 4).into_iter().map(|w| (w.rows, w.seqs));
        let want: Vec<(u64, u64)> = [(2, 1), (3, 1), (4, 1), (5, 1)]
            .into_iter()
            .chain(batches)
            .collect();
        assert_eq!(verify.len(), 4 + 4 * (2 + 3 + 4), "{name}");
        assert_eq!(
            verify, want,
            "{name}: decode 1, 2, 4, 8, then verify of one sequence, then of 2 to 4"
        );
        assert_eq!(d.plan_digest, Some(plans_digest(&plans)), "{name}");
        let plain = checkpoint_plans(config, &ModelOptions::default(), Fusions::ReferenceOnly);
        assert_ne!(d.plan_digest, Some(plans_digest(&plain.unwrap())), "{name}");
        let p3 = checkpoint_plan(
            config,
            &options,
            Step::Verify,
            Fusions::ReferenceOnly,
            Step::Verify.width(3),
        )
        .unwrap();
        assert!(p3.text() == plans[5].text() && p3.text().contains("\nstep verify\nrows 3\n"));
    }
}

/// The verify and draft tests on CUDA: the programs and the graphs replay what the eager
/// legacy step computes there too.
#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    use metrale_gpu_runtime::cuda::CudaBackend;

    fn gpu() -> Arc<dyn GpuBackend> {
        Arc::new(CudaBackend::new(0).expect("a CUDA device"))
    }

    #[test]
    fn circuit_reference_verify_is_bitwise_legacy_on_cuda() {
        verify_is_bitwise_legacy(gpu);
    }

    #[test]
    fn circuit_reference_batched_verify_is_bitwise_legacy_on_cuda() {
        batched_verify_is_bitwise_legacy(gpu);
    }

    #[test]
    fn a_batched_verify_step_replayed_from_its_graph_is_bitwise_eager_on_cuda() {
        batched_verify_graph_is_eager(gpu);
    }

    #[test]
    fn circuit_reference_batched_draft_steps_are_bitwise_legacy_on_cuda() {
        draft::batched_draft_is_bitwise_legacy(gpu);
    }

    #[test]
    fn circuit_reference_draft_steps_are_bitwise_legacy_on_cuda() {
        draft::draft_is_bitwise_legacy(gpu);
    }
}
