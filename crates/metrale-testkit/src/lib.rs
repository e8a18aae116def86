//! What the tests, the benchmarks and the soak share: [`Rng`], the one seeded generator of their
//! random inputs (values, token ids, shapes, request plans), and [`checkpoint`]: a tiny
//! random-weight Qwen3 with the real Qwen3 tokenizer and chat template.
//!
//! Invariants: the sequence a seed gives is fixed (SplitMix64, with the seed mixed the same way
//! on every platform), so a failing test fails again with the same inputs; nothing here reads
//! the clock or the environment. It is development code only: no library crate depends on it
//! outside `[dev-dependencies]` (xtask, a tool, depends on it for the soak).

pub mod checkpoint;

use std::ops::RangeInclusive;

use half::bf16;

/// SplitMix64: small, fast, deterministic, and good enough to make neighbouring values of a
/// test input distinct. Not for cryptography, and not the engine's sampler (which has its own).
#[derive(Debug, Clone)]
pub struct Rng {
    state: u64,
}

impl Rng {
    /// The generator for `seed`; every seed, 0 included, gives a well-mixed sequence.
    pub fn new(seed: u64) -> Rng {
        Rng {
            state: seed ^ 0x5DEE_CE66_D1CE_4E5B,
        }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[lo, hi)`, on a grid of 2^24 steps (every step an exact f32 when `lo` and
    /// `hi` are powers of two apart).
    pub fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        let u = (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
        lo + (hi - lo) * u
    }

    /// `n` values uniform in `[lo, hi)`.
    pub fn f32s(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n).map(|_| self.uniform(lo, hi)).collect()
    }

    /// `n` values uniform in `[lo, hi)`, rounded to bf16.
    pub fn bf16s(&mut self, n: usize, lo: f32, hi: f32) -> Vec<bf16> {
        (0..n)
            .map(|_| bf16::from_f32(self.uniform(lo, hi)))
            .collect()
    }

    /// Uniform in `[0, n)` (`n > 0`; the modulo bias is below 2^-32).
    pub fn below(&mut self, n: u32) -> u32 {
        assert!(n > 0, "Rng::below(0)");
        (self.next_u64() % u64::from(n)) as u32
    }

    /// Uniform in `range` (inclusive at both ends; not empty).
    pub fn usize_in(&mut self, range: RangeInclusive<usize>) -> usize {
        let (lo, hi) = range.into_inner();
        assert!(lo <= hi, "Rng::usize_in({lo}..={hi})");
        let span = (hi - lo) as u64;
        if span == u64::MAX {
            return self.next_u64() as usize;
        }
        lo + (self.next_u64() % (span + 1)) as usize
    }

    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        ((self.next_u64() >> 11) as f64 / (1u64 << 53) as f64) < p
    }

    /// A uniformly random permutation of `0..n` (Fisher-Yates).
    pub fn permutation(&mut self, n: u32) -> Vec<u32> {
        let mut v: Vec<u32> = (0..n).collect();
        for i in (1..v.len()).rev() {
            let j = self.below(i as u32 + 1) as usize;
            v.swap(i, j);
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_outputs_are_splitmix64s() {
        // SplitMix64 from state 0 (Vigna's reference): 0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4.
        let mut r = Rng::new(0x5DEE_CE66_D1CE_4E5B);
        assert_eq!(r.next_u64(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(r.next_u64(), 0x6E78_9E6A_A1B9_65F4);
    }

    #[test]
    fn a_seed_gives_one_sequence_and_seeds_differ() {
        let a: Vec<u64> = {
            let mut r = Rng::new(7);
            (0..8).map(|_| r.next_u64()).collect()
        };
        let mut r = Rng::new(7);
        assert!(a.iter().all(|&x| x == r.next_u64()));
        let mut other = Rng::new(8);
        assert!(a.iter().all(|&x| x != other.next_u64()));
    }

    #[test]
    fn values_stay_in_their_ranges_and_spread_over_them() {
        let mut r = Rng::new(1);
        let v = r.f32s(4096, -0.5, 0.25);
        assert!(v.iter().all(|&x| (-0.5..0.25).contains(&x)));
        let (min, max) = v
            .iter()
            .fold((f32::MAX, f32::MIN), |(lo, hi), &x| (lo.min(x), hi.max(x)));
        assert!(min < -0.49 && max > 0.24, "{min} {max}");
        let mean = v.iter().map(|&x| f64::from(x)).sum::<f64>() / v.len() as f64;
        assert!((mean + 0.125).abs() < 0.02, "{mean}");
        let b = r.bf16s(64, 1.0, 2.0);
        assert!(b.iter().all(|x| (1.0..=2.0).contains(&x.to_f32())));
        let mut seen = [0u32; 5];
        for _ in 0..1000 {
            seen[r.below(5) as usize] += 1;
            let u = r.usize_in(3..=4);
            assert!(u == 3 || u == 4);
        }
        assert!(seen.iter().all(|&c| c > 150), "{seen:?}");
        assert_eq!(r.usize_in(9..=9), 9);
    }

    #[test]
    fn chance_follows_its_probability() {
        let mut r = Rng::new(2);
        let hits = (0..10_000).filter(|_| r.chance(0.3)).count();
        assert!((2700..3300).contains(&hits), "{hits}");
        assert!(!(0..100).any(|_| r.chance(0.0)));
        assert!((0..100).all(|_| r.chance(1.0)));
    }

    #[test]
    fn a_permutation_holds_every_index_once() {
        let mut r = Rng::new(3);
        let p = r.permutation(100);
        let mut sorted = p.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..100).collect::<Vec<u32>>());
        assert_ne!(
            p, sorted,
            "100 elements stay in order with probability 1/100!"
        );
        assert!(r.permutation(0).is_empty());
    }
}
