//! The device sampler (`sampling::sample`) against its CPU twin: rows of every kind in one
//! launch (plain and transformed greedy rows, penalties, bias, bans, masks, sampled rows under
//! top-k, top-p and min-p, top-20 logprobs), outputs poisoned first. Tokens and top ids must
//! match exactly (both sides compute every decision with the same rounded operations);
//! logprobs within 1e-4 (the log-sum-exp is a float sum in a different order). A row's result
//! alone equals its result in the batch. Also the budget figure: 32 rows of 151,936 with top-20
//! logprobs and every penalty.

use std::time::Instant;

use metrale_gpu_runtime::GpuResult;
use metrale_kernel_abi::{
    SAMPLE_E_BAN, SAMPLE_E_PROMPT, SAMPLE_F_GREEDY, SAMPLE_F_MASK, SAMPLE_OUT_WORDS,
    SAMPLE_R_COUNTER, SAMPLE_R_ENTRY_COUNT, SAMPLE_R_ENTRY_START, SAMPLE_R_FLAGS,
    SAMPLE_R_FREQUENCY, SAMPLE_R_MIN_P, SAMPLE_R_NUM_TOP, SAMPLE_R_PRESENCE, SAMPLE_R_REPETITION,
    SAMPLE_R_SEED_HI, SAMPLE_R_SEED_LO, SAMPLE_R_TEMPERATURE, SAMPLE_R_TOP_K, SAMPLE_R_TOP_P,
    SAMPLE_ROW_WORDS, SAMPLE_TOP_MAX,
};
use metrale_model_layers::Ops;
use metrale_model_layers::ops::{Matrix, SampleOperands};

use super::harness::{At, Buf, Pair, Rng, S};

/// Every check below at small shapes (the sanitizer set).
pub(super) fn small(p: &Pair) {
    let rng = &mut Rng::new(2001);
    sample(p, rng, 1003, 6, false, false);
}

#[test]
fn sample_matches_its_twin_on_every_kind_of_row() {
    let rng = &mut Rng::new(2002);
    let p = Pair::new();
    sample(&p, rng, 151_936, 32, true, false);
    sample(&p, rng, 1001, 9, false, false);
    // Whole-number logits: many ties at every threshold, so the top logprobs take the lowest
    // indices of a tie and top-k / top-p keep whole tied groups.
    sample(&p, rng, 4099, 12, false, true);
    // Qwen3.5's vocabulary: a block's slice of keys does not fit beside the entry bitmap, so
    // every pass computes them again.
    sample(&p, rng, 248_320, 6, false, false);
}

#[test]
fn sample_rows_do_not_depend_on_their_batch_mates() {
    let rng = &mut Rng::new(2003);
    let p = Pair::new();
    let (vocab, rows) = (151_936usize, 12usize);
    let logits = rng.f32s(rows * vocab, -15.0, 15.0);
    let (rowp, entries) = rows_of(rng, rows, vocab, false);
    let all = launch(&p, &logits, vocab, &rowp, &entries, None);
    for r in [0, 5, rows - 1] {
        let w = SAMPLE_ROW_WORDS as usize;
        let one = launch(
            &p,
            &logits[r * vocab..(r + 1) * vocab],
            vocab,
            &rowp[r * w..(r + 1) * w],
            &entries,
            None,
        );
        let o = SAMPLE_OUT_WORDS as usize;
        assert_eq!(
            one.0,
            all.0[r * o..(r + 1) * o],
            "row {r} alone vs in the batch"
        );
    }
}

/// Random parameters for `rows` rows: a mix of greedy and sampled rows, with and without
/// penalties, bias, bans and a mask (`masked`: every fourth row has one).
fn rows_of(rng: &mut Rng, rows: usize, vocab: usize, masked: bool) -> (Vec<u32>, Vec<u32>) {
    let (mut rowp, mut entries) = (Vec::new(), Vec::<u32>::new());
    for r in 0..rows {
        let mut w = [0u32; SAMPLE_ROW_WORDS as usize];
        let mut set = |i: u32, v: u32| w[i as usize] = v;
        let greedy = r % 3 == 0;
        let mut flags = if greedy { SAMPLE_F_GREEDY } else { 0 };
        if masked && r % 4 == 1 {
            flags |= SAMPLE_F_MASK;
        }
        set(SAMPLE_R_FLAGS, flags);
        set(SAMPLE_R_TEMPERATURE, rng.uniform(0.3, 1.5).to_bits());
        set(SAMPLE_R_TOP_K, [0, 1, 5, 50, 1000][r % 5]);
        set(SAMPLE_R_TOP_P, [1.0f32, 0.9, 0.5, 0.95][r % 4].to_bits());
        set(SAMPLE_R_MIN_P, [0.0f32, 0.05, 0.0][r % 3].to_bits());
        set(SAMPLE_R_REPETITION, [1.0f32, 1.3, 0.8][r % 3].to_bits());
        set(SAMPLE_R_PRESENCE, rng.uniform(-1.0, 1.5).to_bits());
        set(SAMPLE_R_FREQUENCY, rng.uniform(-0.5, 1.0).to_bits());
        set(SAMPLE_R_NUM_TOP, [20, 0, 5, 1][r % 4]);
        set(SAMPLE_R_SEED_LO, rng.next_u64() as u32);
        set(SAMPLE_R_SEED_HI, rng.next_u64() as u32);
        set(SAMPLE_R_COUNTER, rng.below(5000));
        // Entries: a random sorted set of tokens, some in the prompt, some counted, a few
        // biased or banned (rows 0 mod 7 have none).
        let n = if r % 7 == 0 { 0 } else { rng.usize_in(1..=400) };
        let mut toks: Vec<u32> = (0..n).map(|_| rng.below(vocab as u32)).collect();
        toks.sort_unstable();
        toks.dedup();
        set(SAMPLE_R_ENTRY_START, (entries.len() / 3) as u32);
        set(SAMPLE_R_ENTRY_COUNT, toks.len() as u32);
        for t in toks {
            let mut c = rng.below(4);
            if rng.chance(0.5) {
                c |= SAMPLE_E_PROMPT;
            }
            if rng.chance(0.02) {
                c |= SAMPLE_E_BAN;
            }
            let b = if rng.chance(0.1) {
                rng.uniform(-20.0, 20.0)
            } else {
                0.0
            };
            entries.extend([t, c, b.to_bits()]);
        }
        rowp.extend_from_slice(&w);
    }
    (rowp, entries)
}

/// A launch's inputs on both sides of a `Pair`, and its poisoned output.
struct Launch {
    logits: Buf,
    rowp: Buf,
    entries: Buf,
    num_entries: u32,
    mask: Option<Buf>,
    out: Buf,
    rows: u32,
    vocab: u32,
}

impl Launch {
    fn upload(
        p: &Pair,
        logits: &[f32],
        vocab: usize,
        rowp: &[u32],
        entries: &[u32],
        mask: Option<&[u32]>,
    ) -> Launch {
        let rows = rowp.len() / SAMPLE_ROW_WORDS as usize;
        Launch {
            logits: p.upload(logits),
            rowp: p.upload(rowp),
            entries: p.upload(if entries.is_empty() {
                &[0u32; 3]
            } else {
                entries
            }),
            num_entries: (entries.len() / 3) as u32,
            mask: mask.map(|m| p.upload(m)),
            out: p.poisoned(rows * SAMPLE_OUT_WORDS as usize * 4),
            rows: rows as u32,
            vocab: vocab as u32,
        }
    }

    /// `sample` on the side `at` addresses.
    fn sample(&self, o: &Ops, at: At<'_>) -> GpuResult<()> {
        let op = SampleOperands {
            out: at(&self.out),
            rowp: at(&self.rowp),
            entries: at(&self.entries),
            num_entries: self.num_entries,
            mask: self.mask.as_ref().map(|m| (at(m), self.vocab.div_ceil(32))),
        };
        o.sample(S, Matrix::f32(at(&self.logits), self.rows, self.vocab), &op)
    }
}

/// Launch on both sides; `(cuda, cpu)` output words.
fn launch(
    p: &Pair,
    logits: &[f32],
    vocab: usize,
    rowp: &[u32],
    entries: &[u32],
    mask: Option<&[u32]>,
) -> (Vec<u32>, Vec<u32>) {
    let l = Launch::upload(p, logits, vocab, rowp, entries, mask);
    p.run(|o, at| l.sample(o, at));
    p.download::<u32>(&l.out)
}

fn sample(p: &Pair, rng: &mut Rng, vocab: usize, rows: usize, timed: bool, ties: bool) {
    let mut logits = rng.f32s(rows * vocab, -15.0, 15.0);
    if ties {
        logits.iter_mut().for_each(|v| *v = v.round());
    }
    // A tie at the top of row 0 and NaNs in row 1: the lower index wins, NaN never does.
    logits[17] = 40.0;
    logits[vocab / 2] = 40.0;
    logits[vocab + 3] = f32::NAN;
    let (rowp, entries) = rows_of(rng, rows, vocab, true);
    let words = vocab.div_ceil(32);
    let mask: Vec<u32> = (0..rows * words).map(|_| rng.next_u64() as u32).collect();
    let (g, c) = launch(p, &logits, vocab, &rowp, &entries, Some(&mask));
    let (o, top) = (SAMPLE_OUT_WORDS as usize, SAMPLE_TOP_MAX as usize);
    let mut worst = 0.0f32;
    for r in 0..rows {
        let (gr, cr) = (&g[r * o..(r + 1) * o], &c[r * o..(r + 1) * o]);
        let case = format!("vocab={vocab} row={r}");
        assert_eq!(gr[0], cr[0], "token, {case}");
        assert!((gr[0] as usize) < vocab, "token in the vocabulary, {case}");
        assert_eq!(gr[2..2 + top], cr[2..2 + top], "top ids, {case}");
        for j in std::iter::once(1).chain(2 + top..o) {
            let (a, b) = (f32::from_bits(gr[j]), f32::from_bits(cr[j]));
            if a.is_nan() && b.is_nan() {
                continue;
            }
            let d = (a - b).abs();
            assert!(d <= 1e-4 || a == b, "logprob word {j}: {a} vs {b}, {case}");
            if d.is_finite() {
                worst = worst.max(d);
            }
        }
    }
    assert_eq!(c[0], 17, "the tie goes to the lower index");
    println!(
        "kernel-check {:<18} {:<44} tokens exact, logprobs within {worst:.1e} ok",
        "sample",
        format!("vocab={vocab} rows={rows} ties={ties}")
    );
    if timed {
        let w = SAMPLE_ROW_WORDS as usize;
        let set = |rowp: &mut [u32], word: u32, v: u32| {
            for r in 0..rows {
                rowp[r * w + word as usize] = v;
            }
        };
        // The budget case: every row with top-20 logprobs and penalties (the mix above otherwise).
        let mut all = rowp.clone();
        set(&mut all, SAMPLE_R_NUM_TOP, 20);
        // Its parts: greedy rows alone; greedy rows with top-20 logprobs and penalties; sampled
        // rows under Qwen's recommended settings (top-k 20, top-p 0.95), no entries or logprobs.
        let mut greedy = rowp.clone();
        set(&mut greedy, SAMPLE_R_FLAGS, SAMPLE_F_GREEDY);
        set(&mut greedy, SAMPLE_R_ENTRY_COUNT, 0);
        set(&mut greedy, SAMPLE_R_NUM_TOP, 0);
        let mut logprobs = all.clone();
        set(&mut logprobs, SAMPLE_R_FLAGS, SAMPLE_F_GREEDY);
        let mut sampled = greedy.clone();
        set(&mut sampled, SAMPLE_R_FLAGS, 0);
        set(&mut sampled, SAMPLE_R_TOP_K, 20);
        set(&mut sampled, SAMPLE_R_TOP_P, 0.95f32.to_bits());
        for (what, rowp) in [
            ("top20+penalties", &all),
            ("greedy", &greedy),
            ("greedy+top20+penalties", &logprobs),
            ("top-k+top-p", &sampled),
        ] {
            let t = time_sample(p, &logits, vocab, rowp, &entries, &mask);
            println!(
                "kernel-time sample rows={rows} vocab={vocab} {what}: median {t:.1} us \
                 (launch and synchronize included; budget 300 us)"
            );
        }
    }
}

/// The median time of `sample` over the rows, launch and synchronize included, us.
fn time_sample(
    p: &Pair,
    logits: &[f32],
    vocab: usize,
    rowp: &[u32],
    entries: &[u32],
    mask: &[u32],
) -> f64 {
    let l = Launch::upload(p, logits, vocab, rowp, entries, Some(mask));
    let go = || p.run_gpu(|o, at| l.sample(o, at));
    for _ in 0..5 {
        go();
    }
    let mut t: Vec<f64> = (0..50)
        .map(|_| {
            let start = Instant::now();
            go();
            start.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}
