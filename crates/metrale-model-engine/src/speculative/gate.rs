//! `SpeculationGate`: whether the scheduler's next decode steps speculate. Speculation pays when
//! a step is bound by reading the weights (small batches) and costs when it is bound by compute
//! (large batches, low acceptance), so the scheduler measures both and keeps the faster, for
//! each batch width apart: the decode steps of `n` running sequences count toward the width
//! class `n.next_power_of_two()` (1, 2, 4, 8, ...), and each class decides on its own
//! measurements, so speculation can stay on at batch 1 and off at batch 32.
//!
//! Within a class the gate keeps a moving average of the tokens per second of decode steps of
//! each mode (a step's generated tokens over its time, the drafting after it included): the mean
//! of its first `ema_steps` samples, then exponential with weight `1 / ema_steps` per step. While
//! one mode runs, every so many of its
//! steps the class runs `probe_steps` steps of the other mode, so both averages stay current
//! (the first probe comes as soon as the first mode has `probe_steps` samples); a probe measures
//! the other mode afresh, its average restarted, since steps run a period ago say little about
//! the load now. It switches mode
//! when the other mode's average beats the current one's by more than `margin_percent` (a band
//! of twice that inside which it stays put, so it does not flap between modes of about equal
//! speed), and only once both averages have at least `probe_steps` samples. A class not met yet
//! speculates.
//!
//! Probes back off: the steps between two probes start at `probe_every` and double after each
//! probe that leaves the mode as it was, up to `probe_every_max`; a switch starts them over. A
//! probe of the slower mode costs its steps' difference (with a drafter that accepts nothing, a
//! verify step and its drafts for one token each), so a class settled on one mode pays less and
//! less for asking again.
//!
//! The averages mix whatever steps of the class ran; probes keep them recent, so after a change
//! of load the gate follows within a probe period or two (`probe_every_max` steps at most).
//!
//! Acceptance: the gate also keeps the rate at which first drafts are accepted, over about the
//! last `ACCEPTANCE_WINDOW` checks, from the verify steps and from checks a drafter makes while
//! nothing drafts (the MTP head scores the rows it held back against the tokens the model chose
//! since). Speculation with `K` drafts accepted at rate `a` each keeps `a + a^2 + ... + a^K`
//! drafts a verify on average (a chain stops at its first rejection), and a verify step never
//! costs less than a plain step of the same width, so when that sum is within the margin
//! speculation cannot win: the gate calls the acceptance hopeless. With `check_before_probe`, the
//! gate asks the scheduler for checks of the prompt rows taken in (`wants_acceptance`) until it
//! has `ACCEPTANCE_MIN_CHECKS`, so the first prompts can answer before any verify step, and a
//! probe of speculation that comes due first waits for a check of every row held back
//! (`wants_check`; both answered by `checked`); a hopeless answer skips the probe as one that
//! confirmed the mode (the period doubles), any other starts it. A class met while the
//! acceptance is hopeless starts with speculation off, and a class speculating turns it off as
//! soon as it is. A drafter that accepts nothing then costs checks (the first prompts', then one
//! a probe period), and verify steps only until the gate has `ACCEPTANCE_MIN_CHECKS` first
//! drafts checked.
//!
//! Invariants:
//! - The gate reads no clock: the scheduler hands it each step's duration from its `Clock`
//!   (tests inject one).
//! - With `enabled` false it always speculates (the model was built for it).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// Settings of the gate. Every field has a documented default.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct GateOptions {
    /// Measure and switch (true), or always speculate (false). Default true.
    pub enabled: bool,
    /// Switch when the other mode's tokens/s exceed the current mode's by more than this many
    /// percent. Default 5.
    pub margin_percent: u32,
    /// Steps the moving averages span (each step weighs `1 / ema_steps`). Default 16.
    pub ema_steps: u32,
    /// Steps of the current mode before the first probe of the other after a switch (or after
    /// the class's first measurements). Default 128.
    pub probe_every: usize,
    /// The most steps between two probes once they back off (each probe that does not switch
    /// the mode doubles the period, from `probe_every`). Default 1024.
    pub probe_every_max: usize,
    /// Steps each probe runs. Default 8.
    pub probe_steps: usize,
    /// Before a probe of speculation, have the drafter check its first drafts against tokens
    /// already chosen (where it can), and skip the probe while the acceptance is hopeless; start
    /// a class met while it is hopeless with speculation off (see the module header). Default
    /// true.
    pub check_before_probe: bool,
}

impl Default for GateOptions {
    fn default() -> Self {
        GateOptions {
            enabled: true,
            margin_percent: 5,
            ema_steps: 16,
            probe_every: 128,
            probe_every_max: 1024,
            probe_steps: 8,
            check_before_probe: true,
        }
    }
}

impl GateOptions {
    /// Set `enabled` (false: always speculate).
    pub fn enabled(mut self, on: bool) -> Self {
        self.enabled = on;
        self
    }

    /// Set `margin_percent`.
    pub fn margin_percent(mut self, percent: u32) -> Self {
        self.margin_percent = percent;
        self
    }

    /// Set `ema_steps`.
    pub fn ema_steps(mut self, steps: u32) -> Self {
        self.ema_steps = steps;
        self
    }

    /// Set `probe_every`.
    pub fn probe_every(mut self, steps: usize) -> Self {
        self.probe_every = steps;
        self
    }

    /// Set `probe_every_max`.
    pub fn probe_every_max(mut self, steps: usize) -> Self {
        self.probe_every_max = steps;
        self
    }

    /// Set `probe_steps`.
    pub fn probe_steps(mut self, steps: usize) -> Self {
        self.probe_steps = steps;
        self
    }

    /// Set `check_before_probe`.
    pub fn check_before_probe(mut self, on: bool) -> Self {
        self.check_before_probe = on;
        self
    }
}

/// First-draft checks the acceptance rate spans (older ones fade out).
pub const ACCEPTANCE_WINDOW: f64 = 512.0;

/// First-draft checks the gate needs before it calls the acceptance hopeless.
pub const ACCEPTANCE_MIN_CHECKS: f64 = 32.0;

/// The rate at which first drafts are accepted, over about the last `ACCEPTANCE_WINDOW` checks.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Acceptance {
    checked: f64,
    accepted: f64,
}

impl Acceptance {
    fn add(&mut self, checked: usize, accepted: usize) {
        self.checked += checked as f64;
        self.accepted += accepted.min(checked) as f64;
        if self.checked > ACCEPTANCE_WINDOW {
            let keep = ACCEPTANCE_WINDOW / self.checked;
            self.checked *= keep;
            self.accepted *= keep;
        }
    }

    /// Drafts a verify keeps on average with `k` drafts: `a + a^2 + ... + a^k`.
    fn kept(&self, k: usize) -> f64 {
        let a = self.accepted / self.checked.max(1.0);
        (1..=k as i32).map(|i| a.powi(i)).sum()
    }
}

/// Where the scheduler reads time (the wall clock by default; tests inject their own).
pub trait Clock: Send + std::fmt::Debug {
    /// Time since some fixed instant.
    fn now(&self) -> Duration;
}

/// The wall clock.
#[derive(Debug, Clone, Copy)]
pub struct WallClock(Instant);

impl Default for WallClock {
    fn default() -> Self {
        WallClock(Instant::now())
    }
}

impl Clock for WallClock {
    fn now(&self) -> Duration {
        self.0.elapsed()
    }
}

/// One mode's moving average.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Rate {
    tok_s: f64,
    samples: usize,
}

impl Rate {
    fn add(&mut self, tok_s: f64, ema_steps: u32) {
        self.samples += 1;
        let weight = self.samples.min(ema_steps.max(1) as usize);
        self.tok_s += (tok_s - self.tok_s) / weight as f64;
    }
}

/// One width class's state: its chosen mode, its probes and its two averages.
#[derive(Debug, Clone, PartialEq)]
struct ClassGate {
    /// The mode the class has chosen (probes aside).
    on: bool,
    /// Steps of the chosen mode since the last probe.
    since_probe: usize,
    /// Steps of the chosen mode between probes now (0: `probe_every`, not backed off yet).
    period: usize,
    /// Probe steps left to run in the other mode.
    probe_left: usize,
    /// A probe of speculation is due and waits for a check of the acceptance.
    check_due: bool,
    /// Averages without (0) and with (1) speculation.
    rates: [Rate; 2],
    switches: u64,
}

impl Default for ClassGate {
    fn default() -> Self {
        ClassGate {
            on: true,
            since_probe: 0,
            period: 0,
            probe_left: 0,
            check_due: false,
            rates: [Rate::default(); 2],
            switches: 0,
        }
    }
}

impl ClassGate {
    fn speculating(&self) -> bool {
        self.on != (self.probe_left > 0)
    }

    fn record(&mut self, opts: &GateOptions, speculative: bool, tokens: usize, elapsed: Duration) {
        let secs = elapsed.as_secs_f64();
        if secs > 0.0 {
            self.rates[usize::from(speculative)].add(tokens as f64 / secs, opts.ema_steps);
        }
        let mut probe_ended = false;
        if self.probe_left > 0 {
            if speculative != self.on {
                self.probe_left -= 1;
                probe_ended = self.probe_left == 0;
            }
        } else if speculative == self.on && !self.check_due {
            self.since_probe += 1;
            if self.since_probe >= self.period(opts) {
                self.since_probe = 0;
                self.probe_due(opts);
            }
        }
        let switches = self.switches;
        self.decide(opts);
        if probe_ended && self.switches == switches {
            self.back_off(opts);
        }
    }

    /// A probe of the other mode is due: it starts, or waits for a check of the acceptance
    /// (`check_before_probe`, a probe of speculation).
    fn probe_due(&mut self, opts: &GateOptions) {
        if opts.check_before_probe && !self.on {
            self.check_due = true;
        } else {
            self.start_probe(opts);
        }
    }

    /// Run the other mode for `probe_steps` steps, its average restarted.
    fn start_probe(&mut self, opts: &GateOptions) {
        self.probe_left = opts.probe_steps.max(1);
        self.rates[usize::from(!self.on)] = Rate::default();
    }

    /// The probe confirmed the mode (or was skipped): ask again later.
    fn back_off(&mut self, opts: &GateOptions) {
        let max = opts.probe_every_max.max(opts.probe_every).max(1);
        self.period = self.period(opts).saturating_mul(2).min(max);
    }

    /// The check a due probe waited for came back: skip the probe while the acceptance is
    /// hopeless, else start it.
    fn checked(&mut self, opts: &GateOptions, hopeless: bool) {
        self.check_due = false;
        self.since_probe = 0;
        if hopeless {
            self.back_off(opts);
        } else {
            self.start_probe(opts);
        }
    }

    /// Steps of the chosen mode between two probes now.
    fn period(&self, opts: &GateOptions) -> usize {
        if self.period == 0 {
            opts.probe_every.max(1)
        } else {
            self.period
        }
    }

    /// Switch when the other mode is faster by more than the margin.
    fn decide(&mut self, opts: &GateOptions) {
        let enough = opts.probe_steps.max(1);
        let [off, on] = self.rates;
        if off.samples < enough || on.samples < enough {
            // The first probe of the other mode comes at once, not after `probe_every`.
            // (Unless a probe came and was skipped: then the period runs, backed off.)
            let other = self.rates[usize::from(!self.on)].samples;
            if self.probe_left == 0 && !self.check_due && other == 0 && self.period == 0 {
                let mine = self.rates[usize::from(self.on)].samples;
                if mine >= enough {
                    self.since_probe = 0;
                    self.probe_due(opts);
                }
            }
            return;
        }
        let (mine, other) = if self.on { (on, off) } else { (off, on) };
        if other.tok_s > mine.tok_s * (1.0 + f64::from(opts.margin_percent) / 100.0) {
            self.switch();
        }
    }

    /// Change the mode; the probes start over.
    fn switch(&mut self) {
        self.on = !self.on;
        self.switches += 1;
        self.since_probe = 0;
        self.period = 0;
        self.probe_left = 0;
        self.check_due = false;
    }
}

/// See the module header.
#[derive(Debug, Clone, PartialEq)]
pub struct SpeculationGate {
    opts: GateOptions,
    /// Drafts a verify step checks (`K`).
    drafts: usize,
    /// Each width class met so far, by class (a power of two).
    classes: BTreeMap<usize, ClassGate>,
    /// The class of the last step recorded.
    last: usize,
    acceptance: Acceptance,
}

/// The width class of a decode step of `width` sequences: the next power of two.
fn width_class(width: usize) -> usize {
    width.max(1).next_power_of_two()
}

impl SpeculationGate {
    /// A gate for verify steps of `drafts` drafts a sequence that starts speculating at every
    /// width.
    pub fn new(opts: GateOptions, drafts: usize) -> SpeculationGate {
        SpeculationGate {
            opts,
            drafts,
            classes: BTreeMap::new(),
            last: 1,
            acceptance: Acceptance::default(),
        }
    }

    /// Whether the next decode step of `width` sequences speculates: its class's chosen mode,
    /// or the other while the class probes.
    pub fn speculating(&self, width: usize) -> bool {
        self.class_or_new(width, ClassGate::speculating)
    }

    /// The mode the class of `width` has chosen, probes aside.
    pub fn is_on(&self, width: usize) -> bool {
        self.class_or_new(width, |c| c.on)
    }

    /// `of` the class of `width`, or for a class not met yet the mode it would start in (off
    /// while the acceptance is hopeless); always on when the gate is disabled.
    fn class_or_new(&self, width: usize, of: impl Fn(&ClassGate) -> bool) -> bool {
        if !self.opts.enabled {
            return true;
        }
        (self.classes.get(&width_class(width))).map_or_else(|| !self.hopeless(), of)
    }

    /// First drafts checked against the model's own tokens (by verify steps or by the
    /// drafter's checks) and how many of them it accepted.
    pub fn record_first_drafts(&mut self, checked: usize, accepted: usize) {
        self.acceptance.add(checked, accepted);
    }

    /// The first-draft acceptance rate over the recent checks (`None` before any).
    pub fn acceptance(&self) -> Option<f64> {
        let a = self.acceptance;
        (a.checked > 0.0).then(|| a.accepted / a.checked)
    }

    /// Whether the acceptance measured leaves speculation no way to beat plain decoding by the
    /// margin, even at a verify step's lowest cost (see the module header).
    pub fn hopeless(&self) -> bool {
        let a = self.acceptance;
        self.opts.check_before_probe
            && a.checked >= ACCEPTANCE_MIN_CHECKS
            && a.kept(self.drafts) <= f64::from(self.opts.margin_percent) / 100.0
    }

    /// Whether the class of `width` waits for a check of the acceptance before a probe of
    /// speculation: the scheduler then has the drafter check its first drafts, the rows it
    /// holds back included, and reports with `checked`.
    pub fn wants_check(&self, width: usize) -> bool {
        self.opts.enabled && (self.classes.get(&width_class(width))).is_some_and(|c| c.check_due)
    }

    /// Whether the gate still has fewer than `ACCEPTANCE_MIN_CHECKS` first drafts checked (with
    /// `check_before_probe`): the scheduler then has the drafter check the rows it takes in
    /// whose token after next is known (prompt rows), so the first prompts can answer before any
    /// verify step, and reports with `checked`.
    pub fn wants_acceptance(&self) -> bool {
        self.opts.enabled
            && self.opts.check_before_probe
            && self.acceptance.checked < ACCEPTANCE_MIN_CHECKS
    }

    /// A check the gate asked for (`wants_check` of `width`, or `wants_acceptance`):
    /// `Some((checked, accepted))` first drafts, or `None` when the drafter cannot check. Where
    /// the class of `width` waits for it, skips the due probe while the acceptance is hopeless,
    /// else starts it; a check of no drafts (nothing to check yet) leaves it due.
    pub fn checked(&mut self, width: usize, outcome: Option<(usize, usize)>) {
        if let Some((checked, accepted)) = outcome {
            if checked == 0 {
                return;
            }
            self.record_first_drafts(checked, accepted);
        }
        let hopeless = outcome.is_some() && self.hopeless();
        if let Some(c) = self.classes.get_mut(&width_class(width))
            && c.check_due
        {
            c.checked(&self.opts, hopeless);
        }
    }

    /// Times a class changed its mind, all classes together.
    pub fn switches(&self) -> u64 {
        self.classes.values().map(|c| c.switches).sum()
    }

    /// The width class of the last decode step recorded (1 before any).
    pub fn last_class(&self) -> usize {
        self.last
    }

    /// The class of `width`'s moving averages of tokens/s without and with speculation
    /// (`None` before a sample).
    pub fn rates(&self, width: usize) -> (Option<f64>, Option<f64>) {
        let Some(c) = self.classes.get(&width_class(width)) else {
            return (None, None);
        };
        let r = |x: Rate| (x.samples > 0).then_some(x.tok_s);
        (r(c.rates[0]), r(c.rates[1]))
    }

    /// A decode step of `width` sequences ran, speculating or not, and generated `tokens` in
    /// `elapsed`.
    pub fn record(&mut self, width: usize, speculative: bool, tokens: usize, elapsed: Duration) {
        if !self.opts.enabled {
            return;
        }
        self.last = width_class(width);
        let hopeless = self.hopeless();
        let class = (self.classes.entry(self.last)).or_insert_with(|| ClassGate {
            on: !hopeless,
            ..ClassGate::default()
        });
        class.record(&self.opts, speculative, tokens, elapsed);
        if hopeless && class.on {
            class.switch();
        }
    }
}

#[cfg(test)]
mod tests;
