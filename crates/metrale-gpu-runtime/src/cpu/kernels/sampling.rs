//! CPU twin of `kernels/sampling.cu`: greedy `argmax`, and `sample` (penalties, logit bias, an
//! allowed-token mask, temperature, top-k, top-p, min-p, logprobs). `sample` computes each
//! row's thresholds directly (sorted keys, prefix masses) where the kernel runs radix
//! selections; both define them the same way, and both use the same explicitly rounded
//! `det_exp` / `det_log`, so tokens and top ids match the kernel bit for bit (the log-sum-exp of
//! the logprobs is a sum whose order and precision differ: f64 here, blocked f32 there).

use metrale_kernel_abi::{
    ArgmaxParams, SAMPLE_E_BAN, SAMPLE_E_COUNT_MASK, SAMPLE_E_PROMPT, SAMPLE_ENTRY_WORDS,
    SAMPLE_F_GREEDY, SAMPLE_F_MASK, SAMPLE_MASS_BITS, SAMPLE_OUT_WORDS, SAMPLE_R_COUNTER,
    SAMPLE_R_ENTRY_COUNT, SAMPLE_R_ENTRY_START, SAMPLE_R_FLAGS, SAMPLE_R_FREQUENCY, SAMPLE_R_MIN_P,
    SAMPLE_R_NUM_TOP, SAMPLE_R_PRESENCE, SAMPLE_R_REPETITION, SAMPLE_R_SEED_HI, SAMPLE_R_SEED_LO,
    SAMPLE_R_TEMPERATURE, SAMPLE_R_TOP_K, SAMPLE_R_TOP_P, SAMPLE_ROW_WORDS, SAMPLE_TOP_MAX,
    SampleParams,
};

use crate::cpu::KernelCtx;
use crate::error::GpuResult;

/// `argmax` ([`ArgmaxParams`]): the lowest index of each row's maximum (NaN never wins; an
/// all-NaN row gives 0).
pub fn argmax(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    let p: ArgmaxParams = ctx.params()?;
    let (rows, vocab) = (p.rows as usize, p.vocab as usize);
    let out = ctx.slice_mut::<u32>("out", p.out, rows)?;
    let logits = ctx.slice::<f32>("logits", p.logits, rows * vocab)?;
    for (r, o) in out.iter_mut().enumerate() {
        *o = first_max(&logits[r * vocab..(r + 1) * vocab]);
    }
    Ok(())
}

/// The lowest index of the maximum (NaN never wins; all NaN gives 0).
fn first_max(row: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] || (row[best].is_nan() && !v.is_nan()) {
            best = i;
        }
    }
    best as u32
}

/// `e^x` for `x <= 0`, as the kernel's `det_exp` computes it (0 below -87 and for NaN).
pub fn det_exp(x: f32) -> f32 {
    // `x > -87` is false for NaN too.
    if x.partial_cmp(&-87.0) != Some(std::cmp::Ordering::Greater) {
        return 0.0;
    }
    // The kernel's literals 1.44269504f, 1.41421356f and 0.693147182f are these constants.
    let t = x * std::f32::consts::LOG2_E;
    let n = t.round_ties_even();
    let f = t - n;
    let mut p = 1.540_353e-4_f32;
    for c in [
        1.333_356e-3,
        9.618_129e-3,
        5.550_411e-2,
        2.402_265e-1,
        6.931_472e-1,
        1.0,
    ] {
        p = p.mul_add(f, c);
    }
    p * f32::from_bits(((n as i32 + 127) << 23) as u32)
}

/// `ln x` for a positive normal `x`, as the kernel's `det_log` computes it.
pub fn det_log(x: f32) -> f32 {
    let b = x.to_bits();
    let mut e = ((b >> 23) & 0xFF) as i32 - 127;
    let mut m = f32::from_bits((b & 0x7F_FFFF) | 0x3F80_0000);
    if m > std::f32::consts::SQRT_2 {
        m *= 0.5;
        e += 1;
    }
    let f = m - 1.0;
    let s = f / (2.0 + f);
    let z = s * s;
    let mut p = 0.111_111_11_f32;
    for c in [0.142_857_15, 0.2, 0.333_333_34, 1.0] {
        p = p.mul_add(z, c);
    }
    let l = (2.0 * s) * p;
    (e as f32).mul_add(std::f32::consts::LN_2, l)
}

fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The Gumbel noise of token `i` under the draw `base`.
fn gumbel(base: u64, i: u32) -> f32 {
    let z = mix64(base.wrapping_add((i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)));
    let u = (((((z >> 41) as u32) << 1) | 1) as f32) * 5.960_464_5e-8;
    -det_log(-det_log(u))
}

/// The order-preserving key of a float (-0 as +0, NaN lowest).
fn order_key(v: f32) -> u32 {
    if v.is_nan() {
        return 0;
    }
    let v = if v == 0.0 { 0.0 } else { v };
    let b = v.to_bits();
    if b & 0x8000_0000 != 0 {
        !b
    } else {
        b | 0x8000_0000
    }
}

/// Whether `(a, ia)` beats `(b, ib)`: a number beats NaN, a larger number wins, ties go to the
/// lower index.
fn beats(a: f32, ia: u32, b: f32, ib: u32) -> bool {
    let (an, bn) = (a.is_nan(), b.is_nan());
    if an != bn {
        return bn;
    }
    if !an && a != b {
        return a > b;
    }
    ia < ib
}

/// The best `(value, index)` of `values` over the indices `keep` allows, or `None`.
fn best_of(values: impl Iterator<Item = (u32, f32)>) -> Option<(u32, f32)> {
    let mut best: Option<(u32, f32)> = None;
    for (i, v) in values {
        if best.is_none_or(|(bi, bv)| beats(v, i, bv, bi)) {
            best = Some((i, v));
        }
    }
    best
}

/// The key `K` with `W(key > K) < target <= W(key >= K)` over `(key, weight)` pairs of
/// positive weight (the kernel's `radix_select`).
fn select_key(mut pairs: Vec<(u32, u64)>, target: u64) -> u32 {
    pairs.retain(|&(_, w)| w > 0);
    pairs.sort_unstable_by_key(|p| std::cmp::Reverse(p.0));
    let mut acc = 0u64;
    let mut i = 0;
    while i < pairs.len() {
        let key = pairs[i].0;
        while i < pairs.len() && pairs[i].0 == key {
            acc += pairs[i].1;
            i += 1;
        }
        if acc >= target {
            return key;
        }
    }
    0
}

/// `sample` ([`SampleParams`]): see `kernels/sampling.cu`. Fails the launch where the kernel
/// reports a fault.
pub fn sample(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    let p: SampleParams = ctx.params()?;
    let (rows, vocab) = (p.rows as usize, p.vocab as usize);
    let words = vocab.div_ceil(32);
    let out = ctx.slice_mut::<u32>("out", p.out, rows * SAMPLE_OUT_WORDS as usize)?;
    let logits = ctx.slice::<f32>("logits", p.logits, rows * vocab)?;
    let rowp = ctx.slice::<u32>("rowp", p.rowp, rows * SAMPLE_ROW_WORDS as usize)?;
    let entries = ctx.slice::<u32>(
        "entries",
        p.entries,
        p.num_entries as usize * SAMPLE_ENTRY_WORDS as usize,
    )?;
    let any_mask = (0..rows).any(|r| rowp[r * SAMPLE_ROW_WORDS as usize] & SAMPLE_F_MASK != 0);
    if any_mask && (p.mask.is_null() || (p.mask_words as usize) < words) {
        return Err(ctx.fail("a row has a mask flag but the mask is missing or too narrow"));
    }
    let mask = if any_mask {
        ctx.slice::<u32>("mask", p.mask, rows * p.mask_words as usize)?
    } else {
        &[]
    };
    for r in 0..rows {
        let rp = &rowp[r * SAMPLE_ROW_WORDS as usize..(r + 1) * SAMPLE_ROW_WORDS as usize];
        let w = |i: u32| rp[i as usize];
        let f = |i: u32| f32::from_bits(rp[i as usize]);
        let (start, count) = (w(SAMPLE_R_ENTRY_START), w(SAMPLE_R_ENTRY_COUNT));
        if w(SAMPLE_R_NUM_TOP) > SAMPLE_TOP_MAX
            || start > p.num_entries
            || count > p.num_entries - start
        {
            return Err(ctx.fail(format!(
                "row {r}: top logprobs {} or entries {start}+{count} of {} out of range",
                w(SAMPLE_R_NUM_TOP),
                p.num_entries
            )));
        }
        let ew = SAMPLE_ENTRY_WORDS as usize;
        let ent = &entries[start as usize * ew..(start + count) as usize * ew];
        let mut touched = std::collections::HashMap::new();
        let mut prev = None;
        for e in ent.chunks(ew) {
            if e[0] as usize >= vocab || prev.is_some_and(|t| t >= e[0]) {
                return Err(ctx.fail(format!(
                    "row {r}: entry token {} outside the vocabulary of {vocab} or out of order",
                    e[0]
                )));
            }
            prev = Some(e[0]);
            touched.insert(e[0], (e[1], f32::from_bits(e[2])));
        }
        let x = &logits[r * vocab..(r + 1) * vocab];
        let flags = w(SAMPLE_R_FLAGS);
        let mrow = (flags & SAMPLE_F_MASK != 0)
            .then(|| &mask[r * p.mask_words as usize..(r + 1) * p.mask_words as usize]);
        let (rep, pres, freq) = (
            f(SAMPLE_R_REPETITION),
            f(SAMPLE_R_PRESENCE),
            f(SAMPLE_R_FREQUENCY),
        );
        let tv: Vec<f32> = (0..vocab as u32)
            .map(|i| {
                let mut v = x[i as usize];
                if let Some(&(c, b)) = touched.get(&i) {
                    v = apply_entry(v, c, b, rep, pres, freq);
                }
                if mrow.is_some_and(|m| (m[i as usize / 32] >> (i % 32)) & 1 == 0) {
                    v = f32::NEG_INFINITY;
                }
                v
            })
            .collect();
        let o = &mut out[r * SAMPLE_OUT_WORDS as usize..(r + 1) * SAMPLE_OUT_WORDS as usize];

        // Step 1: logprobs of the raw logits.
        let m = best_of(x.iter().copied().enumerate().map(|(i, v)| (i as u32, v)))
            .map_or(f32::NAN, |b| b.1);
        let lse = if m.is_finite() {
            // Summed in f64: the reference the kernel's blocked f32 sum approximates (a
            // sequential f32 sum over a vocabulary of 248,320 strays by 1e-4 from both).
            let total = x.iter().map(|&v| f64::from(det_exp(v - m))).sum::<f64>() as f32;
            m + det_log(total)
        } else {
            m
        };
        let n_top = (w(SAMPLE_R_NUM_TOP) as usize).min(vocab);
        let mut ranked: Vec<u32> = (0..vocab as u32).collect();
        if n_top > 0 {
            ranked.sort_unstable_by(|&a, &b| {
                (order_key(x[b as usize]).cmp(&order_key(x[a as usize]))).then(a.cmp(&b))
            });
        }
        let top = SAMPLE_TOP_MAX as usize;
        for j in 0..top {
            let (id, lp) = if j < n_top {
                let id = ranked[j];
                (id, (x[id as usize] - lse).to_bits())
            } else {
                (u32::MAX, 0x7fc0_0000)
            };
            o[2 + j] = id;
            o[2 + top + j] = lp;
        }

        // Step 3: the greedy token.
        let best = best_of(tv.iter().copied().enumerate().map(|(i, v)| (i as u32, v)));
        let mut token = best.map_or(0, |b| b.0);

        // Step 4: a draw from the kept set.
        if flags & SAMPLE_F_GREEDY == 0 {
            let temp = f(SAMPLE_R_TEMPERATURE);
            let (top_k, top_p, min_p) = (w(SAMPLE_R_TOP_K), f(SAMPLE_R_TOP_P), f(SAMPLE_R_MIN_P));
            let smax = best.map_or(f32::NAN, |b| b.1) / temp;
            let s: Vec<f32> = tv.iter().map(|&v| v / temp).collect();
            let keys: Vec<u32> = s.iter().map(|&v| order_key(v)).collect();
            let kk = if top_k > 0 && (top_k as usize) < vocab {
                select_key(keys.iter().map(|&k| (k, 1)).collect(), top_k as u64)
            } else {
                0
            };
            let kp = if top_p < 1.0 {
                let scale = (1u64 << SAMPLE_MASS_BITS) as f32;
                let pairs: Vec<(u32, u64)> = (keys.iter().zip(&s))
                    .filter(|&(&k, _)| k >= kk)
                    .map(|(&k, &v)| (k, (det_exp(v - smax) * scale) as u64))
                    .collect();
                let total: u64 = pairs.iter().map(|p| p.1).sum();
                let target = ((top_p as f64 * total as f64) as u64).max(1);
                select_key(pairs, target)
            } else {
                0
            };
            let seed = ((w(SAMPLE_R_SEED_HI) as u64) << 32) | w(SAMPLE_R_SEED_LO) as u64;
            let base = mix64(
                seed ^ mix64((w(SAMPLE_R_COUNTER) as u64).wrapping_add(0x632B_E59B_D9B4_E019)),
            );
            let kept = (0..vocab as u32).filter(|&i| {
                let (key, v) = (keys[i as usize], s[i as usize]);
                key >= kk && key >= kp && (min_p <= 0.0 || det_exp(v - smax) >= min_p)
            });
            if let Some((i, _)) = best_of(kept.map(|i| (i, s[i as usize] + gumbel(base, i)))) {
                token = i;
            }
        }
        o[0] = token;
        o[1] = (x[token as usize] - lse).to_bits();
    }
    Ok(())
}

/// A logit under its entry (count word `c`, bias `b`): banned, the repetition penalty on
/// tokens in the prompt or the output, frequency then presence on output tokens, then the bias.
fn apply_entry(mut x: f32, c: u32, b: f32, rep: f32, pres: f32, freq: f32) -> f32 {
    if c & SAMPLE_E_BAN != 0 {
        return f32::NEG_INFINITY;
    }
    let cnt = c & SAMPLE_E_COUNT_MASK;
    if cnt > 0 || c & SAMPLE_E_PROMPT != 0 {
        x = if x < 0.0 { x * rep } else { x / rep };
    }
    if cnt > 0 {
        x -= freq * cnt as f32;
        x -= pres;
    }
    x + b
}
