//! The host sampler: a seeded SplitMix64 generator ([`Rng`]), greedy [`argmax`], and
//! [`Sampler`], which builds the temperature / top-k / top-p distribution of one row of f32
//! logits and draws from it. Speculative decoding's rejection sampling reads the distribution
//! and the draw apart (`speculative::accept`); tokens of ordinary steps come from the device
//! sampler.

use super::{SamplingParams, fresh_seed};

/// SplitMix64: small, fast, and the same everywhere.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform number in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// The index of the first maximum (NaN never wins).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] || (logits[best].is_nan() && !v.is_nan()) {
            best = i;
        }
    }
    best as u32
}

/// A sampler for one sequence.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: Rng,
}

impl Sampler {
    /// A sampler with its own generator.
    pub fn new(params: SamplingParams) -> Sampler {
        let seed = params.seed.unwrap_or_else(fresh_seed);
        Sampler::with_seed(params, seed)
    }

    /// A sampler whose generator starts from `seed` (the request's seed left aside).
    pub fn with_seed(params: SamplingParams, seed: u64) -> Sampler {
        Sampler {
            params,
            rng: Rng::new(seed),
        }
    }

    /// The parameters.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Whether tokens are picked greedily (temperature 0, or top-k 1): the argmax of the
    /// logits, no randomness.
    pub fn is_greedy(&self) -> bool {
        self.params.is_greedy()
    }

    /// Pick a token from one row of logits: the greedy token, or one draw from
    /// [`Sampler::distribution`].
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.is_greedy() {
            return argmax(logits);
        }
        let dist = self.distribution(logits);
        self.draw(&dist)
    }

    /// The distribution a non-greedy `sample` draws from, as `(token, probability)` summing to
    /// one: softmax at `temperature`, restricted to the `top_k` most likely tokens, then to the
    /// smallest most-likely prefix whose probability reaches `top_p`. Tokens rank by logit, ties
    /// by lower index. In rank order when `top_k` or `top_p` restrict the support, else in index
    /// order. Cost: one pass over the vocabulary plus a sort of only the tokens `top_k` /
    /// `top_p` keep (grown geometrically until the nucleus is covered), never a sort of the
    /// whole vocabulary.
    pub fn distribution(&self, logits: &[f32]) -> Vec<(u32, f64)> {
        let p = &self.params;
        let all: Vec<u32> = (0..logits.len() as u32).collect();
        // With `top_k` the candidates are the k best, ranked; otherwise the whole vocabulary in
        // index order.
        let ranked = p.top_k > 0 && p.top_k < all.len();
        let cands = if ranked {
            best_ranked(logits, all, p.top_k)
        } else {
            all
        };
        let max = logits[argmax(logits) as usize] as f64;
        let t = p.temperature as f64;
        let weight = |i: u32| ((logits[i as usize] as f64 - max) / t).exp();
        let kept = if p.top_p < 1.0 {
            let total: f64 = cands.iter().map(|&i| weight(i)).sum();
            nucleus(logits, &cands, ranked, p.top_p as f64 * total, &weight)
        } else {
            cands
        };
        let weights: Vec<f64> = kept.iter().map(|&i| weight(i)).collect();
        let total: f64 = weights.iter().sum();
        kept.into_iter()
            .zip(weights)
            .map(|(i, w)| (i, w / total))
            .collect()
    }

    /// The next uniform number in [0, 1) of the sampler's generator.
    pub fn uniform(&mut self) -> f64 {
        self.rng.next_f64()
    }

    /// Draw a token from `dist` (`(token, probability)`, summing to one) with one uniform
    /// number: the first token whose cumulative probability passes it.
    pub fn draw(&mut self, dist: &[(u32, f64)]) -> u32 {
        let u = self.rng.next_f64();
        let mut acc = 0.0;
        for &(i, q) in dist {
            acc += q;
            if u < acc {
                return i;
            }
        }
        dist.last().map_or(0, |&(i, _)| i)
    }
}

/// Descending logit, ties by lower index: the total order tokens are ranked in.
fn rank(logits: &[f32], a: u32, b: u32) -> std::cmp::Ordering {
    logits[b as usize]
        .total_cmp(&logits[a as usize])
        .then(a.cmp(&b))
}

/// The `k` best of `idx` (`1 <= k <= idx.len()`), ranked: a selection, then a sort of `k`.
fn best_ranked(logits: &[f32], mut idx: Vec<u32>, k: usize) -> Vec<u32> {
    if k < idx.len() {
        idx.select_nth_unstable_by(k - 1, |&a, &b| rank(logits, a, b));
        idx.truncate(k);
    }
    idx.sort_unstable_by(|&a, &b| rank(logits, a, b));
    idx
}

/// The smallest ranked prefix of `cands` whose weight reaches `mass` (`ranked`: `cands` is in
/// rank order already). Only the best 64, 256, ... candidates are ranked until one covers it.
fn nucleus(
    logits: &[f32],
    cands: &[u32],
    ranked: bool,
    mass: f64,
    weight: &dyn Fn(u32) -> f64,
) -> Vec<u32> {
    let mut k = 64.min(cands.len());
    loop {
        let head = if ranked {
            cands[..k].to_vec()
        } else {
            best_ranked(logits, cands.to_vec(), k)
        };
        let mut acc = 0.0;
        for (n, &i) in head.iter().enumerate() {
            acc += weight(i);
            if acc >= mass {
                return head[..=n].to_vec();
            }
        }
        if k == cands.len() {
            return head;
        }
        k = (k * 4).min(cands.len());
    }
}
