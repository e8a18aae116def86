//! The speculative steps' plans (part of `plans.rs`): a verify plan reads one sequence and keeps
//! every row's state, a batched verify plan the same launches over several sequences, a draft plan
//! (batched: a logit row per sequence) is the MTP head over one sequence with one logit row, and
//! draft rows need a full-attention draft layer.

use super::*;

/// `instance`'s circuit of `step` and its plans at every width of the step, lowered with the
/// reference rules of its architecture.
fn reference_plans(instance: &Instance, step: Step) -> Result<(Arc<Circuit>, Vec<Plan>)> {
    let table = RuleTable::for_architecture(instance.architecture);
    let kernels = support::reference_kernels(&table);
    let circuit = Arc::new(Circuit::for_step(instance, step)?);
    let lowering = Lowering {
        rules: &table,
        fusions: Fusions::ReferenceOnly,
        kernels: &kernels,
    };
    let plans = Plan::compile_widths(&circuit, &lowering)?;
    Ok((circuit, plans))
}

#[test]
fn a_verify_plan_reads_one_sequence_keeps_every_rows_state_and_says_so() -> Result<()> {
    let instance = support::hybrid(vec![LA_DENSE, FA_DENSE]);
    let (verify, plans) = reference_plans(&instance, Step::Verify)?;
    ensure!(
        plans
            .iter()
            .map(Plan::rows)
            .eq(instance.verify_rows.iter().copied())
    );
    let kernels = support::reference_kernels(&RuleTable::for_architecture(instance.architecture));
    let decode = support::plan(&instance, Fusions::ReferenceOnly, &kernels, 3);
    let plan = &plans[1];
    ensure!(plan.rows() == 3 && plan.launches_per_step() == decode.launches_per_step());
    ensure!(plan.text().contains("\nstep verify\nrows 3\n") && !decode.text().contains("step"));
    ensure!(plan.digest() != decode.digest());
    // The GDN layer's conv and rule keep each row's state; nothing else changes.
    let differ: Vec<(String, String)> = names(plan)
        .into_iter()
        .zip(names(&decode))
        .filter(|(v, d)| v != d)
        .collect();
    ensure!(
        differ
            == [
                (
                    "gdn::conv_state_verify".into(),
                    "gdn::conv_state_update".into()
                ),
                (
                    "gdn::gated_delta_verify".into(),
                    "gdn::gated_delta_recurrent".into()
                ),
            ],
        "{differ:?}"
    );
    // One sequence of three rows: the per-sequence inputs have one entry, the row slots three.
    for node in verify.nodes() {
        for &v in &node.inputs {
            let value = verify.value(v).context("an input value exists")?;
            let ext = plan.extents(v);
            match value.tensor {
                Tensor::SeqSlot | Tensor::BlockTables => ensure!(ext[0] == 1, "{ext:?}"),
                Tensor::SeqStart => ensure!(ext == [2], "{ext:?}"),
                Tensor::RowSlot | Tensor::LogitRows => ensure!(ext == [3], "{ext:?}"),
                _ => {}
            }
        }
    }
    let reads_row_slot = |op: Op| {
        verify.nodes().iter().any(|n| {
            n.op == op
                && n.inputs
                    .iter()
                    .any(|&v| verify.value(v).is_some_and(|x| x.tensor == Tensor::RowSlot))
        })
    };
    ensure!(reads_row_slot(Op::GdnConvVerify) && reads_row_slot(Op::GdnRecurrenceVerify));
    Ok(())
}

#[test]
fn a_batched_verify_plan_launches_the_single_sequence_kernels_over_several_sequences() -> Result<()>
{
    let mut instance = support::hybrid(vec![LA_DENSE, FA_DENSE]);
    instance.verify_batches = vec![Width::new(3, 2), Width::new(6, 2), Width::new(7, 3)];
    let (verify, plans) = reference_plans(&instance, Step::Verify)?;
    let widths: Vec<(u64, u64)> = plans.iter().map(|p| (p.rows(), p.seqs())).collect();
    ensure!(
        widths == [(2, 1), (3, 1), (3, 2), (6, 2), (7, 3)],
        "{widths:?}"
    );
    let (single, batched) = (&plans[1], &plans[3]);
    ensure!(names(batched) == names(single));
    ensure!(batched.text().contains("\nstep verify\nrows 6\nseqs 2\n"));
    ensure!(!single.text().contains("seqs"));
    // Three rows of one sequence and three rows of two: the same kernels, other extents.
    ensure!(plans[2].digest() != single.digest());
    for node in verify.nodes() {
        for &v in &node.inputs {
            let value = verify.value(v).context("an input value exists")?;
            let ext = batched.extents(v);
            match value.tensor {
                Tensor::SeqSlot | Tensor::BlockTables => ensure!(ext[0] == 2, "{ext:?}"),
                Tensor::SeqStart => ensure!(ext == [3], "{ext:?}"),
                Tensor::RowSlot | Tensor::LogitRows => ensure!(ext == [6], "{ext:?}"),
                _ => {}
            }
        }
    }
    // A shape of one sequence, of no draft, or out of order is refused.
    for bad in [
        vec![Width::new(4, 1)],
        vec![Width::new(2, 2)],
        vec![Width::new(6, 2), Width::new(5, 2)],
    ] {
        instance.verify_batches = bad;
        ensure!(matches!(
            instance.validate(),
            Err(CircuitError::BadVerifyBatches { .. })
        ));
    }
    Ok(())
}

#[test]
fn a_draft_plan_is_the_mtp_head_over_one_sequence_with_one_logit_row_and_says_so() -> Result<()> {
    let instance = support::hybrid_moe();
    let (draft, plans) = reference_plans(&instance, Step::Draft)?;
    ensure!(plans.iter().map(Plan::rows).eq([1, 2, 3]));
    let plan = &plans[2];
    ensure!(
        plan.text()
            .contains("\nstep draft\ndraft_layer full_attention/moe\nrows 3\n")
    );
    // The legacy head's launches: embedding, two norms, the concat, fc, one decoder layer,
    // the head's norm, the shared LM head.
    let n = names(plan);
    ensure!(
        n[..6]
            == [
                "embed::embedding_gather",
                "norm::rms_norm",
                "norm::rms_norm",
                "embed::gather_rows",
                "gemm::linear_f32out",
                "norm::rms_norm",
            ],
        "{n:?}"
    );
    ensure!(
        n[n.len() - 4..]
            == [
                "norm::add_rms_norm",
                "embed::gather_rows",
                "gemm::linear_f32out",
                "sampling::argmax"
            ]
    );
    let blocks: Vec<Block> = plan.groups().iter().map(|g| g.block).collect();
    ensure!(
        !blocks.iter().any(|b| matches!(b, Block::Layer(_))),
        "{blocks:?}"
    );
    ensure!(blocks.contains(&Block::DraftLayer(0)) && blocks.contains(&Block::Draft));
    // Three rows of one sequence, the last one with logits; the concat reads 2 ids per row.
    for (i, value) in draft.values().iter().enumerate() {
        let ext = plan.extents(ValueId(i));
        match value.tensor {
            Tensor::BlockTables => ensure!(ext[0] == 1, "{ext:?}"),
            Tensor::LogitRows | Tensor::Sampled => ensure!(ext == [1], "{ext:?}"),
            Tensor::Logits => ensure!(ext == [1, 256], "{ext:?}"),
            Tensor::MtpCatIds => ensure!(ext == [6], "{ext:?}"),
            Tensor::MtpCat => ensure!(ext == [3, 128], "{ext:?}"),
            Tensor::MtpHidden | Tensor::Residual => ensure!(ext == [3, 64], "{ext:?}"),
            _ => {}
        }
    }
    // The KV cache written and read is the draft layer's own pool.
    let pools: Vec<Option<Block>> = (draft.values().iter())
        .filter(|v| v.tensor == Tensor::KCache)
        .map(|v| v.pool_of)
        .collect();
    ensure!(pools.iter().all(|p| *p == Some(Block::DraftLayer(0))) && !pools.is_empty());
    // Decode texts do not depend on the draft step; draft digests on its rows and layer.
    let kernels = support::reference_kernels(&RuleTable::for_architecture(instance.architecture));
    let mut plain = instance.clone();
    plain.draft_rows.clear();
    plain.draft_layer = None;
    ensure!(
        support::plan(&plain, Fusions::ReferenceOnly, &kernels, 1).text()
            == support::plan(&instance, Fusions::ReferenceOnly, &kernels, 1).text()
    );
    ensure!(plans[0].digest() != plans[1].digest());
    Ok(())
}

#[test]
fn a_batched_draft_plan_has_a_logit_row_per_sequence() -> Result<()> {
    let mut instance = support::hybrid_moe();
    instance.draft_batches = vec![Width::new(2, 2), Width::new(5, 2), Width::new(3, 3)];
    let (draft, plans) = reference_plans(&instance, Step::Draft)?;
    let widths: Vec<(u64, u64)> = plans.iter().map(|p| (p.rows(), p.seqs())).collect();
    ensure!(
        widths == [(1, 1), (2, 1), (3, 1), (2, 2), (5, 2), (3, 3)],
        "{widths:?}"
    );
    let plan = &plans[4];
    ensure!(names(plan) == names(&plans[1]));
    ensure!(
        plan.text().contains("\nrows 5\nseqs 2\n"),
        "{}",
        plan.text()
    );
    for (i, value) in draft.values().iter().enumerate() {
        let ext = plan.extents(ValueId(i));
        match value.tensor {
            Tensor::BlockTables => ensure!(ext[0] == 2, "{ext:?}"),
            Tensor::LogitRows | Tensor::Sampled => ensure!(ext == [2], "{ext:?}"),
            Tensor::Logits => ensure!(ext == [2, 256], "{ext:?}"),
            Tensor::MtpCat => ensure!(ext == [5, 128], "{ext:?}"),
            _ => {}
        }
    }
    for bad in [vec![Width::new(3, 1)], vec![Width::new(1, 2)]] {
        instance.draft_batches = bad;
        ensure!(matches!(
            instance.validate(),
            Err(CircuitError::BadDraftBatches { .. })
        ));
    }
    instance.draft_batches = vec![Width::new(2, 2)];
    instance.draft_rows.clear();
    instance.draft_layer = None;
    ensure!(instance.validate() == Err(CircuitError::NoDraftLayer));
    Ok(())
}

#[test]
fn draft_rows_need_a_full_attention_draft_layer() {
    let mut instance = support::hybrid_moe();
    instance.draft_layer = None;
    assert_eq!(instance.validate(), Err(CircuitError::NoDraftLayer));
    instance.draft_rows.clear();
    assert!(instance.validate().is_ok());
    assert_eq!(
        Circuit::for_step(&instance, Step::Draft).err(),
        Some(CircuitError::NoDraftLayer)
    );
    instance.draft_layer = Some(LA_MOE);
    assert!(matches!(
        instance.validate(),
        Err(CircuitError::BadDraftLayer { .. })
    ));
    instance.draft_layer = Some(support::FA_MOE);
    instance.draft_rows = vec![2, 1];
    assert!(matches!(
        instance.validate(),
        Err(CircuitError::BadDraftRows { .. })
    ));
}
