//! The sampler's twin (`sampling::sample`) against direct definitions: greedy rows are `argmax`
//! of the transformed logits, logprobs the log_softmax of the raw logits (f64 reference), the
//! penalties, bias, bans and mask move the token as transformers and vLLM define them, draws
//! follow the softmax and reproduce from (seed, counter), and top-k / top-p / min-p restrict
//! them; bad rows fail the launch.

use metrale_kernel_abi::{
    SAMPLE_E_BAN, SAMPLE_E_PROMPT, SAMPLE_F_GREEDY, SAMPLE_F_MASK, SAMPLE_OUT_WORDS,
    SAMPLE_R_COUNTER, SAMPLE_R_ENTRY_COUNT, SAMPLE_R_ENTRY_START, SAMPLE_R_FLAGS,
    SAMPLE_R_FREQUENCY, SAMPLE_R_MIN_P, SAMPLE_R_NUM_TOP, SAMPLE_R_PRESENCE, SAMPLE_R_REPETITION,
    SAMPLE_R_SEED_HI, SAMPLE_R_SEED_LO, SAMPLE_R_TEMPERATURE, SAMPLE_R_TOP_K, SAMPLE_R_TOP_P,
    SAMPLE_ROW_WORDS, SAMPLE_TOP_MAX, SampleParams,
};
use metrale_testkit::Rng;

use crate::backend::GpuBackendExt;
use crate::cpu::test_support::Rig;
use crate::types::{DevicePtr, LaunchConfig};

/// One row's parameters.
#[derive(Clone)]
struct Row {
    greedy: bool,
    temperature: f32,
    top_k: u32,
    top_p: f32,
    min_p: f32,
    rep: f32,
    presence: f32,
    frequency: f32,
    num_top: u32,
    seed: u64,
    counter: u32,
    mask: bool,
    /// `[token, count | flags, bias bits]`, sorted.
    entries: Vec<[u32; 3]>,
}

impl Row {
    fn greedy() -> Row {
        Row {
            greedy: true,
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            rep: 1.0,
            presence: 0.0,
            frequency: 0.0,
            num_top: 0,
            seed: 0,
            counter: 0,
            mask: false,
            entries: Vec::new(),
        }
    }
    fn sampled(temperature: f32, seed: u64, counter: u32) -> Row {
        Row {
            greedy: false,
            temperature,
            seed,
            counter,
            ..Row::greedy()
        }
    }
}

/// What a row got: token, its logprob, top ids and logprobs.
#[derive(Debug, PartialEq)]
struct Got {
    token: u32,
    logprob: f32,
    top: Vec<(u32, f32)>,
}

/// Run the twin over `logits` (`rows.len()` rows of `vocab`), with `mask` words per row.
fn run(
    logits: &[f32],
    vocab: usize,
    rows: &[Row],
    mask: Option<&[u32]>,
) -> Result<Vec<Got>, String> {
    let r = Rig::new();
    let (mut rowp, mut entries) = (Vec::new(), Vec::<u32>::new());
    for row in rows {
        let mut w = [0u32; SAMPLE_ROW_WORDS as usize];
        let mut set = |i: u32, v: u32| w[i as usize] = v;
        let flags = u32::from(row.greedy) * SAMPLE_F_GREEDY + u32::from(row.mask) * SAMPLE_F_MASK;
        set(SAMPLE_R_FLAGS, flags);
        set(SAMPLE_R_TEMPERATURE, row.temperature.to_bits());
        set(SAMPLE_R_TOP_K, row.top_k);
        set(SAMPLE_R_TOP_P, row.top_p.to_bits());
        set(SAMPLE_R_MIN_P, row.min_p.to_bits());
        set(SAMPLE_R_REPETITION, row.rep.to_bits());
        set(SAMPLE_R_PRESENCE, row.presence.to_bits());
        set(SAMPLE_R_FREQUENCY, row.frequency.to_bits());
        set(SAMPLE_R_NUM_TOP, row.num_top);
        set(SAMPLE_R_SEED_LO, row.seed as u32);
        set(SAMPLE_R_SEED_HI, (row.seed >> 32) as u32);
        set(SAMPLE_R_COUNTER, row.counter);
        set(SAMPLE_R_ENTRY_START, (entries.len() / 3) as u32);
        set(SAMPLE_R_ENTRY_COUNT, row.entries.len() as u32);
        rowp.extend_from_slice(&w);
        entries.extend(row.entries.iter().flatten());
    }
    let n = rows.len();
    let out = r.out(n * SAMPLE_OUT_WORDS as usize * 4);
    let words = vocab.div_ceil(32) as u32;
    let p = SampleParams {
        out,
        logits: r.put(logits),
        rowp: r.put(&rowp),
        entries: if entries.is_empty() {
            r.put(&[0u32; 3])
        } else {
            r.put(&entries)
        },
        mask: mask.map_or(DevicePtr::NULL, |m| r.put(m)),
        rows: n as u32,
        vocab: vocab as u32,
        num_entries: (entries.len() / 3) as u32,
        mask_words: if mask.is_some() { words } else { 0 },
    };
    let cfg = LaunchConfig::linear(n as u32, 1024).with_shared(words * 4);
    r.run_with("sampling", "sample", cfg, &p)
        .map_err(|e| e.to_string())?;
    let o = r
        .gpu
        .download::<u32>(out, n * SAMPLE_OUT_WORDS as usize, r.s)
        .expect("download");
    let top = SAMPLE_TOP_MAX as usize;
    Ok((o.chunks(SAMPLE_OUT_WORDS as usize).zip(rows))
        .map(|(o, row)| Got {
            token: o[0],
            logprob: f32::from_bits(o[1]),
            top: (0..row.num_top as usize)
                .map(|j| (o[2 + j], f32::from_bits(o[2 + top + j])))
                .collect(),
        })
        .collect())
}

/// log_softmax in f64.
fn log_softmax(x: &[f32]) -> Vec<f64> {
    let m = x.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b as f64));
    let s: f64 = x.iter().map(|&v| (v as f64 - m).exp()).sum();
    x.iter().map(|&v| v as f64 - m - s.ln()).collect()
}

fn first_max(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] || (x[best].is_nan() && !v.is_nan()) {
            best = i;
        }
    }
    best as u32
}

#[test]
fn greedy_rows_are_argmax_and_logprobs_are_the_raw_log_softmax() {
    let mut rng = Rng::new(71);
    let vocab = 3001;
    let logits = rng.f32s(3 * vocab, -12.0, 12.0);
    let mut rows = vec![Row::greedy(); 3];
    rows[0].num_top = 20;
    rows[1].num_top = 5;
    let got = run(&logits, vocab, &rows, None).unwrap();
    for (r, g) in got.iter().enumerate() {
        let x = &logits[r * vocab..(r + 1) * vocab];
        let lp = log_softmax(x);
        assert_eq!(g.token, first_max(x), "row {r}");
        assert!(
            (g.logprob as f64 - lp[g.token as usize]).abs() < 1e-5,
            "row {r}"
        );
        let mut order: Vec<usize> = (0..vocab).collect();
        order.sort_by(|&a, &b| x[b].total_cmp(&x[a]).then(a.cmp(&b)));
        assert_eq!(g.top.len(), rows[r].num_top as usize);
        for (j, &(id, l)) in g.top.iter().enumerate() {
            assert_eq!(id as usize, order[j], "row {r} rank {j}");
            assert!((l as f64 - lp[order[j]]).abs() < 1e-5, "row {r} rank {j}");
        }
    }
}

#[test]
fn penalties_bias_bans_and_the_mask_move_the_greedy_token() {
    // Token 2 leads; 5 is second, 7 third (negative logits elsewhere).
    let mut x = vec![-3.0f32; 10];
    (x[2], x[5], x[7], x[1]) = (4.0, 3.5, 3.0, -0.5);
    let entry = |t: u32, c: u32, b: f32| [t, c, b.to_bits()];
    let mut rows = Vec::new();
    // The repetition penalty divides the leader (in the prompt): 4 / 2 = 2 < 3.5.
    let mut r = Row::greedy();
    r.rep = 2.0;
    r.entries = vec![entry(2, SAMPLE_E_PROMPT, 0.0)];
    rows.push(r);
    // Frequency (count 2 x 0.2) and presence (0.3) on the leader: 4 - 0.4 - 0.3 = 3.3 < 3.5.
    let mut r = Row::greedy();
    (r.frequency, r.presence) = (0.2, 0.3);
    r.entries = vec![entry(2, 2, 0.0)];
    rows.push(r);
    // A bias lifts token 1: -0.5 + 5 = 4.5.
    let mut r = Row::greedy();
    r.entries = vec![entry(1, 0, 5.0)];
    rows.push(r);
    // Banning 2 and 5 leaves 7.
    let mut r = Row::greedy();
    r.entries = vec![entry(2, SAMPLE_E_BAN, 0.0), entry(5, SAMPLE_E_BAN, 0.0)];
    rows.push(r);
    // The mask allows 1 and 7 only; 7 leads them.
    let mut r = Row::greedy();
    r.mask = true;
    r.num_top = 2;
    rows.push(r);
    // A negative prompt token is multiplied: -0.5 * 2 = -1 (still not the leader), and a
    // penalty on token 5 alone leaves 2 leading.
    let mut r = Row::greedy();
    r.rep = 2.0;
    r.entries = vec![entry(1, SAMPLE_E_PROMPT, 0.0), entry(5, 1, 0.0)];
    rows.push(r);
    let n = rows.len();
    let logits: Vec<f32> = (0..n).flat_map(|_| x.clone()).collect();
    let mask: Vec<u32> = (0..n).map(|_| (1 << 1) | (1 << 7)).collect();
    let got = run(&logits, 10, &rows, Some(&mask)).unwrap();
    let tokens: Vec<u32> = got.iter().map(|g| g.token).collect();
    assert_eq!(tokens, vec![5, 5, 1, 7, 7, 2]);
    // Logprobs stay those of the raw logits, whatever the transforms.
    let lp = log_softmax(&x);
    assert!((got[3].logprob as f64 - lp[7]).abs() < 1e-6);
    assert_eq!(
        got[4].top.iter().map(|t| t.0).collect::<Vec<_>>(),
        vec![2, 5]
    );
}

#[test]
fn draws_follow_the_softmax_reproduce_and_respect_top_k_top_p_min_p() {
    // p = softmax(x / 0.8).
    let x = [1.0f32, 0.2, -0.4, 0.9, -2.0, 0.0];
    let t = 0.8f32;
    let w: Vec<f64> = x.iter().map(|&v| ((v / t) as f64).exp()).collect();
    let z: f64 = w.iter().sum();
    let rows: Vec<Row> = (0..4000).map(|c| Row::sampled(t, 1234, c)).collect();
    let logits: Vec<f32> = (0..rows.len()).flat_map(|_| x).collect();
    let got = run(&logits, x.len(), &rows, None).unwrap();
    for (i, wi) in w.iter().enumerate() {
        let f = got.iter().filter(|g| g.token == i as u32).count() as f64 / rows.len() as f64;
        assert!((f - wi / z).abs() < 0.025, "token {i}: {f} vs {}", wi / z);
    }
    // The same (seed, counter) draws the same token; another seed draws other tokens.
    let again = run(&logits, x.len(), &rows, None).unwrap();
    assert_eq!(got, again);
    let other: Vec<Row> = (0..4000).map(|c| Row::sampled(t, 99, c)).collect();
    let other = run(&logits, x.len(), &other, None).unwrap();
    assert!(
        got.iter()
            .zip(&other)
            .filter(|(a, b)| a.token != b.token)
            .count()
            > 1000
    );

    // top_k 2: tokens 0 and 3 only; top_p 0.5: the smallest set reaching half the mass (0, 3);
    // min_p 0.7: tokens at least 0.7 x the best (exp(-0.1/0.8) = 0.88 for token 3).
    let restricted = |f: &dyn Fn(&mut Row)| {
        let rows: Vec<Row> = (0..600)
            .map(|c| {
                let mut r = Row::sampled(t, 5, c);
                f(&mut r);
                r
            })
            .collect();
        let logits: Vec<f32> = (0..rows.len()).flat_map(|_| x).collect();
        let got = run(&logits, x.len(), &rows, None).unwrap();
        let mut seen: Vec<u32> = got.iter().map(|g| g.token).collect();
        seen.sort_unstable();
        seen.dedup();
        seen
    };
    assert_eq!(restricted(&|r| r.top_k = 2), vec![0, 3]);
    assert_eq!(restricted(&|r| r.top_p = 0.5), vec![0, 3]);
    assert_eq!(restricted(&|r| r.min_p = 0.7), vec![0, 3]);
    assert_eq!(restricted(&|r| r.top_p = 0.3), vec![0]);
    assert_eq!(restricted(&|_| ()).len(), 6);
}

#[test]
fn bad_rows_fail_the_launch() {
    let x = vec![0.5f32; 40];
    let mut r = Row::greedy();
    r.num_top = SAMPLE_TOP_MAX + 1;
    assert!(run(&x, 40, &[r], None).is_err());
    let mut r = Row::greedy();
    r.entries = vec![[5, 1, 0], [3, 1, 0]];
    assert!(
        run(&x, 40, &[r], None)
            .unwrap_err()
            .contains("out of order")
    );
    let mut r = Row::greedy();
    r.entries = vec![[40, 1, 0]];
    assert!(run(&x, 40, &[r], None).is_err());
    let mut r = Row::greedy();
    r.mask = true;
    assert!(run(&x, 40, &[r], None).is_err());
}
