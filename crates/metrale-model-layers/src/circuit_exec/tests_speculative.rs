//! The executor's speculative-decoding programs on synthetic bindings (recorded, never run): a
//! single-sequence verify program per verify row count, with the plan's launch count, whose GDN
//! layers keep each row's state through the row-slot map and read one sequence; a draft
//! program per draft row count reading the MTP head's buffers, weights and KV pool; and the
//! draft head's binding problems, named as the draft head's in the one refusal.

#![allow(clippy::unwrap_used)]

use metrale_gpu_runtime::KernelArg::{Ptr, U32};

use super::tests::{Addr, FA_MOE, LA_MOE, model};
use super::*;
use metrale_circuit::{Block, LinearRole};
use metrale_gpu_runtime::DType;

#[test]
fn verify_programs_keep_each_rows_state_and_read_one_sequence() {
    let m = model(&[LA_MOE, FA_MOE]);
    let exec = m.build(Fusions::ReferenceOnly).unwrap();
    let rows: Vec<u64> = exec.verify_programs().iter().map(Program::rows).collect();
    assert_eq!(rows, [2, 3, 4, 5]);
    for (plan, program) in exec.verify_plans().iter().zip(exec.verify_programs()) {
        assert_eq!(program.step(), Step::Verify);
        assert_eq!(program.launches().len(), plan.launches_per_step());
        assert_eq!(program.plan_digest(), plan.digest());
        assert!(plan.text().contains("\nstep verify\n"));
    }
    // The same launches as a decode step, but for the GDN layer's two state kernels.
    let decode = exec.program(4).unwrap();
    let verify = exec.verify_program(4).unwrap();
    assert_eq!(decode.launches().len(), verify.launches().len());
    let k = &m.ops.k;
    let ssm = m.fixed.pools[0].ssm.unwrap();
    let row_slot = m.fixed.buffers.row_slot;
    let find = |kernel| {
        verify
            .launches()
            .iter()
            .find(|l| l.kernel == kernel)
            .unwrap()
    };
    let window = find(k.conv_state_verify);
    // pool, proj, seq_start, seq_slot, row_slot; rows, sequences, slots, slot stride.
    assert_eq!(window.args[0], Ptr(ssm.conv));
    assert_eq!(window.args[4], Ptr(row_slot));
    assert_eq!(window.args[5..9], [U32(4), U32(1), U32(4), U32(3 * 88)]);
    let rule = find(k.gated_delta_verify);
    // out, pool, qk, conv, gates, seq_start, seq_slot, row_slot; rows, sequences.
    assert_eq!(rule.args[1], Ptr(ssm.recurrent));
    assert_eq!(rule.args[7], Ptr(row_slot));
    assert_eq!(rule.args[8..10], [U32(4), U32(1)]);
    for kernel in [k.conv_state_update, k.gated_delta_recurrent] {
        assert!(verify.launches().iter().all(|l| l.kernel != kernel));
    }
    // Attention reads the one sequence's block table.
    let attention = find(k.paged_attention);
    assert_eq!(attention.args[15], U32(1));
    // The digest covers the verify plans: without them it is the decode plans' alone.
    let mut plain = model(&[LA_MOE, FA_MOE]);
    plain.instance.verify_rows.clear();
    plain.instance.draft_rows.clear();
    let plain = plain.build(Fusions::ReferenceOnly).unwrap();
    assert!(plain.verify_programs().is_empty());
    assert_eq!(plain.plans_digest(), plans_digest(plain.plans()));
    assert_ne!(plain.plans_digest(), exec.plans_digest());
}

#[test]
fn draft_programs_run_the_mtp_head_on_its_buffers_weights_and_kv_pool() {
    let m = model(&[LA_MOE, FA_MOE]);
    let exec = m.build(Fusions::ReferenceOnly).unwrap();
    let rows: Vec<u64> = exec.draft_programs().iter().map(Program::rows).collect();
    assert_eq!(rows, [1, 2, 3, 4, 5]);
    for (plan, program) in exec.draft_plans().iter().zip(exec.draft_programs()) {
        assert_eq!(program.step(), Step::Draft);
        assert_eq!(program.launches().len(), plan.launches_per_step());
        assert_eq!(program.plan_digest(), plan.digest());
        assert!(
            plan.text()
                .contains("\nstep draft\ndraft_layer full_attention/moe\n")
        );
    }
    let program = exec.draft_program(3).unwrap();
    let (k, draft, d) = (
        &m.ops.k,
        m.draft.as_ref().unwrap(),
        m.fixed.draft.as_ref().unwrap(),
    );
    let l = program.launches();
    // embedding; norm_e: residual -> cat_src; norm_h: mtp.hidden -> cat_src + 3 bf16 rows.
    assert_eq!(l[0].kernel, k.embedding_gather);
    let residual = m.fixed.buffers.residual;
    assert_eq!((l[1].kernel, l[2].kernel), (k.rms_norm, k.rms_norm));
    assert_eq!(
        l[1].args[..3],
        [
            Ptr(d.cat_src),
            Ptr(residual),
            Ptr(draft.norm_embedding.ptr())
        ]
    );
    let second_half = d.cat_src.offset(3 * 64 * 2);
    assert_eq!(
        l[2].args[..3],
        [
            Ptr(second_half),
            Ptr(d.hidden),
            Ptr(draft.norm_hidden.ptr())
        ]
    );
    // The concat: 6 half-rows of 64 gathered out of cat_src's 6 rows by cat_ids.
    assert_eq!(l[3].kernel, k.gather_rows);
    assert_eq!(
        l[3].args,
        [
            Ptr(d.cat),
            Ptr(d.cat_src),
            Ptr(d.cat_ids),
            U32(6),
            U32(64),
            U32(6)
        ]
    );
    // fc: cat -> residual (f32 out), 3 x 64 from 128.
    assert_eq!(
        l[4].args[..3],
        [Ptr(residual), Ptr(d.cat), Ptr(draft.fc.ptr())]
    );
    // The head layer's attention writes and reads the draft pool, over one sequence.
    let kv = d.pools[0].kv.unwrap();
    let attention = l.iter().find(|x| x.kernel == k.paged_attention).unwrap();
    assert_eq!(attention.args[2..4], [Ptr(kv.k), Ptr(kv.v)]);
    assert_eq!(attention.args[15], U32(1));
    let store = l.iter().find(|x| x.kernel == k.kv_store).unwrap();
    assert!(store.args.contains(&Ptr(kv.k)));
    let target_kv = m.fixed.pools[1].kv.unwrap();
    assert!(l.iter().all(|x| !x.args.contains(&Ptr(target_kv.k))));
    // mtp.norm, then the shared LM head on one logit row.
    let n = l.len();
    assert_eq!(l[n - 3].kernel, k.add_rms_norm);
    assert!(l[n - 3].args.contains(&Ptr(draft.norm.ptr())));
    assert_eq!(l[n - 2].kernel, k.gather_rows);
    assert_eq!(l[n - 2].args[3..], [U32(1), U32(64), U32(3)]);
    assert!(l[n - 1].args.contains(&Ptr(m.head.lm_head.ptr())));
    // The digest covers the draft plans.
    let mut plain = model(&[LA_MOE, FA_MOE]);
    plain.instance.draft_rows.clear();
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
