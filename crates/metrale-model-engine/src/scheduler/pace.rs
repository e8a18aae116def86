//! Pacing mixed steps to a wall time (`ModelOptions::mixed_step_slowdown_pct`): a mixed step
//! should take about that percentage of a plain decode step of as many decode rows, so the
//! decoding streams' inter-token gap stays within it while a prompt prefills beside them.
//!
//! What a chunk row costs depends on the model, the GPU and how far into its prompt the chunk
//! is (each row attends to every key before it), so the pacer measures instead of modelling:
//! - A plain decode step's time is kept per padded decode width (the ladder widths, each its
//!   own graph): the shortest of the last few, so a graph's capture or a hiccup of the host is
//!   not taken for the step's cost. Until a width has [`PLAIN_SAMPLES`] of them, mixing waits
//!   and the step runs plain (one decode step of delay for the prompt, once per width).
//! - After each mixed step, the next chunk gets `rows * (target - plain) / (took - plain)`
//!   rows, where the last one had `rows` and took `took`: a step of `f + b * rows` (a fixed
//!   part and a cost a row) converges to the target whenever `f` is below the time the target
//!   allows past the plain step, and tracks `b` as it grows along the prompt. The chunk at most
//!   doubles from one step to the next and starts at [`FIRST_ROWS`].
//!
//! The token budget (`mixed_step_tokens`) and the attention budget (`mixed_chunk_attention`)
//! still bound the chunk, and hybrid models still cut only where allowed (so a chunk may run
//! past the paced rows to the next allowed cut). Tokens and logits do not depend on pacing:
//! chunks of any size compute the same rows (batch invariance), so what the clock reads
//! changes only how many steps a prompt takes. The paced rows carry over from one prompt to
//! the next: a prompt resumed deep into a cached prefix may overrun its first step.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use crate::speculative::{Clock, WallClock};

/// Rows of the first paced chunk, before any mixed step was timed.
const FIRST_ROWS: usize = 16;

/// Plain decode steps a width needs timed before a mixed step of that width is paced: the
/// first step of a width also captures its graph.
const PLAIN_SAMPLES: usize = 2;

/// Plain decode step times kept per width; the shortest of them is the width's cost.
const PLAIN_WINDOW: usize = 8;

/// The most a paced chunk grows from one mixed step to the next.
const MAX_GROWTH: usize = 2;

/// The pacer: the plain decode steps' times by padded width and the last mixed step's.
#[derive(Debug)]
pub(super) struct MixedPacer {
    /// A mixed step's target time, in percent of a plain step's of the same width.
    percent: u32,
    clock: Box<dyn Clock>,
    /// Per padded decode width, the last plain decode steps' times, oldest first.
    plain: HashMap<usize, VecDeque<Duration>>,
    /// The next paced chunk's rows.
    rows: usize,
}

impl MixedPacer {
    /// A pacer aiming mixed steps at `percent` of a plain decode step (more than 100).
    pub(super) fn new(percent: u32) -> MixedPacer {
        MixedPacer {
            percent,
            clock: Box::new(WallClock::default()),
            plain: HashMap::new(),
            rows: FIRST_ROWS,
        }
    }

    /// Read time from `clock` (tests inject one).
    pub(super) fn set_clock(&mut self, clock: Box<dyn Clock>) {
        self.clock = clock;
    }

    /// Now, on the pacer's clock.
    pub(super) fn now(&self) -> Duration {
        self.clock.now()
    }

    /// A plain decode step of padded width `width` that started at `start` just ended.
    pub(super) fn plain_step(&mut self, width: usize, start: Duration) {
        let took = self.clock.now().saturating_sub(start);
        let times = self.plain.entry(width).or_default();
        if times.len() == PLAIN_WINDOW {
            times.pop_front();
        }
        times.push_back(took);
    }

    /// A plain decode step's cost at padded width `width`, once it has been timed enough.
    fn plain_cost(&self, width: usize) -> Option<Duration> {
        let times = self.plain.get(&width)?;
        (times.len() >= PLAIN_SAMPLES).then(|| times.iter().copied().min())?
    }

    /// The paced chunk's rows for a mixed step of padded width `width`; `None` while that
    /// width's plain step has not been timed (the step should run plain).
    pub(super) fn rows(&self, width: usize) -> Option<usize> {
        self.plain_cost(width).map(|_| self.rows)
    }

    /// A mixed step of padded width `width` whose chunk had `rows` rows and that started at
    /// `start` just ended: size the next chunk from its time.
    pub(super) fn mixed_step(&mut self, width: usize, rows: usize, start: Duration) {
        let took = self.clock.now().saturating_sub(start);
        let Some(plain) = self.plain_cost(width) else {
            return;
        };
        let rows = rows.max(1);
        let target = plain.mul_f64(f64::from(self.percent) / 100.0);
        let most = rows.saturating_mul(MAX_GROWTH);
        self.rows = match took.checked_sub(plain) {
            Some(extra) if !extra.is_zero() => {
                let allowed = target.saturating_sub(plain);
                let next = rows as f64 * allowed.as_secs_f64() / extra.as_secs_f64();
                (next.floor() as usize).clamp(1, most)
            }
            // No slower than a plain step: the chunk may grow as fast as it is let.
            _ => most,
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    /// A clock the test sets.
    #[derive(Debug, Clone, Default)]
    struct SetClock(Arc<Mutex<Duration>>);

    impl SetClock {
        fn advance(&self, by: Duration) {
            *self.0.lock().unwrap() += by;
        }
    }

    impl Clock for SetClock {
        fn now(&self) -> Duration {
            *self.0.lock().unwrap()
        }
    }

    fn ms(v: f64) -> Duration {
        Duration::from_secs_f64(v / 1e3)
    }

    /// A pacer on a clock the test moves, with `plain` ms plain steps timed at width 3 (the
    /// first one slow, as a graph capture is).
    fn paced(percent: u32, plain: f64) -> (MixedPacer, SetClock) {
        let clock = SetClock::default();
        let mut p = MixedPacer::new(percent);
        p.set_clock(Box::new(clock.clone()));
        for took in [50.0 * plain, plain, 1.1 * plain] {
            let start = p.now();
            clock.advance(ms(took));
            p.plain_step(3, start);
        }
        (p, clock)
    }

    /// Run mixed steps of cost `cost(rows, position)` ms down a prompt of `len` rows; returns
    /// each step's (rows, ms).
    fn prefill(
        p: &mut MixedPacer,
        clock: &SetClock,
        len: usize,
        cost: impl Fn(usize, usize) -> f64,
    ) -> Vec<(usize, f64)> {
        let (mut pos, mut steps) = (0, Vec::new());
        while pos < len {
            let rows = p.rows(3).unwrap().min(len - pos);
            let took = cost(rows, pos);
            let start = p.now();
            clock.advance(ms(took));
            p.mixed_step(3, rows, start);
            steps.push((rows, took));
            pos += rows;
        }
        steps
    }

    #[test]
    fn a_width_is_paced_only_once_its_plain_steps_are_timed_and_then_from_the_shortest() {
        let clock = SetClock::default();
        let mut p = MixedPacer::new(150);
        p.set_clock(Box::new(clock.clone()));
        assert_eq!(p.rows(0), None, "no plain step timed");
        let start = p.now();
        clock.advance(ms(300.0));
        p.plain_step(0, start);
        assert_eq!(p.rows(0), None, "only the capturing step timed");
        let start = p.now();
        clock.advance(ms(7.0));
        p.plain_step(0, start);
        assert_eq!(p.rows(0), Some(FIRST_ROWS));
        assert_eq!(p.rows(1), None, "another width");
        // A mixed step of 16 rows that took 10.5 ms against 7: the target 10.5 is met, the
        // next chunk keeps its rows; one that took 14 ms (twice the allowed extra) halves.
        let start = p.now();
        clock.advance(ms(10.5));
        p.mixed_step(0, 16, start);
        assert_eq!(p.rows(0), Some(16));
        let start = p.now();
        clock.advance(ms(14.0));
        p.mixed_step(0, 16, start);
        assert_eq!(p.rows(0), Some(8));
        // As fast as a plain step: the chunk doubles, no more.
        let start = p.now();
        clock.advance(ms(6.9));
        p.mixed_step(0, 8, start);
        assert_eq!(p.rows(0), Some(16));
    }

    #[test]
    fn paced_steps_settle_at_the_target_and_follow_a_cost_that_grows_along_the_prompt() {
        // 7 ms plain steps, a mixed step 2 ms of fixed cost plus 0.05 ms a row plus attention
        // growing with the position: the 16,384-row prompt of the interference bench.
        let (mut p, clock) = paced(175, 7.0);
        let cost = |rows: usize, pos: usize| {
            7.0 + 2.0 + rows as f64 * (0.05 + 2e-6 * (pos as f64 + rows as f64 / 2.0))
        };
        let steps = prefill(&mut p, &clock, 16_384, cost);
        let target = 7.0 * 1.75;
        // From the fourth step on, every step is within 5 % of the target.
        for (i, &(rows, took)) in steps.iter().enumerate().skip(4) {
            assert!(
                took <= target * 1.05 && (took >= target * 0.9 || i + 1 == steps.len()),
                "step {i}: {rows} rows took {took} ms against {target}"
            );
        }
        // The chunks shrink as the rows' attention grows.
        let (early, late) = (steps[4].0, steps[steps.len() - 2].0);
        assert!(early > late + late / 2, "{early} then {late} rows");
        // A prompt whose rows cost nothing past a fixed part: the chunks double step by step.
        let (mut p, clock) = paced(200, 7.0);
        let steps = prefill(&mut p, &clock, 2_000, |_, _| 8.0);
        let rows: Vec<usize> = steps.iter().map(|s| s.0).take(4).collect();
        assert_eq!(rows, [16, 32, 64, 128]);
    }
}
