//! The executor's speculative-decoding programs on synthetic bindings (recorded, never run): a
//! single-sequence verify program per verify row count and a batched one per shape, with the
//! plan's launch count, whose GDN layers keep each row's state through the row-slot map and read
//! their sequences; a draft
//! program per draft row count reading the MTP head's buffers, weights and KV pool; and the
//! draft head's binding problems, named as the draft head's in the one refusal.

#![allow(clippy::unwrap_used)]

use metrale_circuit::{Block, LinearRole};
use metrale_gpu_runtime::{DType, DevicePtr, KernelArg};
use metrale_kernel_abi::{
    ConvStateVerifyParams, GatedDeltaVerifyParams, GatherRowsParams, LinearParams,
    PagedAttentionParams, RmsNormParams,
};

use super::*;

/// Whether `l` passes `p` as one of its pointers.
fn reads(l: &Launch, p: DevicePtr) -> bool {
    l.args.iter().any(|a| match a {
        KernelArg::Params(block) => block.ptr_fields().any(|(_, q)| q == p),
        _ => false,
    })
}

#[test]
fn verify_programs_keep_each_rows_state_and_read_one_sequence() {
    let m = model(&[LA_MOE, FA_MOE]);
    let exec = m.build(Fusions::ReferenceOnly).unwrap();
    let widths: Vec<(u64, u64)> = (exec.verify_programs().iter())
        .map(|p| (p.rows(), p.width().seqs))
        .collect();
    assert_eq!(widths, [(2, 1), (3, 1), (4, 1), (5, 1), (5, 2), (8, 2)]);
    for (plan, program) in exec.verify_plans().iter().zip(exec.verify_programs()) {
        assert_eq!(program.step(), Step::Verify);
        assert_eq!(program.launches().len(), plan.launches_per_step());
        assert_eq!(program.plan_digest(), plan.digest());
        assert!(plan.text().contains("\nstep verify\n"));
    }
    // The same launches as a decode step, but for the GDN layer's two state kernels.
    let decode = exec.program(4).unwrap();
    let verify = exec.verify_program(Width::new(4, 1)).unwrap();
    assert_eq!(decode.launches().len(), verify.launches().len());
    let k = &m.ops.k;
    let ssm = m.fixed.pools[0].ssm.unwrap();
    let row_slot = m.fixed.buffers.meta.row_slot;
    let find = |kernel| {
        verify
            .launches()
            .iter()
            .find(|l| l.kernel == kernel)
            .unwrap()
    };
    let window: ConvStateVerifyParams = find(k.conv_state_verify).params().unwrap();
    assert_eq!((window.conv_state, window.row_slot), (ssm.conv, row_slot));
    let shape = [
        window.rows,
        window.num_seqs,
        window.num_slots,
        window.slot_stride,
    ];
    assert_eq!(shape, [4, 1, 4, 3 * 88]);
    let rule: GatedDeltaVerifyParams = find(k.gated_delta_verify).params().unwrap();
    assert_eq!((rule.state, rule.row_slot), (ssm.recurrent, row_slot));
    assert_eq!([rule.rows, rule.num_seqs], [4, 1]);
    for kernel in [k.conv_state_update, k.gated_delta_recurrent] {
        assert!(verify.launches().iter().all(|l| l.kernel != kernel));
    }
    // Attention reads the one sequence's block table.
    let attention: PagedAttentionParams = find(k.paged_attention).params().unwrap();
    assert_eq!({ attention.num_seqs }, 1);
    // A batched program: the same kernels, over the rows and sequences of its shape.
    let batched = exec.verify_program(Width::new(8, 2)).unwrap();
    let kernels = |p: &Program| p.launches().iter().map(|l| l.kernel).collect::<Vec<_>>();
    assert_eq!(kernels(batched), kernels(verify));
    let find = |kernel| {
        (batched.launches().iter())
            .find(|l| l.kernel == kernel)
            .unwrap()
    };
    let window: ConvStateVerifyParams = find(k.conv_state_verify).params().unwrap();
    assert_eq!([window.rows, window.num_seqs], [8, 2]);
    let rule: GatedDeltaVerifyParams = find(k.gated_delta_verify).params().unwrap();
    assert_eq!([rule.rows, rule.num_seqs], [8, 2]);
    let attention: PagedAttentionParams = find(k.paged_attention).params().unwrap();
    assert_eq!([attention.rows, attention.num_seqs], [8, 2]);
    assert!(exec.verify_program(Width::new(8, 3)).is_none());
    // The digest covers the verify plans: without them it is the decode plans' alone.
    let mut plain = model(&[LA_MOE, FA_MOE]);
    plain.instance.verify_rows.clear();
    plain.instance.verify_batches.clear();
    plain.instance.draft_rows.clear();
    plain.instance.draft_batches.clear();
    let plain = plain.build(Fusions::ReferenceOnly).unwrap();
    assert!(plain.verify_programs().is_empty());
    assert_eq!(plain.plans_digest(), plans_digest(plain.plans()));
    assert_ne!(plain.plans_digest(), exec.plans_digest());
}

#[test]
fn draft_programs_run_the_mtp_head_on_its_buffers_weights_and_kv_pool() {
    let m = model(&[LA_MOE, FA_MOE]);
    let exec = m.build(Fusions::ReferenceOnly).unwrap();
    let widths: Vec<(u64, u64)> = (exec.draft_programs().iter())
        .map(|p| (p.rows(), p.width().seqs))
        .collect();
    assert_eq!(widths, [(1, 1), (2, 1), (3, 1), (4, 1), (5, 1), (4, 2)]);
    for (plan, program) in exec.draft_plans().iter().zip(exec.draft_programs()) {
        assert_eq!(program.step(), Step::Draft);
        assert_eq!(program.launches().len(), plan.launches_per_step());
        assert_eq!(program.plan_digest(), plan.digest());
        assert!(
            plan.text()
                .contains("\nstep draft\ndraft_layer full_attention/moe\n")
        );
    }
    let program = exec.draft_program(Width::new(3, 1)).unwrap();
    let (k, draft, d) = (
        &m.ops.k,
        m.draft.as_ref().unwrap(),
        m.fixed.draft.as_ref().unwrap(),
    );
    let l = program.launches();
    // embedding; norm_e: residual -> cat_src; norm_h: mtp.hidden -> cat_src + 3 bf16 rows.
    assert_eq!(l[0].kernel, k.embedding_gather);
    let residual = m.fixed.buffers.acts.residual;
    assert_eq!((l[1].kernel, l[2].kernel), (k.rms_norm, k.rms_norm));
    let norm = |i: usize| {
        let p: RmsNormParams = l[i].params().unwrap();
        (p.out, p.x, p.w)
    };
    assert_eq!(norm(1), (d.cat_src, residual, draft.norm_embedding.ptr()));
    let second_half = d.cat_src.offset(3 * 64 * 2);
    assert_eq!(norm(2), (second_half, d.hidden, draft.norm_hidden.ptr()));
    // The concat: 6 half-rows of 64 gathered out of cat_src's 6 rows by cat_ids.
    assert_eq!(l[3].kernel, k.gather_rows);
    assert_eq!(
        l[3].params(),
        Some(GatherRowsParams {
            out: d.cat,
            x: d.cat_src,
            row_ids: d.cat_ids,
            n: 6,
            cols: 64,
            src_rows: 6,
        })
    );
    // fc: cat -> residual (f32 out), 3 x 64 from 128.
    let fc: LinearParams = l[4].params().unwrap();
    assert_eq!((fc.out, fc.x, fc.w), (residual, d.cat, draft.fc.ptr()));
    assert_eq!([fc.m, fc.n, fc.k], [3, 64, 128]);
    // The head layer's attention writes and reads the draft pool, over one sequence.
    let kv = d.pools[0].kv.unwrap();
    let attention = l.iter().find(|x| x.kernel == k.paged_attention).unwrap();
    let a: PagedAttentionParams = attention.params().unwrap();
    assert_eq!((a.k_cache, a.v_cache, a.num_seqs), (kv.k, kv.v, 1));
    let store = l.iter().find(|x| x.kernel == k.kv_store).unwrap();
    assert!(reads(store, kv.k));
    let target_kv = m.fixed.pools[1].kv.unwrap();
    assert!(l.iter().all(|x| !reads(x, target_kv.k)));
    // mtp.norm, then the shared LM head on one logit row.
    let n = l.len();
    assert_eq!(l[n - 3].kernel, k.add_rms_norm);
    assert!(reads(&l[n - 3], draft.norm.ptr()));
    assert_eq!(l[n - 2].kernel, k.gather_rows);
    let gather: GatherRowsParams = l[n - 2].params().unwrap();
    assert_eq!([gather.n, gather.cols, gather.src_rows], [1, 64, 3]);
    assert!(reads(&l[n - 1], m.head.lm_head.ptr()));
    // Two sequences of four rows: attention over both, the LM head on each one's last row.
    let batched = exec.draft_program(Width::new(4, 2)).unwrap().launches();
    let a: PagedAttentionParams = (batched.iter())
        .find(|x| x.kernel == k.paged_attention)
        .and_then(|x| x.params())
        .unwrap();
    assert_eq!([a.rows, a.num_seqs], [4, 2]);
    let gather: GatherRowsParams = batched[batched.len() - 2].params().unwrap();
    assert_eq!([gather.n, gather.cols, gather.src_rows], [2, 64, 4]);
    // The digest covers the draft plans.
    let mut plain = model(&[LA_MOE, FA_MOE]);
    plain.instance.draft_rows.clear();
    plain.instance.draft_batches.clear();
    let plain = plain.build(Fusions::ReferenceOnly).unwrap();
    assert!(plain.draft_programs().is_empty());
    assert_ne!(plain.plans_digest(), exec.plans_digest());
}

#[test]
fn draft_head_binding_problems_are_named_as_the_draft_heads_with_the_layers_ones() {
    let mut m = model(&[LA_MOE, FA_MOE]);
    m.layers[0]
        .as_mut()
        .unwrap()
        .unmodelled
        .push("LoRA adapters".into());
    let draft = m.draft.as_mut().unwrap();
    draft.fc = Addr(0x77_0000).weight(&[64, 64], DType::Bf16);
    let mut drop_norm = draft.layers[0].clone().unwrap();
    drop_norm.weights.remove(&WeightSlot::PostNorm);
    draft.layers[0] = Some(drop_norm);
    m.fixed.draft.as_mut().unwrap().pools[0].kv = None;
    let problems = match m.build(Fusions::All) {
        Err(CircuitExecError::Bindings { problems }) => problems,
        other => panic!("not refused with binding problems: {other:?}"),
    };
    assert_eq!(
        problems,
        [
            BindingProblem::Unmodelled {
                part: Part::Layer(0),
                feature: "LoRA adapters".into()
            },
            BindingProblem::MissingPool {
                part: Part::DraftLayer(0),
                pool: "KV cache"
            },
            BindingProblem::WeightShape {
                block: Block::Draft,
                slot: WeightSlot::Linear(LinearRole::Fc),
                expected: 64 * 128,
                last: Some(128),
                found: vec![64, 64],
            },
            BindingProblem::MissingWeight {
                block: Block::DraftLayer(0),
                slot: WeightSlot::PostNorm,
            },
        ]
    );
    let text = CircuitExecError::Bindings { problems }.to_string();
    assert!(text.contains("4 problems"), "{text}");
    assert!(
        text.contains("draft head layer 0: no KV cache bound"),
        "{text}"
    );
    assert!(
        text.contains("draft: weight linear(fc) has shape [64, 64]"),
        "{text}"
    );
    // An unbound head with draft rows to compile is refused too, naming the draft head.
    let mut m = model(&[LA_MOE, FA_MOE]);
    m.draft = None;
    let text = m.build(Fusions::All).unwrap_err().to_string();
    assert!(text.contains("draft head has no circuit binding"), "{text}");
    // A weight of the wrong format is refused at compile, naming its draft block.
    let mut m = model(&[LA_MOE, FA_MOE]);
    m.draft.as_mut().unwrap().norm = Addr(0x78_0000).weight(&[64], DType::F32);
    let text = m.build(Fusions::All).unwrap_err().to_string();
    assert!(text.contains("draft: weight mtp.norm is f32"), "{text}");
}
