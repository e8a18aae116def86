//! The executor's speculative-decoding programs on synthetic bindings (recorded, never run): a
//! single-sequence verify program per verify row count, with the plan's launch count, whose GDN
//! layers keep each row's state through the row-slot map and read one sequence.

#![allow(clippy::unwrap_used)]

use metrale_gpu_runtime::KernelArg::{Ptr, U32};

use super::tests::{FA_MOE, LA_MOE, model};
use super::*;

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
    let plain = plain.build(Fusions::ReferenceOnly).unwrap();
    assert!(plain.verify_programs().is_empty());
    assert_eq!(plain.plans_digest(), plans_digest(plain.plans()));
    assert_ne!(plain.plans_digest(), exec.plans_digest());
}
