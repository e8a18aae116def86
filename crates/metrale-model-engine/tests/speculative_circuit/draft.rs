//! The draft (MTP head) steps of `speculative_circuit.rs`: circuit-reference draft programs
//! of one sequence (1 to 5 rows, and the single-row draft after) and of two to four sequences
//! (take-ins and the draft after) are bitwise the legacy launches, logits and the head's KV,
//! eager and graphed; the disclosed digest covers the draft plans.

use super::*;

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

pub(super) fn draft_is_bitwise_legacy(gpu: fn() -> Arc<dyn GpuBackend>) {
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

pub(super) fn batched_draft_is_bitwise_legacy(gpu: fn() -> Arc<dyn GpuBackend>) {
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
