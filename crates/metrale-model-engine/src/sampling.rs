//! How tokens are picked: `SamplingParams` (temperature, top-k, top-p, min-p, the repetition,
//! presence and frequency penalties, logit bias, min_tokens, logprobs, the seed), the rows the
//! device sampler (`sampling::sample`, `kernels/sampling.cu`) reads ([`SampleRow`], built per
//! sequence and step by [`TokenStats`] and [`SamplingParams::sample_row`]) and what it returns
//! ([`SampledToken`]); a structured-output row's allowed-token bitmask rides in its
//! [`SampleRow`] and is applied on the device. A host [`Sampler`] (temperature, top-k and top-p
//! from f32 logits, driven by a seeded generator; `host.rs`) remains for the rejection sampling
//! of speculative decoding (`speculative::accept`), which reads the distribution and the draw
//! apart.
//!
//! Invariants:
//! - Greedy picks the lowest index among the maxima, like the device `argmax`.
//! - A request's only randomness is its seed: the request's, or, for a request without one, a
//!   fresh one from [`fresh_seed`] (never the clock or the environment). The device sampler
//!   draws token `i` of a sequence from (seed, i) alone, so a seed reproduces its tokens
//!   whatever the batch, the preemptions or the prefix cache.
//! - Logprobs are the log_softmax of the model's raw f32 logits, before penalties, bias, mask
//!   and temperature (vLLM's default, `raw_logprobs`).

use std::collections::BTreeMap;

use metrale_config::GenerationDefaults;
use metrale_kernel_abi::{
    SAMPLE_E_BAN, SAMPLE_E_COUNT_MASK, SAMPLE_E_PROMPT, SAMPLE_F_GREEDY, SAMPLE_F_MASK,
    SAMPLE_R_COUNTER, SAMPLE_R_FLAGS, SAMPLE_R_FREQUENCY, SAMPLE_R_MIN_P, SAMPLE_R_NUM_TOP,
    SAMPLE_R_PRESENCE, SAMPLE_R_REPETITION, SAMPLE_R_SEED_HI, SAMPLE_R_SEED_LO,
    SAMPLE_R_TEMPERATURE, SAMPLE_R_TOP_K, SAMPLE_R_TOP_P, SAMPLE_ROW_WORDS, SAMPLE_TOP_MAX,
};

mod host;

pub use host::{Rng, Sampler, argmax};

/// Most top logprobs a token can report (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = SAMPLE_TOP_MAX as usize;

/// Most `logit_bias` entries a request may give.
pub const MAX_LOGIT_BIAS: usize = 1024;

/// Most token ids `min_tokens` may hold back: the request's stop token ids and the model's EOS
/// ids together.
pub const MAX_BANNED: usize = 256;

/// How to pick the next token. Transforms apply in this order (transformers' and vLLM's):
/// repetition penalty, frequency and presence penalties, logit bias, `min_tokens` (EOS and stop
/// ids banned), then temperature, top-k, top-p and min-p.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct SamplingParams {
    /// 0 means greedy. Default 0.
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens; 0 keeps all. Default 0.
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches `top_p`; 1 keeps all.
    /// Default 1.
    pub top_p: f32,
    /// Keep the tokens at least `min_p` times as likely as the most likely one; 0 keeps all.
    /// In [0, 1]. Default 0.
    pub min_p: f32,
    /// Divide positive (multiply negative) logits of tokens in the prompt or the output by
    /// it (transformers' `repetition_penalty`); 1 is none. > 0. Default 1.
    pub repetition_penalty: f32,
    /// Subtracted once from the logit of every token already in the output (OpenAI's
    /// `presence_penalty`). In [-2, 2]. Default 0.
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per time it is in the output (OpenAI's
    /// `frequency_penalty`). In [-2, 2]. Default 0.
    pub frequency_penalty: f32,
    /// `(token id, bias)` added to the logits (OpenAI's `logit_bias`); ids in the vocabulary,
    /// biases in [-100, 100], at most [`MAX_LOGIT_BIAS`] entries, a token at most once.
    /// Default empty.
    pub logit_bias: Vec<(u32, f32)>,
    /// The EOS and stop token ids cannot be picked before this many tokens are generated.
    /// Default 0.
    pub min_tokens: usize,
    /// Report each generated token's logprob. Default false.
    pub logprobs: bool,
    /// Report this many most likely tokens with their logprobs at each step (at most
    /// [`MAX_TOP_LOGPROBS`]; more than 0 implies `logprobs`). Default 0.
    pub top_logprobs: usize,
    /// Seed of the generator; `None` (the default) draws a fresh one per request, so two
    /// sampled requests without a seed differ. A given seed reproduces its tokens.
    pub seed: Option<u64>,
    /// Choices: independent continuations of the prompt, which the scheduler computes once
    /// (each choice forks the sequence's cache after the prompt); choice `c` draws with
    /// [`choice_seed`]`(seed, c)`. In 1..=[`MAX_CHOICES`]. Default 1.
    pub n: usize,
    /// Choices to generate when more than `n` (vLLM's `best_of`): `best_of` choices run and
    /// the `n` with the highest cumulative logprob (the sum of their tokens' logprobs of the
    /// raw logits) are kept, best first. In `n..=`[`MAX_CHOICES`]. Default `None` (`n`).
    pub best_of: Option<usize>,
}

/// Most choices one request may ask for.
pub const MAX_CHOICES: usize = 64;

/// The seed of choice `c` of a request seeded `seed`: `seed` itself for choice 0, a mix of both
/// for the others (so `n = 1` draws as before, and choices differ).
pub fn choice_seed(seed: u64, c: usize) -> u64 {
    if c == 0 {
        return seed;
    }
    let mix = |mut z: u64| {
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    mix(seed ^ mix(c as u64 ^ 0xD6E8_FEB8_6659_FD93))
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
            min_tokens: 0,
            logprobs: false,
            top_logprobs: 0,
            seed: None,
            n: 1,
            best_of: None,
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

    /// Set `n`, the number of choices.
    pub fn n(mut self, n: usize) -> Self {
        self.n = n;
        self
    }

    /// Set `best_of`: generate this many choices and keep the `n` best.
    pub fn best_of(mut self, best_of: usize) -> Self {
        self.best_of = Some(best_of);
        self
    }

    /// Choices the scheduler runs: `best_of` when set, else `n`.
    pub fn choices_generated(&self) -> usize {
        self.best_of.unwrap_or(self.n).max(self.n)
    }

    /// Whether more choices run than are returned, ranked by cumulative logprob: every token
    /// then needs its logprob from the device sampler.
    pub fn ranks_choices(&self) -> bool {
        self.choices_generated() > self.n
    }

    /// Set `min_p` (0: all tokens).
    pub fn min_p(mut self, p: f32) -> Self {
        self.min_p = p;
        self
    }

    /// Set `repetition_penalty` (1: none).
    pub fn repetition_penalty(mut self, r: f32) -> Self {
        self.repetition_penalty = r;
        self
    }

    /// Set `presence_penalty` (0: none).
    pub fn presence_penalty(mut self, p: f32) -> Self {
        self.presence_penalty = p;
        self
    }

    /// Set `frequency_penalty` (0: none).
    pub fn frequency_penalty(mut self, p: f32) -> Self {
        self.frequency_penalty = p;
        self
    }

    /// Set `logit_bias`: `(token id, bias)` pairs.
    pub fn logit_bias(mut self, bias: Vec<(u32, f32)>) -> Self {
        self.logit_bias = bias;
        self
    }

    /// Set `min_tokens`.
    pub fn min_tokens(mut self, n: usize) -> Self {
        self.min_tokens = n;
        self
    }

    /// Set `logprobs`: report each token's logprob.
    pub fn logprobs(mut self, on: bool) -> Self {
        self.logprobs = on;
        self
    }

    /// Set `top_logprobs` (0 to [`MAX_TOP_LOGPROBS`]).
    pub fn top_logprobs(mut self, n: usize) -> Self {
        self.top_logprobs = n;
        self
    }

    /// Whether tokens are picked greedily (temperature 0, or top-k 1).
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }

    /// Whether the tokens need more than the host sampler has (penalties, bias, min-p,
    /// min_tokens, logprobs, choices ranked by logprob): such a sequence does not draft
    /// (speculative decoding's acceptance knows only temperature, top-k and top-p, and an
    /// accepted draft has no logprob).
    pub fn needs_device_sampler(&self) -> bool {
        self.min_p > 0.0
            || self.has_penalties()
            || !self.logit_bias.is_empty()
            || self.min_tokens > 0
            || self.wants_logprobs()
            || self.ranks_choices()
    }

    /// Whether a repetition, presence or frequency penalty applies.
    pub fn has_penalties(&self) -> bool {
        self.repetition_penalty != 1.0
            || self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
    }

    /// Whether logprobs are reported.
    pub fn wants_logprobs(&self) -> bool {
        self.logprobs || self.top_logprobs > 0
    }

    /// The device sampler's parameter words for a row drawing token `counter` of a sequence
    /// seeded `seed` (the entry range is the runner's to fill; `mask`: the row has an
    /// allowed-token bitmask).
    pub fn sample_row(
        &self,
        seed: u64,
        counter: u64,
        mask: bool,
    ) -> [u32; SAMPLE_ROW_WORDS as usize] {
        let mut w = [0u32; SAMPLE_ROW_WORDS as usize];
        let mut flags = if self.is_greedy() { SAMPLE_F_GREEDY } else { 0 };
        if mask {
            flags |= SAMPLE_F_MASK;
        }
        let mut set = |i: u32, v: u32| w[i as usize] = v;
        set(SAMPLE_R_FLAGS, flags);
        set(SAMPLE_R_TEMPERATURE, self.temperature.to_bits());
        set(
            SAMPLE_R_TOP_K,
            u32::try_from(self.top_k).unwrap_or(u32::MAX),
        );
        set(SAMPLE_R_TOP_P, self.top_p.to_bits());
        set(SAMPLE_R_MIN_P, self.min_p.to_bits());
        set(SAMPLE_R_REPETITION, self.repetition_penalty.to_bits());
        set(SAMPLE_R_PRESENCE, self.presence_penalty.to_bits());
        set(SAMPLE_R_FREQUENCY, self.frequency_penalty.to_bits());
        set(
            SAMPLE_R_NUM_TOP,
            self.top_logprobs.min(MAX_TOP_LOGPROBS) as u32,
        );
        set(SAMPLE_R_SEED_LO, seed as u32);
        set(SAMPLE_R_SEED_HI, (seed >> 32) as u32);
        // The counter is a sequence's token index: below 2^32 for any context.
        set(SAMPLE_R_COUNTER, counter as u32);
        w
    }

    /// These parameters with the sampling a checkpoint recommends in its
    /// `generation_config.json` (temperature, top-p, top-k, min-p, repetition penalty) put over
    /// them wherever the file sets one.
    pub fn with_checkpoint_defaults(mut self, defaults: &GenerationDefaults) -> Self {
        if let Some(p) = defaults.min_p {
            self.min_p = p;
        }
        if let Some(r) = defaults.repetition_penalty {
            self.repetition_penalty = r;
        }
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
        let bad = |field: &'static str, value: String, expected: &'static str| SamplingError {
            field,
            value,
            expected,
        };
        if !(1..=MAX_CHOICES).contains(&self.n) {
            return Err(bad("n", self.n.to_string(), "from 1 to 64 choices"));
        }
        if let Some(b) = self.best_of
            && !(self.n..=MAX_CHOICES).contains(&b)
        {
            return Err(bad(
                "best_of",
                b.to_string(),
                "at least `n` and at most 64 choices",
            ));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(bad("min_p", self.min_p.to_string(), "a number in [0, 1]"));
        }
        if !self.repetition_penalty.is_finite() || self.repetition_penalty <= 0.0 {
            let v = self.repetition_penalty.to_string();
            return Err(bad(
                "repetition_penalty",
                v,
                "a finite number > 0 (1 = none)",
            ));
        }
        for (field, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return Err(bad(field, v.to_string(), "a number in [-2, 2]"));
            }
        }
        if self.top_logprobs > MAX_TOP_LOGPROBS {
            let v = self.top_logprobs.to_string();
            return Err(bad("top_logprobs", v, "at most 20"));
        }
        if self.logit_bias.len() > MAX_LOGIT_BIAS {
            let v = format!("{} entries", self.logit_bias.len());
            return Err(bad("logit_bias", v, "at most 1024 entries"));
        }
        let mut seen = std::collections::BTreeSet::new();
        for &(id, b) in &self.logit_bias {
            if !(-100.0..=100.0).contains(&b) {
                return Err(bad(
                    "logit_bias",
                    format!("{b} for token {id}"),
                    "biases in [-100, 100]",
                ));
            }
            if !seen.insert(id) {
                return Err(bad(
                    "logit_bias",
                    format!("token {id} twice"),
                    "each token at most once",
                ));
            }
        }
        Ok(())
    }

    /// [`SamplingParams::validate`], and every `logit_bias` id inside a vocabulary of `vocab`.
    pub fn validate_for_vocab(&self, vocab: usize) -> Result<(), SamplingError> {
        self.validate()?;
        ids_in_vocab(
            "logit_bias",
            self.logit_bias.iter().map(|&(id, _)| id),
            vocab,
        )
    }
}

/// Refuses the first of `ids` (request field `field`'s token ids) at or past `vocab`.
pub(crate) fn ids_in_vocab(
    field: &'static str,
    mut ids: impl Iterator<Item = u32>,
    vocab: usize,
) -> Result<(), SamplingError> {
    match ids.find(|&id| id as usize >= vocab) {
        Some(id) => Err(SamplingError {
            field,
            value: format!("token {id}"),
            expected: "token ids inside the vocabulary",
        }),
        None => Ok(()),
    }
}

/// One logit row as the device sampler reads it: its parameter words
/// ([`SamplingParams::sample_row`]), its entries (`[token, count | flags, bias bits]`, sorted by
/// token, each token once) and its allowed-token bitmask (bit `t % 32` of word `t / 32` set:
/// token `t` allowed), if it has one.
#[derive(Debug, Clone, PartialEq)]
pub struct SampleRow {
    /// The parameter words (the runner fills the entry range).
    pub words: [u32; SAMPLE_ROW_WORDS as usize],
    /// The row's entries.
    pub entries: Vec<[u32; 3]>,
    /// `ceil(vocab / 32)` words, or `None`: every token allowed.
    pub mask: Option<Vec<u32>>,
}

impl SampleRow {
    /// The row of plain greedy decoding: `argmax` of the logits.
    pub fn greedy() -> SampleRow {
        SampleRow {
            words: SamplingParams::greedy().sample_row(0, 0, false),
            entries: Vec::new(),
            mask: None,
        }
    }
}

/// What the device sampler picked for one row: a token with its logprob and the top logprobs.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct SampledToken {
    /// The token.
    pub token: u32,
    /// Its logprob (log_softmax of the raw logits).
    pub logprob: f32,
    /// The most likely tokens with their logprobs, best first (ties by lower id), as many as
    /// the row asked for.
    pub top: Vec<(u32, f32)>,
}

/// A sequence's token counts, for the penalties: how often each token is in the output and
/// whether it is in the prompt. Kept only for sequences with a penalty.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TokenStats {
    /// token -> (output count, in the prompt).
    counts: BTreeMap<u32, (u32, bool)>,
}

impl TokenStats {
    /// The statistics of `prompt` (no output yet).
    pub fn of_prompt(prompt: &[u32]) -> TokenStats {
        let mut counts = BTreeMap::new();
        for &t in prompt {
            counts.insert(t, (0, true));
        }
        TokenStats { counts }
    }

    /// Count one generated token.
    pub fn push(&mut self, token: u32) {
        self.counts.entry(token).or_insert((0, false)).0 += 1;
    }

    /// The device entries of a row under `p`: the penalised tokens (prompt tokens only under a
    /// repetition penalty), `p.logit_bias`, and `banned` (min_tokens), merged and sorted.
    pub fn entries(&self, p: &SamplingParams, banned: &[u32]) -> Vec<[u32; 3]> {
        let mut m: BTreeMap<u32, [u32; 3]> = BTreeMap::new();
        if p.has_penalties() {
            let prompt = p.repetition_penalty != 1.0;
            for (&t, &(count, in_prompt)) in &self.counts {
                let mut c = count.min(SAMPLE_E_COUNT_MASK);
                if in_prompt && prompt {
                    c |= SAMPLE_E_PROMPT;
                }
                if c != 0 {
                    m.insert(t, [t, c, 0.0f32.to_bits()]);
                }
            }
        }
        for &(t, b) in &p.logit_bias {
            m.entry(t).or_insert([t, 0, 0])[2] = b.to_bits();
        }
        for &t in banned {
            m.entry(t).or_insert([t, 0, 0])[1] |= SAMPLE_E_BAN;
        }
        m.into_values().collect()
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

#[cfg(test)]
mod tests;
