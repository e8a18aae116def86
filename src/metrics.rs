//! `EngineMetrics`: a snapshot of what the engine is doing, and `MetricsState`, where the
//! scheduler thread records it after every step (tokens per step over a sliding window for the
//! throughput figure).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use metrale_model_engine::scheduler::{CacheUsage, SchedulerStats, StepCounts};

/// A snapshot of the engine's counters and resource use.
#[derive(Debug, Clone, PartialEq, Default)]
#[non_exhaustive]
pub struct EngineMetrics {
    /// Requests running, queued, finished and failed.
    pub requests: RequestCounts,
    /// Tokens generated per second over the last `EngineOptions::metrics_window`.
    pub tokens_per_second: f64,
    /// What the model's steps ran and produced since load: steps of each kind, tokens
    /// generated, prompt tokens prefilled, conversation tokens re-prefilled (hybrid models,
    /// `ModelOptions::reprefill_answers`), preemptions, prefix-cache lookups and hits.
    pub steps: StepCounts,
    /// Re-prefills of finished conversations running or queued (not requests: not in
    /// `requests`).
    pub reprefills: usize,
    /// `steps.prefix.hit_tokens / steps.prefix.query_tokens`: the share of looked-up prompt
    /// tokens the prefix cache served (0 before any lookup).
    pub prefix_hit_rate: f64,
    /// The KV blocks, SSM slots and SSM snapshots in use now.
    pub cache: CacheUsage,
    /// Speculative decoding's acceptance and gate; `None` when the engine does not speculate.
    pub speculation: Option<SpeculationMetrics>,
}

/// Requests by state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct RequestCounts {
    /// Sequences admitted to the model and not finished: a request of `n` choices counts one
    /// per choice once they have forked.
    pub running: usize,
    /// Requests submitted and not yet admitted (preempted ones included).
    pub queued: usize,
    /// Requests that finished with an output (any finish reason, `cancelled` included).
    pub finished: u64,
    /// Requests that ended with an error after they were accepted (a failed step, shutdown).
    pub failed: u64,
}

/// Speculative decoding since load.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
#[non_exhaustive]
pub struct SpeculationMetrics {
    /// Drafts the model checked.
    pub drafted: u64,
    /// Of those, the drafts it accepted.
    pub accepted: u64,
    /// `accepted / drafted` (0 before any draft).
    pub acceptance_rate: f64,
    /// Tokens per sequence verify that checked drafts: `1 + accepted / verifies` (0 before
    /// any).
    pub mean_acceptance_length: f64,
    /// Whether the gate has speculation on at the batch width class (running sequences rounded
    /// up to a power of two) of the last decode step.
    pub on: bool,
    /// Times the gate switched speculation on or off, every width class together.
    pub switches: u64,
    /// The gate's moving average of decode tokens/s without speculation at that width class,
    /// once measured.
    pub plain_decode_tok_s: Option<f64>,
    /// The same with speculation.
    pub speculative_decode_tok_s: Option<f64>,
}

fn ratio(a: u64, b: u64) -> f64 {
    if b > 0 { a as f64 / b as f64 } else { 0.0 }
}

/// What the scheduler thread last recorded.
#[derive(Debug)]
pub(crate) struct MetricsState {
    window: Duration,
    started: Instant,
    /// (when, tokens generated in that step), oldest first, within `window`.
    recent: VecDeque<(Instant, u64)>,
    stats: SchedulerStats,
    finished: u64,
    failed: u64,
}

impl MetricsState {
    pub(crate) fn new(window: Duration, stats: SchedulerStats) -> MetricsState {
        MetricsState {
            window,
            started: Instant::now(),
            recent: VecDeque::new(),
            stats,
            finished: 0,
            failed: 0,
        }
    }

    /// Record the scheduler's state after a step, and the requests that finished or failed
    /// since the last record.
    pub(crate) fn record(&mut self, stats: SchedulerStats, finished: u64, failed: u64) {
        let now = Instant::now();
        let new_tokens =
            (stats.steps.tokens_generated).saturating_sub(self.stats.steps.tokens_generated);
        if new_tokens > 0 {
            self.recent.push_back((now, new_tokens));
        }
        self.prune(now);
        self.stats = stats;
        self.finished += finished;
        self.failed += failed;
    }

    fn prune(&mut self, now: Instant) {
        while let Some(&(t, _)) = self.recent.front() {
            if now.duration_since(t) > self.window {
                self.recent.pop_front();
            } else {
                break;
            }
        }
    }

    /// The metrics now; `inbox` is the submissions the scheduler thread has not taken yet.
    pub(crate) fn snapshot(&mut self, inbox: usize) -> EngineMetrics {
        let now = Instant::now();
        self.prune(now);
        let span = self
            .window
            .min(now.duration_since(self.started))
            .as_secs_f64();
        let tokens: u64 = self.recent.iter().map(|&(_, n)| n).sum();
        let s = &self.stats;
        let prefix = s.steps.prefix;
        EngineMetrics {
            requests: RequestCounts {
                running: s.running,
                queued: s.waiting + inbox,
                finished: self.finished,
                failed: self.failed,
            },
            tokens_per_second: if span > 0.0 {
                tokens as f64 / span
            } else {
                0.0
            },
            steps: s.steps,
            reprefills: s.reprefills,
            prefix_hit_rate: ratio(prefix.hit_tokens, prefix.query_tokens),
            cache: s.cache,
            speculation: s.speculation.as_ref().map(|sp| {
                let (drafted, accepted) = (sp.drafted() as u64, sp.accepted() as u64);
                let verifies = sp.draft_verifies() as u64;
                SpeculationMetrics {
                    drafted,
                    accepted,
                    acceptance_rate: ratio(accepted, drafted),
                    mean_acceptance_length: if verifies > 0 {
                        1.0 + ratio(accepted, verifies)
                    } else {
                        0.0
                    },
                    on: sp.on,
                    switches: sp.switches,
                    plain_decode_tok_s: sp.plain_tok_s,
                    speculative_decode_tok_s: sp.speculative_tok_s,
                }
            }),
        }
    }
}
