//! Which drafts a sequence keeps after a verify step, and the token that follows them.
//!
//! Greedy (temperature 0 or top-k 1): drafts are kept while each equals the argmax of the row
//! before it; the first that does not is replaced by that argmax, and if all are kept the last
//! row's argmax follows. These are the tokens plain greedy decoding picks.
//!
//! Sampling: the drafts are a one-hot proposal `q = δ_d`. Draft `d` of row `t` is kept with
//! probability `min(1, p_t(d) / q(d)) = p_t(d)`, `p_t` being the distribution plain sampling
//! would draw from that row (temperature, top-k, top-p); a rejected draft is replaced by a draw
//! from `max(0, p_t - q)` normalised, i.e. `p_t` without `d`. So each emitted token is `d` with
//! probability `p_t(d)` and `x ≠ d` with `(1 - p_t(d)) · p_t(x) / (1 - p_t(d)) = p_t(x)`: the
//! plain distribution, whatever the drafts (the tokens differ from a plain run's, whose random
//! numbers are spent differently).

use crate::sampling::{Sampler, argmax};

/// The outcome of one sequence's verify step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// The tokens to emit: the kept drafts, then the model's own token.
    pub tokens: Vec<u32>,
    /// Drafts kept (`tokens.len() - 1`).
    pub accepted: usize,
}

/// Greedy acceptance from the verify rows' argmax (`drafts.len() + 1` tokens, the device's):
/// what [`verify_drafts`] picks for a greedy sampler, without the logits on the host.
pub fn verify_greedy(argmax: &[u32], drafts: &[u32]) -> Verdict {
    let mut tokens = Vec::with_capacity(drafts.len() + 1);
    for (t, &g) in argmax.iter().enumerate() {
        tokens.push(g);
        if drafts.get(t) != Some(&g) {
            break;
        }
    }
    Verdict {
        accepted: tokens.len().saturating_sub(1),
        tokens,
    }
}

/// Check `drafts` against the verify rows' logits `rows` (`drafts.len() + 1` rows: row `t`
/// predicts the token after the `t`-th verify input, which draft `t` proposes).
pub fn verify_drafts(sampler: &mut Sampler, rows: &[Vec<f32>], drafts: &[u32]) -> Verdict {
    let mut tokens = Vec::with_capacity(drafts.len() + 1);
    for (t, &d) in drafts.iter().enumerate() {
        let Some(row) = rows.get(t) else { break };
        if sampler.is_greedy() {
            let g = argmax(row);
            tokens.push(g);
            if g != d {
                return Verdict {
                    accepted: t,
                    tokens,
                };
            }
            continue;
        }
        let dist = sampler.distribution(row);
        let p = dist.iter().find(|e| e.0 == d).map_or(0.0, |e| e.1);
        if sampler.uniform() < p {
            tokens.push(d);
            continue;
        }
        let rest: Vec<(u32, f64)> = dist.into_iter().filter(|e| e.0 != d).collect();
        let total: f64 = rest.iter().map(|e| e.1).sum();
        if rest.is_empty() || total <= 0.0 {
            // `d` held all the mass, yet the draw missed it by rounding: keep it.
            tokens.push(d);
            continue;
        }
        let rest: Vec<(u32, f64)> = rest.into_iter().map(|(x, q)| (x, q / total)).collect();
        tokens.push(sampler.draw(&rest));
        return Verdict {
            accepted: t,
            tokens,
        };
    }
    let accepted = tokens.len();
    if let Some(row) = rows.get(accepted) {
        tokens.push(sampler.sample(row));
    }
    Verdict { tokens, accepted }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::SamplingParams;

    fn row0() -> Vec<f32> {
        vec![1.2, -0.3, 0.8, 2.0, -1.5, 0.1]
    }

    fn row1() -> Vec<f32> {
        vec![-0.4, 0.9, 0.2, -1.0, 1.4, 0.0]
    }

    #[test]
    fn greedy_keeps_drafts_up_to_the_first_disagreement() {
        let mut s = Sampler::new(SamplingParams::default());
        let rows = vec![row0(), row1(), row0()];
        // argmax: row0 -> 3, row1 -> 4.
        let all = verify_drafts(&mut s, &rows, &[3, 4]);
        assert_eq!(
            all,
            Verdict {
                tokens: vec![3, 4, 3],
                accepted: 2
            }
        );
        let second_wrong = verify_drafts(&mut s, &rows, &[3, 0]);
        assert_eq!(
            second_wrong,
            Verdict {
                tokens: vec![3, 4],
                accepted: 1
            }
        );
        let first_wrong = verify_drafts(&mut s, &rows, &[5, 4]);
        assert_eq!(
            first_wrong,
            Verdict {
                tokens: vec![3],
                accepted: 0
            }
        );
        // The device's argmax gives the same verdicts.
        let argmax = [3, 4, 3];
        assert_eq!(verify_greedy(&argmax, &[3, 4]), all);
        assert_eq!(verify_greedy(&argmax, &[3, 0]), second_wrong);
        assert_eq!(verify_greedy(&argmax, &[5, 4]), first_wrong);
        assert_eq!(verify_greedy(&argmax[..1], &[]).tokens, vec![3]);
        let none = verify_drafts(&mut s, &rows[..1], &[]);
        assert_eq!(
            none,
            Verdict {
                tokens: vec![3],
                accepted: 0
            }
        );
    }

    /// Total-variation distance between a histogram of `n` draws and a distribution.
    fn tv(counts: &[usize], n: usize, dist: &[(u32, f64)]) -> f64 {
        let mut want = vec![0.0; counts.len()];
        for &(x, p) in dist {
            want[x as usize] = p;
        }
        0.5 * counts
            .iter()
            .zip(&want)
            .map(|(&c, &p)| (c as f64 / n as f64 - p).abs())
            .sum::<f64>()
    }

    /// Rejection sampling emits the plain distribution, whatever the draft: the first token
    /// follows row 0's distribution, a draft is kept as often as that distribution picks it,
    /// and after a kept draft the next token follows row 1's. 200k trials per case: the
    /// total-variation noise is about 0.002, the tolerance 0.006; an always-kept draft or an
    /// unnormalised residual errs by 0.1 or more.
    #[test]
    fn rejection_sampling_emits_the_plain_distribution() {
        const N: usize = 200_000;
        let cases = [
            (SamplingParams::default().temperature(0.9).seed(1), 3u32),
            (SamplingParams::default().temperature(0.9).seed(2), 1),
            (
                SamplingParams::default().temperature(1.3).top_k(4).seed(3),
                4,
            ),
            (
                SamplingParams::default().temperature(1.0).top_k(4).seed(4),
                2,
            ),
            (
                SamplingParams::default()
                    .temperature(0.7)
                    .top_p(0.8)
                    .seed(5),
                0,
            ),
        ];
        let rows = vec![row0(), row1()];
        for (params, draft) in cases {
            let mut s = Sampler::new(params.clone());
            let (p0, p1) = (s.distribution(&rows[0]), s.distribution(&rows[1]));
            let (mut first, mut after, mut kept) = (vec![0usize; 6], vec![0usize; 6], 0usize);
            for _ in 0..N {
                let v = verify_drafts(&mut s, &rows, &[draft]);
                first[v.tokens[0] as usize] += 1;
                if v.accepted == 1 {
                    kept += 1;
                    after[v.tokens[1] as usize] += 1;
                }
            }
            let what = format!("{params:?}, draft {draft}");
            let e0 = tv(&first, N, &p0);
            assert!(e0 < 0.006, "{what}: first token TV {e0:.4}");
            let pd = p0.iter().find(|e| e.0 == draft).map_or(0.0, |e| e.1);
            let rate = kept as f64 / N as f64;
            assert!(
                (rate - pd).abs() < 0.006,
                "{what}: kept {rate:.4}, p(draft) {pd:.4}"
            );
            if kept > 20_000 {
                let e1 = tv(&after, kept, &p1);
                assert!(e1 < 0.015, "{what}: token after a kept draft TV {e1:.4}");
            }
        }
    }
}
