//! The delta rule's kernels (`gated_delta_recurrent`, `gated_delta_streamed`,
//! `gated_delta_chunked`), part of `hybrid.rs`: CUDA against the CPU twin on steps that mix sequence lengths across
//! the 64-row chunks, padding sequences and sequences without rows, over head shapes of the fast
//! and the general path; and on CUDA alone, bitwise, one-row chunks against the recurrent step,
//! sequences independent of each other, and a chunked prefill against one-row recurrent steps.

use super::*;

/// One delta-rule problem: a step's sequences, their per-row inputs, the state pool and the
/// output, on both sides.
pub(crate) struct RuleCase {
    pub(crate) h: GdnHeads,
    pub(crate) seqs: StepSeqs,
    pub(crate) sq: SeqBufs,
    pub(crate) qk: Buf,
    pub(crate) conv: Buf,
    pub(crate) gates: Buf,
    pub(crate) out: Buf,
    pub(crate) state: Buf,
    pub(crate) state0: Vec<f32>,
    pub(crate) stride: u32,
    pub(crate) slots: u32,
}

impl RuleCase {
    /// Realistic inputs: unit-norm k̂, q̂ of norm `1/√Dk`, β in (0, 1), g < 0 (decays from
    /// e^-1.5 to nearly 1), v and the initial states of order one.
    pub(crate) fn new(p: &Pair, rng: &mut Rng, h: GdnHeads, seqs: StepSeqs) -> RuleCase {
        RuleCase::with_slots(p, rng, h, seqs, NUM_SLOTS)
    }

    /// `new` with a pool of `slots` states.
    pub(crate) fn with_slots(
        p: &Pair,
        rng: &mut Rng,
        h: GdnHeads,
        seqs: StepSeqs,
        slots: u32,
    ) -> RuleCase {
        let rows = seqs.rows();
        let (kd, dk) = (h.key_dim() as usize, h.k_head_dim as usize);
        let mut qk = rng.f32s(rows as usize * 2 * kd, -1.0, 1.0);
        for head in qk.chunks_mut(dk) {
            let norm = head.iter().map(|x| x * x).sum::<f32>().sqrt();
            for x in head.iter_mut() {
                *x /= norm;
            }
        }
        for row in qk.chunks_mut(2 * kd) {
            for x in &mut row[..kd] {
                *x /= (dk as f32).sqrt();
            }
        }
        let hv = h.num_v_heads as usize;
        let mut gates = Vec::with_capacity(rows as usize * 2 * hv);
        for _ in 0..rows {
            gates.extend((0..hv).map(|_| rng.uniform(0.05, 0.95)));
            gates.extend((0..hv).map(|_| rng.uniform(-1.5, -0.005)));
        }
        // A slot stride past one slot's state (and a multiple of 4, which the fast path needs).
        let stride = h.num_v_heads * h.k_head_dim * h.v_head_dim + 8;
        let state0 = rng.f32s((slots * stride) as usize, -1.0, 1.0);
        RuleCase {
            h,
            sq: seqs.upload(p),
            seqs,
            qk: p.upload(&qk),
            conv: p.upload(&rng.bf16s((rows * h.conv_dim()) as usize, -1.0, 1.0)),
            gates: p.upload(&gates),
            out: p.poisoned((rows * h.value_dim()) as usize * 4),
            state: p.upload(&state0),
            state0,
            stride,
            slots,
        }
    }

    pub(crate) fn params(&self, at: At<'_>) -> GatedDelta {
        GatedDelta {
            out: at(&self.out),
            state: StatePool {
                base: at(&self.state),
                num_slots: self.slots,
                slot_stride: self.stride,
            },
            qk: at(&self.qk),
            conv: at(&self.conv),
            gates: at(&self.gates),
            seqs: self.sq.at(at),
            heads: self.h,
        }
    }

    /// CUDA parameters for sequences `seqs` whose rows start at row `first` of this case's
    /// per-row buffers (outputs, q/k, conv, gates).
    pub(crate) fn params_from(&self, at: At<'_>, seqs: &SeqBufs, first: u32) -> GatedDelta {
        let h = &self.h;
        let row = |b: &Buf, bytes_per_row: u32| b.gpu.offset((first * bytes_per_row) as usize);
        GatedDelta {
            seqs: seqs.at(at),
            out: row(&self.out, 4 * h.value_dim()),
            qk: row(&self.qk, 8 * h.key_dim()),
            conv: row(&self.conv, 2 * h.conv_dim()),
            gates: row(&self.gates, 8 * h.num_v_heads),
            ..self.params(at)
        }
    }

    /// Initial states back, outputs poisoned, on both sides.
    pub(crate) fn reset(&self, p: &Pair) {
        reset(p, &self.state, &self.state0);
        poison(p, &self.out);
    }

    /// Run `which` on both sides from the initial state and compare outputs and states.
    fn check(&self, p: &Pair, which: Rule, case: &str) {
        self.reset(p);
        p.run(|o, at| which.launch(o, &self.params(at)));
        let name = which.name();
        p.check_f32(&format!("{name}.out"), case, &self.out, F32_RULE);
        p.check_f32(&format!("{name}.state"), case, &self.state, F32_RULE);
        self.assert_untouched_slots(p, case);
    }

    /// Slots no real sequence of the step owns keep their bits (padding writes nothing, a
    /// sequence without rows writes nothing).
    fn assert_untouched_slots(&self, p: &Pair, case: &str) {
        let got = p.download_gpu::<f32>(&self.state);
        for slot in 0..self.slots {
            let written = self.seqs.0.iter().any(|&(n, s, _)| s == slot && n > 0);
            if !written {
                let at = (slot * self.stride) as usize..((slot + 1) * self.stride) as usize;
                assert!(
                    got[at.clone()] == self.state0[at],
                    "{case}: slot {slot} belongs to no sequence with rows, yet changed"
                );
            }
        }
    }
}

/// Which rule kernel to launch.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Rule {
    /// `gated_delta_recurrent` (the decode launcher forced to its block kernel).
    Recurrent,
    /// `gated_delta_streamed` (the decode launcher forced to its streamed kernel).
    Streamed,
    Chunked,
}

impl Rule {
    fn name(self) -> &'static str {
        match self {
            Rule::Recurrent => "gated_delta_recurrent",
            Rule::Streamed => "gated_delta_streamed",
            Rule::Chunked => "gated_delta_chunked",
        }
    }

    fn launch(
        self,
        o: &metrale_model_layers::Ops,
        g: &GatedDelta,
    ) -> metrale_gpu_runtime::GpuResult<()> {
        match self {
            Rule::Recurrent => o.gated_delta_recurrent_as(S, g, DecodeRule::Blocks),
            Rule::Streamed => o.gated_delta_recurrent_as(S, g, DecodeRule::Streamed),
            Rule::Chunked => o.gated_delta_chunked(S, g, CHUNK),
        }
    }
}

/// Both decode kernels against the CPU twin, and against each other bitwise on CUDA, on every
/// head shape (the streamed kernel's own path where the shape takes it, its fallback elsewhere).
/// The decode kernels and the chunked one at the sanitizer's sizes.
pub(super) fn small(p: &Pair, rng: &mut Rng, shapes: &[(GdnHeads, &str)]) {
    let steps = [(StepSeqs::decode(), "decode"), (StepSeqs::short(), "short")];
    recurrent(p, rng, shapes, &steps);
    chunked(p, rng, shapes, &steps[1..]);
}

#[test]
fn gated_delta_recurrent_matches_on_decode_and_multi_row_steps() {
    let steps = [(StepSeqs::decode(), "decode"), (StepSeqs::mixed(), "mixed")];
    recurrent(&Pair::new(), &mut Rng::new(104), &gdn_shapes(), &steps);
}

/// Both decode kernels on every head shape and step.
fn recurrent(p: &Pair, rng: &mut Rng, shapes: &[(GdnHeads, &str)], steps: &[(StepSeqs, &str)]) {
    for &(h, what) in shapes {
        for (seqs, step) in steps {
            let c = RuleCase::new(p, rng, h, seqs.clone());
            let case = label(&h, &format!("{step} ({what})"));
            c.check(p, Rule::Recurrent, &case);
            check_streamed(p, &c, &case);
        }
    }
}

/// The streamed kernel against the CPU twin, and bitwise against the recurrent kernel on CUDA.
fn check_streamed(p: &Pair, c: &RuleCase, case: &str) {
    c.check(p, Rule::Streamed, case);
    assert!(
        cuda_rule(p, c, Rule::Streamed) == cuda_rule(p, c, Rule::Recurrent),
        "{case}: the streamed and the recurrent kernel differ"
    );
}

/// The streamed kernel's blocks loop over many items (a state buffer refilled again and again,
/// its barrier through many phases): a decode step of 72 sequences (and a padding one) of
/// Qwen3.5-9B's heads, 2336 items, against the CPU twin and bitwise against the recurrent
/// kernel.
#[test]
fn gated_delta_streamed_loops_over_many_items() {
    let p = Pair::new();
    let mut rng = Rng::new(108);
    let h = heads(16, 128, 32, 128);
    let mut seqs: Vec<(u32, u32, u32)> = (0..72).map(|s| (1, (s * 5) % 72, s)).collect();
    seqs.insert(40, (1, NO_SLOT, 0));
    let c = RuleCase::with_slots(&p, &mut rng, h, StepSeqs(seqs), 72);
    check_streamed(&p, &c, &label(&h, "72 sequences and a padding one"));
}

#[test]
fn gated_delta_chunked_matches_across_chunk_boundaries() {
    let steps = [
        (StepSeqs::mixed(), "mixed"),
        (StepSeqs::decode(), "one-row chunks"),
    ];
    chunked(&Pair::new(), &mut Rng::new(105), &gdn_shapes(), &steps);
}

/// The chunked kernel on every head shape and step, against the CPU and run to run.
fn chunked(p: &Pair, rng: &mut Rng, shapes: &[(GdnHeads, &str)], steps: &[(StepSeqs, &str)]) {
    for &(h, what) in shapes {
        for (seqs, step) in steps {
            let c = RuleCase::new(p, rng, h, seqs.clone());
            let case = label(&h, &format!("{step} ({what})"));
            c.check(p, Rule::Chunked, &case);
            // Run to run, bitwise.
            let (out, state) = (
                p.download_gpu::<u32>(&c.out),
                p.download_gpu::<u32>(&c.state),
            );
            c.reset(p);
            p.run_gpu(|o, at| o.gated_delta_chunked(S, &c.params(at), CHUNK));
            assert!(
                out == p.download_gpu::<u32>(&c.out) && state == p.download_gpu::<u32>(&c.state),
                "gated_delta_chunked {case}: a second run differs"
            );
        }
    }
}

/// `(out, state)` of one launch of `which` on CUDA from the case's initial state.
fn cuda_rule(p: &Pair, c: &RuleCase, which: Rule) -> (Vec<u32>, Vec<u32>) {
    c.reset(p);
    p.run_gpu(|o, at| which.launch(o, &c.params(at)));
    (
        p.download_gpu::<u32>(&c.out),
        p.download_gpu::<u32>(&c.state),
    )
}

#[test]
fn one_row_chunks_are_the_recurrent_step_bitwise_and_sequences_do_not_see_each_other() {
    let p = Pair::new();
    let mut rng = Rng::new(106);
    for (h, what) in gdn_shapes() {
        let case = label(&h, what);
        // A decode step through either kernel: the same bits.
        let c = RuleCase::new(&p, &mut rng, h, StepSeqs::decode());
        assert!(
            cuda_rule(&p, &c, Rule::Chunked) == cuda_rule(&p, &c, Rule::Recurrent),
            "{case}: a decode step differs between the chunked and the recurrent kernel"
        );
        // Each sequence of a mixed step, launched alone from the same inputs and state, gives
        // the same bits as inside the step.
        let c = RuleCase::new(&p, &mut rng, h, StepSeqs::mixed());
        let (out, state) = cuda_rule(&p, &c, Rule::Chunked);
        let (vd, per_slot) = (h.value_dim() as usize, c.stride as usize);
        let mut first = 0u32;
        for (s, &(n, slot, pos0)) in c.seqs.0.iter().enumerate() {
            let alone = StepSeqs(vec![(n, slot, pos0)]);
            if n > 0 {
                let sq = alone.upload(&p);
                c.reset(&p);
                p.run_gpu(|o, at| o.gated_delta_chunked(S, &c.params_from(at, &sq, first), CHUNK));
                let (o2, s2) = (
                    p.download_gpu::<u32>(&c.out),
                    p.download_gpu::<u32>(&c.state),
                );
                let rows = first as usize * vd..(first + n) as usize * vd;
                assert!(
                    o2[rows.clone()] == out[rows],
                    "{case}: sequence {s} alone gives other outputs than inside the step"
                );
                if slot != NO_SLOT {
                    let at = slot as usize * per_slot..(slot as usize + 1) * per_slot;
                    assert!(
                        s2[at.clone()] == state[at],
                        "{case}: sequence {s} alone leaves another state than inside the step"
                    );
                }
            }
            first += n;
        }
        println!(
            "kernel-check {:<18} {:<44} bitwise: one-row chunk = recurrent step; alone = in a step ok",
            "gated_delta(inv)", case
        );
    }
}

#[test]
fn chunked_prefill_equals_single_row_recurrent_steps_on_cuda() {
    let p = Pair::new();
    let mut rng = Rng::new(107);
    for (h, what) in gdn_shapes() {
        for (n, pos0) in [(130u32, 0u32), (65, 10), (64, 64), (63, 1)] {
            let case = label(&h, &format!("{n} rows from {pos0} ({what})"));
            let c = RuleCase::new(&p, &mut rng, h, StepSeqs(vec![(n, 2, pos0)]));
            let (out, state) = cuda_rule(&p, &c, Rule::Chunked);
            // The same rows as n launches of one row each, the state carried between them.
            c.reset(&p);
            let one = StepSeqs(vec![(1, 2, 0)]).upload(&p);
            for r in 0..n {
                p.run_gpu(|o, at| o.gated_delta_recurrent(S, &c.params_from(at, &one, r)));
            }
            let (steps_out, steps_state) = (
                p.download_gpu::<u32>(&c.out),
                p.download_gpu::<u32>(&c.state),
            );
            let f = |v: &[u32]| v.iter().map(|&b| f32::from_bits(b)).collect::<Vec<_>>();
            let bitwise = out == steps_out && state == steps_state;
            compare(
                "chunked=steps.out",
                &case,
                &f(&out),
                &f(&steps_out),
                F32_RULE,
            );
            compare(
                "chunked=steps.state",
                &case,
                &f(&state),
                &f(&steps_state),
                F32_RULE,
            );
            println!(
                "kernel-check {:<18} {:<44} bitwise={bitwise}",
                "chunked=steps", case
            );
        }
    }
}

// ------------------------------------------------------------------------------------------------
// MoE.
