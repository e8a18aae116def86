//! Host-side sampling from f32 logits: greedy, temperature, top-k and top-p, driven by a seeded
//! generator so the same seed gives the same tokens. The distribution and the draw are exposed
//! apart for the rejection sampling of speculative decoding (`speculative::accept`).
//!
//! Invariants:
//! - Greedy picks the lowest index among the maxima, like the device `argmax`.
//! - A sampler's only randomness is its seed: the request's, or, for a request without one, a
//!   fresh one from [`fresh_seed`] (never the clock or the environment).

use metrale_config::GenerationDefaults;

/// How to pick the next token.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct SamplingParams {
    /// 0 means greedy. Default 0.
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens; 0 keeps all. Default 0.
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches `top_p`; 1 keeps all.
    /// Default 1.
    pub top_p: f32,
    /// Seed of the generator; `None` (the default) draws a fresh one per request, so two
    /// sampled requests without a seed differ. A given seed reproduces its tokens.
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: None,
        }
    }
}

/// A sampling parameter out of range.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("invalid sampling parameter `{field}` = {value}: {expected}")]
pub struct SamplingError {
    /// The field.
    pub field: &'static str,
    /// Its value, printed.
    pub value: String,
    /// What it must be.
    pub expected: &'static str,
}

impl SamplingParams {
    /// Greedy decoding: the most likely token at every step (the default).
    pub fn greedy() -> SamplingParams {
        SamplingParams::default()
    }

    /// Set `temperature` (0: greedy).
    pub fn temperature(mut self, t: f32) -> Self {
        self.temperature = t;
        self
    }

    /// Set `top_k` (0: all tokens).
    pub fn top_k(mut self, k: usize) -> Self {
        self.top_k = k;
        self
    }

    /// Set `top_p` (1: all tokens).
    pub fn top_p(mut self, p: f32) -> Self {
        self.top_p = p;
        self
    }

    /// Set `seed`: the same seed, prompt and parameters give the same tokens.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }

    /// These parameters with the sampling a checkpoint recommends in its
    /// `generation_config.json` (temperature, top-p, top-k) put over them wherever the file sets
    /// one. The file's `min_p` and `repetition_penalty` are not applied: the sampler has neither.
    pub fn with_checkpoint_defaults(mut self, defaults: &GenerationDefaults) -> Self {
        if let Some(t) = defaults.temperature {
            self.temperature = t;
        }
        if let Some(p) = defaults.top_p {
            self.top_p = p;
        }
        if let Some(k) = defaults.top_k {
            self.top_k = k;
        }
        self
    }

    /// Check every field's range.
    pub fn validate(&self) -> Result<(), SamplingError> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(SamplingError {
                field: "temperature",
                value: self.temperature.to_string(),
                expected: "a finite number >= 0 (0 = greedy)",
            });
        }
        if !self.top_p.is_finite() || self.top_p <= 0.0 || self.top_p > 1.0 {
            return Err(SamplingError {
                field: "top_p",
                value: self.top_p.to_string(),
                expected: "a number in (0, 1]",
            });
        }
        Ok(())
    }
}

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

/// A seed for a request that names none: different at every call, in this process and across
/// processes (the standard library's per-process random hasher keys, over a counter).
pub fn fresh_seed() -> u64 {
    use std::hash::BuildHasher;
    use std::sync::OnceLock;
    use std::sync::atomic::{AtomicU64, Ordering};
    static KEYS: OnceLock<std::hash::RandomState> = OnceLock::new();
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    KEYS.get_or_init(std::hash::RandomState::new).hash_one(n)
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
        Sampler {
            params,
            rng: Rng::new(params.seed.unwrap_or_else(fresh_seed)),
        }
    }

    /// Whether tokens are picked greedily (temperature 0, or top-k 1): the argmax of the
    /// logits, no randomness.
    pub fn is_greedy(&self) -> bool {
        self.params.temperature == 0.0 || self.params.top_k == 1
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
        let p = self.params;
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

#[cfg(test)]
mod tests {
    use super::*;

    fn logits() -> Vec<f32> {
        vec![0.5, 2.0, -1.0, 1.9, 0.0, 2.0, -3.0, 1.0]
    }

    #[test]
    fn the_setters_set_their_field() {
        let p = SamplingParams::greedy()
            .temperature(0.7)
            .top_k(5)
            .top_p(0.9)
            .seed(42);
        let want = SamplingParams {
            temperature: 0.7,
            top_k: 5,
            top_p: 0.9,
            seed: Some(42),
        };
        assert_eq!(p, want);
        assert_eq!(SamplingParams::greedy(), SamplingParams::default());
    }

    #[test]
    fn greedy_takes_the_first_maximum() {
        assert_eq!(Sampler::new(SamplingParams::default()).sample(&logits()), 1);
        assert_eq!(argmax(&[f32::NAN, 1.0, 3.0, 3.0]), 2);
    }

    #[test]
    fn same_seed_same_tokens_other_seed_other_tokens() {
        let p = SamplingParams {
            temperature: 1.5,
            seed: Some(7),
            ..Default::default()
        };
        let run = |p: SamplingParams| {
            let mut s = Sampler::new(p);
            (0..64).map(|_| s.sample(&logits())).collect::<Vec<_>>()
        };
        assert_eq!(run(p), run(p));
        assert_ne!(run(p), run(SamplingParams { seed: Some(8), ..p }));
    }

    #[test]
    fn top_k_and_top_p_restrict_the_support() {
        let mut s = Sampler::new(SamplingParams {
            temperature: 5.0,
            top_k: 3,
            seed: Some(1),
            ..Default::default()
        });
        for _ in 0..200 {
            assert!([1, 5, 3].contains(&s.sample(&logits())), "top-3 only");
        }
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_p: 0.3,
            seed: Some(1),
            ..Default::default()
        });
        for _ in 0..200 {
            assert!(
                [1, 5].contains(&s.sample(&logits())),
                "the nucleus holds the two maxima"
            );
        }
    }

    #[test]
    fn sampling_follows_the_distribution() {
        let l = [0.0f32, (3.0f32).ln()];
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            seed: Some(3),
            ..Default::default()
        });
        let ones = (0..20000).filter(|_| s.sample(&l) == 1).count() as f64 / 20000.0;
        assert!((ones - 0.75).abs() < 0.015, "P(1) = {ones}, expected 0.75");
    }

    #[test]
    fn a_wide_nucleus_is_ranked_past_the_first_candidates() {
        // Equal logits rank by index, so top_p 0.5 of 1000 keeps exactly tokens 0..500: more
        // than the first 64 candidates the nucleus search ranks.
        let logits = vec![0.25f32; 1000];
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_p: 0.5,
            seed: Some(7),
            ..Default::default()
        });
        let draws: Vec<u32> = (0..4000).map(|_| s.sample(&logits)).collect();
        assert!(
            draws.iter().all(|&t| t < 500),
            "a token outside the nucleus"
        );
        let distinct: std::collections::BTreeSet<u32> = draws.into_iter().collect();
        assert!(distinct.len() > 400, "only {} tokens drawn", distinct.len());
    }

    #[test]
    fn invalid_parameters_are_named() {
        let e = SamplingParams {
            temperature: -1.0,
            ..Default::default()
        }
        .validate()
        .unwrap_err();
        assert_eq!(e.field, "temperature");
        let e = SamplingParams {
            top_p: 0.0,
            ..Default::default()
        }
        .validate()
        .unwrap_err();
        assert_eq!(e.field, "top_p");
        assert!(
            SamplingParams {
                temperature: f32::NAN,
                ..Default::default()
            }
            .validate()
            .is_err()
        );
    }
}
