//! The layer with its b and a rows a weight of their own (an FP8 layer's split input
//! projection) against the fused layer.

use super::*;

#[test]
fn a_layer_with_its_b_and_a_rows_apart_computes_the_fused_layers_bits() {
    let mut d = Rng::new(137);
    let (n, k) = (70usize, 3usize);
    let x = d.bf16s((n + 2 * k) * HIDDEN, -1.0, 1.0);
    let other = d.bf16s(5 * HIDDEN, -1.0, 1.0);
    let (fused, split) = (
        Harness::with_layout(139, false),
        Harness::with_layout(139, true),
    );
    assert!(fused.layer.in_proj_ba.is_none() && split.layer.in_proj_ba.is_some());
    let mut outs = [Vec::new(), Vec::new()];
    for (hs, out) in [&fused, &split].into_iter().zip(&mut outs) {
        // A two-sequence prefill (the chunked rule), decode steps of two sequences, and a
        // verify step keeping each row's state.
        out.extend(hs.step(&[
            SeqRows {
                slot: 0,
                pos0: 0,
                x: &x[..n * HIDDEN],
            },
            SeqRows {
                slot: 1,
                pos0: 0,
                x: &other,
            },
        ]));
        for t in n..n + k {
            out.extend(hs.step(&[
                SeqRows {
                    slot: 1,
                    pos0: 5 + (t - n) as u32,
                    x: &x[t * HIDDEN..(t + 1) * HIDDEN],
                },
                SeqRows {
                    slot: 0,
                    pos0: t as u32,
                    x: &x[t * HIDDEN..(t + 1) * HIDDEN],
                },
            ]));
        }
        out.extend(hs.run(
            &[SeqRows {
                slot: 0,
                pos0: (n + k) as u32,
                x: &x[(n + k) * HIDDEN..],
            }],
            Some(&[4, 5, 0]),
        ));
    }
    assert_eq!(outs[0].len(), (n + 5 + 2 * k + k) * HIDDEN);
    assert_eq!(
        bits16(&outs[0]),
        bits16(&outs[1]),
        "the layer's outputs depend on where its b and a rows are"
    );
    for slot in [0, 1, 4, 5] {
        let ((cf, rf), (cs, rs)) = (fused.state(slot), split.state(slot));
        assert_eq!(bits32(&cf), bits32(&cs), "conv window of slot {slot}");
        assert_eq!(bits32(&rf), bits32(&rs), "recurrent state of slot {slot}");
        assert!(rf.iter().any(|&v| v != 0.0), "slot {slot}'s state moved");
    }
}
