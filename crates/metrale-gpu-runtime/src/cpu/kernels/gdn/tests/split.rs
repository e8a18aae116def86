//! The input projection's two layouts: every GDN kernel that reads the projection computes the
//! same bits from one fused `[rows, proj_width]` matrix as from a `[rows, conv_dim + value_dim]`
//! matrix followed by a `[rows, 2 Hv]` one holding the same values (the two GEMMs of a block-FP8
//! layer), and a stride shorter than the row it steps over is refused.

use half::bf16;
use metrale_kernel_abi::{
    CausalConv1dParams, ConvStateVerifyParams, DevicePtr, GatedRmsNormParams, GdnPrepareParams,
};
use metrale_testkit::Rng;

use super::{H, layout, state_update_of};
use crate::cpu::kernels::gdn::NO_SLOT;
use crate::cpu::test_support::Rig;

/// One layout of the projection on the device: where row `r`'s q|k|v|z and b|a lie.
#[derive(Clone, Copy)]
struct Proj {
    ptr: DevicePtr,
    stride: u32,
    ba_offset: u32,
    ba_stride: u32,
}

/// The fused `[rows, pw]` values `fused` uploaded as they are, and rearranged as q|k|v|z rows
/// followed by b|a rows.
fn layouts(r: &Rig, h: &H, fused: &[bf16], rows: usize) -> [Proj; 2] {
    let (pw, qkvz) = (h.pw(), h.cd() + h.vd());
    let mut split: Vec<bf16> = (0..rows)
        .flat_map(|i| fused[i * pw..i * pw + qkvz].iter().copied())
        .collect();
    split.extend((0..rows).flat_map(|i| fused[i * pw + qkvz..(i + 1) * pw].iter().copied()));
    [
        Proj {
            ptr: r.put(fused),
            stride: pw as u32,
            ba_offset: qkvz as u32,
            ba_stride: pw as u32,
        },
        Proj {
            ptr: r.put(&split),
            stride: qkvz as u32,
            ba_offset: (rows * qkvz) as u32,
            ba_stride: 2 * h.hv as u32,
        },
    ]
}

fn bits16(v: &[bf16]) -> Vec<u16> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn bits32(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// The outputs of every projection-reading kernel over one layout: the conv, the updated
/// windows, a verify step's windows, q̂/k̂ and the gates, and the gated norm.
#[derive(Debug, PartialEq)]
struct Outputs {
    conv: Vec<u16>,
    update: Vec<u32>,
    verify: Vec<u32>,
    qk: Vec<u32>,
    gates: Vec<u32>,
    normed: Vec<u16>,
}

#[test]
fn every_kernel_reads_the_split_projection_as_the_fused_one() {
    let r = Rig::new();
    let mut d = Rng::new(61);
    let h = H {
        hk: 2,
        dk: 4,
        hv: 4,
        dv: 3,
    };
    let (cd, vd, kd, taps) = (h.cd(), h.vd(), h.kd(), 4usize);
    let hist = taps - 1;
    // A decode row, a prefill longer than the window, a short one, padding.
    let lens = [1usize, 5, 2, 3];
    let slots = [3u32, 0, 5, NO_SLOT];
    let row_slot = [
        6u32, 7, 8, NO_SLOT, NO_SLOT, 0, 9, 10, NO_SLOT, NO_SLOT, NO_SLOT,
    ];
    let (num_slots, stride) = (12usize, hist * cd + 5);
    let (start, row_seq) = layout(&lens);
    let rows = row_seq.len();
    let fused = d.bf16s(rows * h.pw(), -3.0, 3.0);
    let state0 = d.f32s(num_slots * stride, -1.0, 1.0);
    let w = d.bf16s(cd * taps, -0.8, 0.8);
    let conv_in = d.bf16s(rows * cd, -2.0, 2.0);
    let core = d.f32s(rows * vd, -2.0, 2.0);
    let norm_w = d.bf16s(h.dv, -1.5, 1.5);
    let (a_log, dt_bias) = (d.f32s(h.hv, -1.5, 1.5), d.f32s(h.hv, -2.0, 2.0));
    let (hk, dk, hv, dv) = h.u32s();
    let (wp, rsp, ssp, slp, rlp) = (
        r.put(&w),
        r.put(&row_seq),
        r.put(&start),
        r.put(&slots),
        r.put(&row_slot),
    );
    let (cip, corep, nwp, alp, dtp) = (
        r.put(&conv_in),
        r.put(&core),
        r.put(&norm_w),
        r.put(&a_log),
        r.put(&dt_bias),
    );
    let conv_params = |p: Proj| CausalConv1dParams {
        out: r.out(rows * cd * 2),
        proj: p.ptr,
        conv_state: r.put(&state0),
        weight: wp,
        row_seq: rsp,
        seq_start: ssp,
        seq_slot: slp,
        rows: rows as u32,
        num_seqs: lens.len() as u32,
        num_slots: num_slots as u32,
        slot_stride: stride as u32,
        hk,
        dk,
        hv,
        dv,
        kernel_size: taps as u32,
        proj_stride: p.stride,
    };
    let update_params = |p: Proj| state_update_of(&conv_params(p));
    let prepare_params = |p: Proj| GdnPrepareParams {
        qk: r.out(rows * 2 * kd * 4),
        gates: r.out(rows * 2 * h.hv * 4),
        conv: cip,
        proj: p.ptr,
        a_log: alp,
        dt_bias: dtp,
        rows: rows as u32,
        hk,
        dk,
        hv,
        dv,
        l2_eps: 1e-6,
        q_scale: 0.5,
        ba_offset: p.ba_offset,
        ba_stride: p.ba_stride,
    };
    let norm_params = |p: Proj| GatedRmsNormParams {
        out: r.out(rows * vd * 2),
        core: corep,
        proj: p.ptr,
        weight: nwp,
        rows: rows as u32,
        hk,
        dk,
        hv,
        dv,
        eps: 1e-6,
        proj_stride: p.stride,
    };
    let run = |p: Proj| -> Outputs {
        let conv = conv_params(p);
        r.run("gdn", "causal_conv1d", &conv).unwrap();
        let update = update_params(p);
        r.run("gdn", "conv_state_update", &update).unwrap();
        let u = update_params(p);
        let verify = ConvStateVerifyParams {
            conv_state: u.conv_state,
            proj: u.proj,
            seq_start: u.seq_start,
            seq_slot: u.seq_slot,
            row_slot: rlp,
            rows: u.rows,
            num_seqs: u.num_seqs,
            num_slots: u.num_slots,
            slot_stride: u.slot_stride,
            hk,
            dk,
            hv,
            dv,
            kernel_size: u.kernel_size,
            proj_stride: u.proj_stride,
        };
        r.run("gdn", "conv_state_verify", &verify).unwrap();
        let prepare = prepare_params(p);
        r.run("gdn", "gdn_prepare", &prepare).unwrap();
        let norm = norm_params(p);
        r.run("gdn", "gated_rms_norm", &norm).unwrap();
        Outputs {
            conv: bits16(&r.bf(conv.out, rows * cd)),
            update: bits32(&r.f32s(update.conv_state, num_slots * stride)),
            verify: bits32(&r.f32s(verify.conv_state, num_slots * stride)),
            qk: bits32(&r.f32s(prepare.qk, rows * 2 * kd)),
            gates: bits32(&r.f32s(prepare.gates, rows * 2 * h.hv)),
            normed: bits16(&r.bf(norm.out, rows * vd)),
        }
    };
    let [fused_at, split_at] = layouts(&r, &h, &fused, rows);
    let (want, got) = (run(fused_at), run(split_at));
    // The outputs were written (no poison left) and the states moved.
    assert!(want.gates.iter().all(|&g| f32::from_bits(g).is_finite()));
    assert!(want.normed.iter().all(|&x| bf16::from_bits(x).is_finite()));
    assert!(want.conv.iter().all(|&x| bf16::from_bits(x).is_finite()));
    assert_ne!(want.update, bits32(&state0));
    assert_ne!(want.verify, bits32(&state0));
    assert_eq!(
        got, want,
        "the split projection is read otherwise than the fused one"
    );

    // The fused layout's b|a offset on the split buffer reads other values: the gates see it.
    let misplaced = Proj {
        ba_offset: fused_at.ba_offset,
        ba_stride: fused_at.ba_stride,
        ..split_at
    };
    let prepare = prepare_params(misplaced);
    r.run("gdn", "gdn_prepare", &prepare).unwrap();
    assert_ne!(bits32(&r.f32s(prepare.gates, rows * 2 * h.hv)), want.gates);

    // A stride shorter than what a row reads there is refused.
    let short = |by: u32| Proj {
        stride: split_at.stride - by,
        ..split_at
    };
    let short_ba = Proj {
        ba_stride: split_at.ba_stride - 1,
        ..split_at
    };
    // The conv kernels read conv_dim of each row: a stride of conv_dim still holds them.
    assert!(
        r.run("gdn", "causal_conv1d", &conv_params(short(vd as u32)))
            .is_ok()
    );
    assert!(
        r.run("gdn", "causal_conv1d", &conv_params(short(vd as u32 + 1)))
            .is_err()
    );
    assert!(
        r.run(
            "gdn",
            "conv_state_update",
            &update_params(short(vd as u32 + 1))
        )
        .is_err()
    );
    assert!(
        r.run("gdn", "gdn_prepare", &prepare_params(short_ba))
            .is_err()
    );
    assert!(
        r.run("gdn", "gated_rms_norm", &norm_params(short(1)))
            .is_err()
    );
}
