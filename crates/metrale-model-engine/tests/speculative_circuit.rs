//! Speculative decoding under the circuit forward, on the CPU backend: a single-sequence verify
//! step of `circuit-reference` (its verify program) is bitwise the legacy one, logits and the
//! state every row keeps, for K = 1..4, eager and graphed, and launches exactly what the legacy
//! step launches; so is a verify step of two to four sequences (its batched verify program) at
//! K = 3, dense and hybrid, while five sequences run the legacy launches; a batched verify step replayed from a graph captured under another mix of
//! drafts is bitwise the eager step; a single-sequence MTP draft step of `circuit-reference`
//! (its draft program) is bitwise the legacy one, logits and the head's KV cache, for 1 to 5
//! rows and the single-row draft after it, eager and graphed, launching what the legacy head
//! launches, and so are draft steps of two to four sequences (take-ins and the draft after);
//! greedy MTP generation under `circuit` is plain greedy, alone and batched, and runs every
//! verify step and some draft steps from circuit programs.
//! The bitwise and graph tests also run on CUDA (module `cuda`, with `--features cuda`).

#![allow(clippy::unwrap_used)]

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
use metrale_model_layers::circuit_exec::Step;
use support::*;

const REFERENCE: ForwardSelect = ForwardSelect::Circuit {
    fusions: Fusions::ReferenceOnly,
};

fn spec_options(k: usize, graphs: bool) -> ModelOptions {
    ModelOptions::default()
        .speculative(Speculative::External)
        .num_draft_tokens(k)
        .decode_graphs(graphs)
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

/// The bytes of the MTP head's KV pools (the last KV-cache layer).
fn head_kv(model: &mut Rig) -> Vec<u8> {
    let layout = *model.cache.kv_layout();
    let pools = model.cache.kv_layer(layout.num_layers - 1);
    let gpu = model.runner.model().gpu().clone();
    let bytes = layout.pool_bytes();
    let s = gpu.default_stream();
    let mut out: Vec<u8> = gpu.download(pools.k, bytes, s).unwrap();
    out.extend(gpu.download::<u8>(pools.v, bytes, s).unwrap());
    out
}

/// After a prefill of `p`, a take-in MTP step of its last `rows` rows (logits on the last),
/// then the next draft's single row; each step's logits, then the head's KV pools.
fn draft_steps(model: &mut Rig, p: &[u32], rows: usize) -> (Vec<Vec<u32>>, Vec<u8>) {
    let seq = Seq::prefilled(model, p, 0);
    let n = p.len();
    let take_in: Vec<StepRow> = (n - rows..n)
        .map(|pos| StepRow {
            token: p.get(pos + 1).copied().unwrap_or(5),
            position: pos as u32,
            seq: 0,
        })
        .collect();
    let hidden: Vec<u32> = (n - rows..n).map(|r| r as u32).collect();
    let mut logits = Vec::new();
    (model.runner)
        .mtp_step(&MtpStep {
            rows: &take_in,
            tables: &[&seq.table],
            hidden_rows: &hidden,
            logit_rows: &[rows as u32 - 1],
            depth: 0,
        })
        .unwrap();
    logits.extend(bits(&model.runner.logits(1).unwrap()));
    let next = [StepRow {
        token: model.runner.greedy(1).unwrap()[0],
        position: n as u32,
        seq: 0,
    }];
    (model.runner)
        .mtp_step(&MtpStep {
            rows: &next,
            tables: &[&seq.table],
            hidden_rows: &[rows as u32 - 1],
            logit_rows: &[0],
            depth: 1,
        })
        .unwrap();
    logits.extend(bits(&model.runner.logits(1).unwrap()));
    let kv = head_kv(model);
    seq.free(model);
    (logits, kv)
}

#[test]
fn circuit_reference_draft_steps_are_bitwise_legacy_logits_and_head_kv_for_1_to_5_rows() {
    draft_is_bitwise_legacy(cpu);
}

fn draft_is_bitwise_legacy(gpu: fn() -> Arc<dyn GpuBackend>) {
    for name in HYBRID {
        let fx = MtpFixture::new(name);
        for graphs in [false, true] {
            let options = ModelOptions::default()
                .speculative(Speculative::Mtp)
                .num_draft_tokens(4)
                .decode_graphs(graphs);
            let load = || Rig::load_on(fx.path(), options.clone(), gpu());
            let (mut legacy, mut circuit) = (load(), load());
            let shapes: Vec<(usize, usize)> = (1..=5).map(|rows| (rows, 1)).collect();
            programs_launch_legacy(&mut circuit, name, Step::Draft, &shapes);
            for rows in 1..=5 {
                let p = prompt(9 + rows as u32, rows as u32);
                let a = draft_steps(&mut legacy, &p, rows);
                let b = draft_steps(&mut circuit, &p, rows);
                assert!(
                    a.0 == b.0,
                    "{name} {rows} rows, graphs {graphs}: draft logits differ"
                );
                assert!(
                    a.1 == b.1,
                    "{name} {rows} rows, graphs {graphs}: the head's KV differs"
                );
            }
            assert_eq!(legacy.runner.draft_program_steps(), 0, "{name}");
            assert_eq!(
                circuit.runner.draft_program_steps(),
                10,
                "{name}: every step ran a program"
            );
        }
    }
}

/// Batched drafts: sequence `i` (prompt `prompts[i]`) takes in its last `take[i]` rows with
/// logits on the last, then every sequence drafts one more row; each step's logits, then the
/// head's KV pools.
fn batched_draft_steps(
    model: &mut Rig,
    prompts: &[Vec<u32>],
    take: &[usize],
) -> (Vec<Vec<u32>>, Vec<u8>) {
    let seqs: Vec<Seq> = prompts
        .iter()
        .map(|p| Seq::prefilled(model, p, 0))
        .collect();
    let (mut rows, mut hidden, mut last) = (Vec::new(), Vec::new(), Vec::new());
    for (q, (p, &t)) in prompts.iter().zip(take).enumerate() {
        let n = p.len();
        for pos in n - t..n {
            rows.push(StepRow {
                token: p.get(pos + 1).copied().unwrap_or(5),
                position: pos as u32,
                seq: q as u32,
            });
            // The take-in reads each prompt's final-norm rows of its own prefill: row `pos`
            // of the last prefill stands for all of them (the bits compared are the same
            // for both forwards).
            hidden.push(pos as u32);
        }
        last.push(rows.len() as u32 - 1);
    }
    let tables: Vec<&BlockTable> = seqs.iter().map(|s| &s.table).collect();
    let mut logits = Vec::new();
    (model.runner)
        .mtp_step(&MtpStep {
            rows: &rows,
            tables: &tables,
            hidden_rows: &hidden,
            logit_rows: &last,
            depth: 0,
        })
        .unwrap();
    logits.extend(bits(&model.runner.logits(last.len()).unwrap()));
    let picks = model.runner.greedy(last.len()).unwrap();
    let next: Vec<StepRow> = (prompts.iter().zip(picks).enumerate())
        .map(|(q, (p, token))| StepRow {
            token,
            position: p.len() as u32,
            seq: q as u32,
        })
        .collect();
    let seqs_n = next.len() as u32;
    (model.runner)
        .mtp_step(&MtpStep {
            rows: &next,
            tables: &tables,
            hidden_rows: &last,
            logit_rows: &(0..seqs_n).collect::<Vec<_>>(),
            depth: 1,
        })
        .unwrap();
    logits.extend(bits(&model.runner.logits(next.len()).unwrap()));
    let kv = head_kv(model);
    for s in seqs {
        s.free(model);
    }
    (logits, kv)
}

#[test]
fn circuit_reference_batched_draft_steps_are_bitwise_legacy_for_up_to_four_sequences() {
    batched_draft_is_bitwise_legacy(cpu);
}

fn batched_draft_is_bitwise_legacy(gpu: fn() -> Arc<dyn GpuBackend>) {
    // Take-ins of 1 to 1 + K rows a sequence; the last has five sequences, past
    // `circuit_speculative_seqs` (4), and runs the legacy launches.
    let takes: [&[usize]; 3] = [&[4, 1], &[2, 4, 3, 1], &[1, 1, 2, 1, 1]];
    for name in HYBRID {
        let fx = MtpFixture::new(name);
        for graphs in [false, true] {
            let options = ModelOptions::default()
                .speculative(Speculative::Mtp)
                .num_draft_tokens(3)
                .decode_graphs(graphs);
            let load = || Rig::load_on(fx.path(), options.clone(), gpu());
            let (mut legacy, mut circuit) = (load(), load());
            let shapes: Vec<(usize, usize)> = (takes.iter())
                .flat_map(|t| [(t.iter().sum(), t.len()), (t.len(), t.len())])
                .collect();
            programs_launch_legacy(&mut circuit, name, Step::Draft, &shapes);
            for take in takes {
                let prompts: Vec<Vec<u32>> = (0..take.len() as u32)
                    .map(|i| prompt(8 + 3 * i, i + 1))
                    .collect();
                let a = batched_draft_steps(&mut legacy, &prompts, take);
                let b = batched_draft_steps(&mut circuit, &prompts, take);
                assert!(a.0 == b.0, "{name} {take:?} graphs {graphs}: logits differ");
                assert!(
                    a.1 == b.1,
                    "{name} {take:?} graphs {graphs}: head KV differs"
                );
            }
            assert_eq!(legacy.runner.draft_program_steps(), 0, "{name}");
            assert_eq!(
                circuit.runner.draft_program_steps(),
                4,
                "{name}: the steps of up to four sequences ran draft programs, five did not"
            );
        }
    }
}

#[test]
fn the_disclosed_digest_covers_the_draft_plans_metrale_circuit_plan_prints() {
    for name in HYBRID {
        let fx = MtpFixture::new(name);
        let options = ModelOptions::default()
            .speculative(Speculative::Mtp)
            .num_draft_tokens(2)
            .circuit_speculative_seqs(1);
        let mut model = Rig::load(fx.path(), options.clone());
        model.runner.set_forward(REFERENCE).unwrap();
        let d = model.runner.forward_disclosure().unwrap();
        let config = model.runner.model().config();
        let plans = checkpoint_plans(config, &options, Fusions::ReferenceOnly).unwrap();
        let rows: Vec<u64> = plans.iter().skip(4).map(|p| p.rows()).collect();
        assert_eq!(
            rows,
            [2, 3, 1, 2, 3],
            "{name}: verify 2, 3, then draft 1, 2, 3"
        );
        assert_eq!(d.plan_digest, Some(plans_digest(&plans)), "{name}");
        let p2 = checkpoint_plan(
            config,
            &options,
            Step::Draft,
            Fusions::ReferenceOnly,
            Step::Draft.width(2),
        );
        let p2 = p2.unwrap();
        assert!(p2.text() == plans[7].text() && p2.text().contains("\nstep draft\n"));
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
        batched_draft_is_bitwise_legacy(gpu);
    }

    #[test]
    fn circuit_reference_draft_steps_are_bitwise_legacy_on_cuda() {
        draft_is_bitwise_legacy(gpu);
    }
}
