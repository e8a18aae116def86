//! The step runner's side of prefix caching and chunking: where hybrid prefill chunks end
//! (`prefill_chunk`, the SSM snapshot interval and stride), how much of a prompt a mixed step
//! holds (`mixed_chunk`, `rows_within_attention`), whether decode steps compute what prefill steps compute (so the
//! blocks they fill can be published), and whether `forward` computes decode rows as decode
//! steps do (so they may share a step with a prefill chunk).
//!
//! Invariants:
//! - On a hybrid model a prefill chunk that crosses a multiple of the snapshot interval
//!   (`lcm(block_size, GDN_CHUNK)`) ends at the last multiple it crosses, and one that crosses a
//!   multiple of `ModelOptions::ssm_snapshot_stride` ends at the first such multiple, whether
//!   prefix caching is on or off. The GDN chunked prefill aligns its chunks to multiples of
//!   `GDN_CHUNK`, so a cut there computes bitwise what no cut does; and a sequence restored from
//!   a snapshot at a multiple of the interval cuts the rest of its prompt exactly as a cold run
//!   does. Hence a cached run is bitwise a cold run, with the option on or off.
//! - A mixed step's chunk (`mixed_chunk`) ends only where `prefill_chunk` would end a chunk or,
//!   on hybrid models, at a multiple of the snapshot interval; so, whatever the budget the
//!   decode rows leave, the prompt's cuts that are not multiples of `GDN_CHUNK` are those of
//!   its alternating run, and its GDN state is bitwise that run's.
//! - `decode_matches_prefill` is true only where every kernel of a decode step computes each
//!   row exactly as a prefill step computes it: then a KV block filled by decode steps holds the
//!   bits a cold prefill of the same tokens writes.

use std::ops::Range;

use metrale_model_layers::circuit_exec::Numerics;
use metrale_model_layers::layers::GDN_CHUNK;

use super::StepRunner;

/// Where a hybrid model's prefill chunks are cut (see the module header): both in tokens, the
/// stride a multiple of the interval.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkCuts {
    /// A chunk that crosses a multiple of this ends at the last one it crosses (the SSM
    /// snapshot interval).
    pub interval: usize,
    /// A chunk never crosses a multiple of this (`ModelOptions::ssm_snapshot_stride`).
    pub stride: Option<usize>,
}

/// The prompt positions of a prefill chunk that starts at `start`: at most `chunk` of them,
/// ending at `len` at the latest; with `cuts`, ending at the first multiple of the stride past
/// `start` at the latest, then cut back to the last multiple of the interval it crosses (a
/// chunk that crosses none is left whole).
pub fn prefill_chunk(
    start: usize,
    len: usize,
    chunk: usize,
    cuts: Option<ChunkCuts>,
) -> Range<usize> {
    let mut end = start.saturating_add(chunk.max(1)).min(len);
    if let Some(c) = cuts {
        if let Some(s) = c.stride.filter(|&s| s > 0) {
            end = end.min((start / s).saturating_add(1).saturating_mul(s));
        }
        if let Some(cut) = end.checked_div(c.interval).map(|m| m * c.interval)
            && cut > start
        {
            end = cut;
        }
    }
    start..end.max(start)
}

/// The prompt positions of the chunk a mixed step holds when the prompt's next chunk starts at
/// `start` and the step's decode rows leave `budget` rows (at least one is taken). Without
/// `cuts` (no GDN layers, where any cut computes the same rows): up to `budget` positions of
/// [`prefill_chunk`]'s chunk. With `cuts`: that whole chunk when it fits the budget, else the
/// longest piece of it that fits and ends at a multiple of the interval, else the shortest piece
/// that ends where a cut is allowed (the chunk, or up to the next multiple of the interval):
/// then the chunk exceeds the budget, by less than the interval. So a hybrid prompt is cut
/// only where its alternating run cuts it or at multiples of the interval, where a cut changes
/// no bit.
pub fn mixed_chunk(
    start: usize,
    len: usize,
    chunk: usize,
    budget: usize,
    cuts: Option<ChunkCuts>,
) -> Range<usize> {
    let full = prefill_chunk(start, len, chunk, cuts);
    let budget = budget.max(1);
    if full.len() <= budget {
        return full;
    }
    let Some(c) = cuts else {
        return start..start + budget;
    };
    let piece = prefill_chunk(start, len, budget, cuts);
    if piece.end > start && piece.end.is_multiple_of(c.interval) {
        return piece;
    }
    let next = (start / c.interval + 1) * c.interval;
    start..full.end.min(next)
}

/// The most rows (at least one) a chunk starting at prompt position `start` may hold within
/// `pairs` query-row by key pairs of attention: the largest `r` with
/// `r * start + r * (r + 1) / 2 <= pairs` (row `i` of the chunk reads `start + i + 1` keys).
pub fn rows_within_attention(start: usize, pairs: usize) -> usize {
    let work = |r: u128| r * start as u128 + r * (r + 1) / 2;
    let pairs = pairs as u128;
    // From the real root of r^2 / 2 + (start + 1/2) r = pairs, then exact steps.
    let b = start as f64 + 0.5;
    let mut r = ((b * b + 2.0 * pairs as f64).sqrt() - b).max(0.0) as u128;
    while r > 0 && work(r) > pairs {
        r -= 1;
    }
    while work(r + 1) <= pairs {
        r += 1;
    }
    usize::try_from(r).unwrap_or(usize::MAX).max(1)
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// `lcm(block_size, GDN_CHUNK)`: the positions where a hybrid prefix can end.
pub(crate) fn snapshot_interval(block_size: usize) -> usize {
    let g = GDN_CHUNK as usize;
    block_size / gcd(block_size, g) * g
}

impl StepRunner {
    /// Positions (multiples of this) at which hybrid prefill chunks end and SSM snapshots are
    /// taken: `lcm(block_size, GDN_CHUNK)`, 64 with the default blocks of 16. `None` for a
    /// model without GDN layers.
    pub fn ssm_snapshot_interval(&self) -> Option<usize> {
        (self.model().cache_layers().num_ssm > 0).then(|| snapshot_interval(self.sizes.block_size))
    }

    /// Where this model's prefill chunks are cut (`None`: only by `max_batch_tokens`, on a
    /// model without GDN layers).
    pub fn prefill_cuts(&self) -> Option<ChunkCuts> {
        Some(ChunkCuts {
            interval: self.ssm_snapshot_interval()?,
            stride: self.options.ssm_snapshot_stride,
        })
    }

    /// Whether a decode step computes every row bitwise as a prefill step computes the same
    /// token at the same position over the same cache, so a KV block filled by decode steps
    /// holds what a cold prefill of its tokens writes and may be published for prefix caching.
    /// True for models without GDN layers where [`StepRunner::forward_matches_decode`] holds:
    /// each kernel computes a row alone, the same way whatever the row count. False on hybrid
    /// models, whose prefill runs the chunked delta rule (rounded differently from decode's
    /// token-by-token recurrence, and every later layer's KV with it), and where prompt rows
    /// attend in their own arithmetic ([`StepRunner::prompt_attention`]: a cold prefill
    /// computes an answer's tokens as prompt rows).
    pub fn decode_matches_prefill(&self) -> bool {
        self.model().cache_layers().num_ssm == 0
            && self.forward_matches_decode()
            && !self.prompt_attention()
    }

    /// Whether [`StepRunner::forward`] computes a sequence's one decode row bitwise as a decode
    /// step does, so decode rows may share a step with a prefill chunk (mixed steps): true on
    /// the legacy forward (every kernel computes a row the same way whatever the step's rows,
    /// and a one-row GDN chunk is the recurrent step) and under circuit programs whose every
    /// group is the legacy launch or a fusion byte-identical to it (the reference programs
    /// always; the fused ones while no rule of theirs is `Differs`); false where a program
    /// holds a fusion that rounds differently from the unfused chain `forward` runs.
    pub fn forward_matches_decode(&self) -> bool {
        (self.forward.circuit.as_ref()).is_none_or(|c| c.numerics() != Numerics::Differs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The chunks `next` cuts from `from` to `len`, each `next(start)`.
    fn walk(len: usize, from: usize, next: impl Fn(usize) -> Range<usize>) -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        let mut at = from;
        while at < len {
            let r = next(at);
            out.push((r.start, r.end));
            at = r.end;
        }
        out
    }

    fn chunks(
        len: usize,
        chunk: usize,
        cuts: Option<ChunkCuts>,
        from: usize,
    ) -> Vec<(usize, usize)> {
        walk(len, from, |at| prefill_chunk(at, len, chunk, cuts))
    }

    fn every(interval: usize, stride: Option<usize>) -> Option<ChunkCuts> {
        Some(ChunkCuts { interval, stride })
    }

    #[test]
    fn aligned_chunks_end_at_the_last_multiple_they_cross() {
        let a = every(64, None);
        assert_eq!(chunks(150, 512, None, 0), [(0, 150)]);
        assert_eq!(chunks(150, 512, a, 0), [(0, 128), (128, 150)]);
        // The last multiple before the prompt's end is a cut too: a longer prompt that starts
        // with this one can resume there.
        assert_eq!(
            chunks(1100, 512, a, 0),
            [(0, 512), (512, 1024), (1024, 1088), (1088, 1100)]
        );
        assert_eq!(chunks(1100, 512, a, 960), [(960, 1088), (1088, 1100)]);
        // Small chunks restart at every multiple, so a run resumed there cuts like a cold one.
        assert_eq!(
            chunks(140, 37, a, 0),
            [(0, 37), (37, 64), (64, 101), (101, 128), (128, 140)]
        );
        assert_eq!(chunks(140, 37, a, 64), [(64, 101), (101, 128), (128, 140)]);
        assert_eq!(chunks(40, 16, a, 0), [(0, 16), (16, 32), (32, 40)]);
        // Chunks of a size that is not a multiple of the interval are cut to multiples of it.
        assert_eq!(
            chunks(200, 100, a, 0),
            [(0, 64), (64, 128), (128, 192), (192, 200)]
        );
        assert_eq!(prefill_chunk(5, 5, 16, a), 5..5);
    }

    #[test]
    fn a_stride_cuts_long_chunks_at_each_of_its_multiples() {
        let s = every(64, Some(128));
        // Every multiple of 128 ends a chunk (a snapshot there), and the last multiple of 64
        // before the end still does.
        assert_eq!(
            chunks(600, 512, s, 0),
            [
                (0, 128),
                (128, 256),
                (256, 384),
                (384, 512),
                (512, 576),
                (576, 600)
            ]
        );
        // Resumed at a multiple of the interval, the next chunk ends at the next stride multiple,
        // so later chunks fall as in the cold run.
        assert_eq!(chunks(300, 512, s, 64), [(64, 128), (128, 256), (256, 300)]);
        // Chunks shorter than the stride are unchanged but for the stride's multiples.
        assert_eq!(
            chunks(140, 37, s, 0),
            [(0, 37), (37, 64), (64, 101), (101, 128), (128, 140)]
        );
        assert_eq!(
            chunks(100, 512, every(64, Some(64)), 0),
            [(0, 64), (64, 100)]
        );
    }

    /// The mixed chunks of a prompt of `len` from `from` when the decode rows leave `budget`.
    fn mixed(
        len: usize,
        chunk: usize,
        budget: usize,
        cuts: Option<ChunkCuts>,
        from: usize,
    ) -> Vec<(usize, usize)> {
        walk(len, from, |at| mixed_chunk(at, len, chunk, budget, cuts))
    }

    #[test]
    fn mixed_chunks_take_the_budget_left_and_cut_hybrid_prompts_only_where_allowed() {
        // Dense: the budget the decode rows leave, at least one row.
        assert_eq!(mixed(20, 16, 7, None, 0), [(0, 7), (7, 14), (14, 20)]);
        assert_eq!(mixed(3, 16, 0, None, 0), [(0, 1), (1, 2), (2, 3)]);
        assert_eq!(mixed(20, 16, 30, None, 0), [(0, 16), (16, 20)]);
        let a = every(64, None);
        // Hybrid, budget past the interval: pieces end at multiples of it, then the tail.
        assert_eq!(
            mixed(300, 512, 150, a, 0),
            [(0, 128), (128, 256), (256, 300)]
        );
        // A budget below the interval: the piece runs to the next multiple (over budget).
        assert_eq!(mixed(150, 512, 10, a, 0), [(0, 64), (64, 128), (128, 150)]);
        // Chunks smaller than the interval are never split: they are cuts of the cold run.
        assert_eq!(
            mixed(140, 37, 20, a, 0),
            chunks(140, 37, a, 0),
            "a piece of a small chunk would be a cut the alternating run does not make"
        );
        // Every cut that is not a multiple of the interval is one of the alternating run's.
        for (len, chunk, budget) in [(1100, 512, 100), (1100, 100, 70), (333, 48, 5)] {
            let cold: Vec<usize> = chunks(len, chunk, a, 0).iter().map(|c| c.1).collect();
            for (_, end) in mixed(len, chunk, budget, a, 0) {
                assert!(
                    end % 64 == 0 || cold.contains(&end),
                    "{len}/{chunk}/{budget}: a cut at {end}"
                );
            }
        }
    }

    #[test]
    fn rows_within_attention_are_the_most_whose_key_reads_fit() {
        let work = |r: usize, p: usize| (r * p + r * (r + 1) / 2) as u128;
        let cases = [
            (0, 0),
            (0, 1),
            (0, 3),
            (0, 8000),
            (128, 8000),
            (16_384, 500_000),
            (0, usize::MAX),
        ];
        for (start, pairs) in cases {
            let r = rows_within_attention(start, pairs);
            let (r, fits) = (r as u128, pairs as u128);
            let work = |r: u128| r * start as u128 + r * (r + 1) / 2;
            assert!(r == 1 || work(r) <= fits, "{start} {pairs}: {r}");
            assert!(work(r + 1) > fits, "{start} {pairs}: {r} is not the most");
        }
        assert_eq!(rows_within_attention(0, 3), 2);
        assert_eq!(rows_within_attention(128, 8000), 51);
        assert!(work(51, 128) <= 8000 && work(52, 128) > 8000);
        assert_eq!(rows_within_attention(10, 0), 1);
    }

    #[test]
    fn the_snapshot_interval_is_a_multiple_of_the_block_and_of_the_gdn_chunk() {
        assert_eq!(snapshot_interval(16), 64);
        assert_eq!(snapshot_interval(64), 64);
        assert_eq!(snapshot_interval(48), 192);
        assert_eq!(snapshot_interval(128), 128);
    }
}
