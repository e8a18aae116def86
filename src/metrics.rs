//! `EngineMetrics`: a snapshot of what the engine is doing, and `MetricsState`, where the
//! scheduler thread records it after every step (tokens per step over a sliding window for the
//! throughput figure).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use metrale_model_engine::scheduler::SchedulerStats;

/// A snapshot of the engine's counters and resource use. More figures may come: read the
/// fields (or start from `EngineMetrics::default()`, all zero, and assign them).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
#[non_exhaustive]
pub struct EngineMetrics {
    /// Requests admitted to the model and not finished.
    pub running: usize,
    /// Requests submitted and not yet admitted (preempted ones included).
    pub queued: usize,
    /// Requests that finished with an output (any finish reason, `cancelled` included).
    pub finished: u64,
    /// Requests that ended with an error after they were accepted (a failed step, shutdown).
    pub failed: u64,
    /// Tokens generated since load.
    pub tokens_generated: u64,
    /// Tokens generated per second over the last `EngineOptions::metrics_window`.
    pub tokens_per_second: f64,
    /// Model steps run since load (prefill chunks and decode steps).
    pub steps: u64,
    /// Preemptions by recompute since load.
    pub preemptions: u64,
    /// Prompt tokens computed in prefill steps since load (a preempted request's replay
    /// included; tokens served from the prefix cache excluded).
    pub prefill_tokens: u64,
    /// Prefix-cache lookups since load: one per admission to the model with prefix caching on
    /// (a preempted request's readmission included).
    pub prefix_queries: u64,
    /// Lookups that reused a cached prefix.
    pub prefix_hits: u64,
    /// Prompt tokens of the lookups.
    pub prefix_query_tokens: u64,
    /// Of those, the tokens whose KV cache (and SSM state) came from the prefix cache instead of
    /// being computed.
    pub prefix_hit_tokens: u64,
    /// `prefix_hit_tokens / prefix_query_tokens`: the share of looked-up prompt tokens the cache
    /// served (0 before any lookup).
    pub prefix_hit_rate: f64,
    /// KV-cache blocks referenced by running requests (cached blocks nobody holds are not in
    /// use: they are evicted when blocks are needed).
    pub kv_blocks_used: usize,
    /// KV-cache blocks in the pool (the dummy block excluded).
    pub kv_blocks_total: usize,
    /// KV-cache blocks in the prefix cache, referenced or not.
    pub kv_blocks_cached: usize,
    /// SSM state slots in use (hybrid models; 0 otherwise).
    pub ssm_slots_used: usize,
    /// SSM state slots in the pool (hybrid models; 0 otherwise).
    pub ssm_slots_total: usize,
    /// SSM state snapshots kept for prefix caching (hybrid models; 0 otherwise).
    pub ssm_snapshots_used: usize,
    /// SSM snapshot entries (hybrid models with prefix caching; 0 otherwise).
    pub ssm_snapshots_total: usize,
    /// Verify steps since load (speculative decoding; counted in `steps` too).
    pub verify_steps: u64,
    /// Drafts the model checked since load.
    pub drafted: u64,
    /// Of those, the drafts it accepted.
    pub accepted: u64,
    /// `accepted / drafted` (0 before any draft).
    pub acceptance_rate: f64,
    /// Tokens per sequence verify that checked drafts: `1 + accepted / verifies` (0 before any).
    pub mean_acceptance_length: f64,
    /// Whether the speculation gate has speculation on; `None` when the engine does not
    /// speculate.
    pub speculation_on: Option<bool>,
    /// Times the gate switched speculation on or off.
    pub speculation_switches: u64,
    /// The gate's moving average of decode tokens/s without speculation, once measured.
    pub plain_decode_tok_s: Option<f64>,
    /// The same with speculation.
    pub speculative_decode_tok_s: Option<f64>,
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
        let new_tokens = stats
            .tokens_generated
            .saturating_sub(self.stats.tokens_generated);
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
        EngineMetrics {
            running: s.running,
            queued: s.waiting + inbox,
            finished: self.finished,
            failed: self.failed,
            tokens_generated: s.tokens_generated,
            tokens_per_second: if span > 0.0 {
                tokens as f64 / span
            } else {
                0.0
            },
            steps: s.steps,
            preemptions: s.preemptions,
            prefill_tokens: s.prefill_tokens,
            prefix_queries: s.prefix_queries,
            prefix_hits: s.prefix_hits,
            prefix_query_tokens: s.prefix_query_tokens,
            prefix_hit_tokens: s.prefix_hit_tokens,
            prefix_hit_rate: if s.prefix_query_tokens > 0 {
                s.prefix_hit_tokens as f64 / s.prefix_query_tokens as f64
            } else {
                0.0
            },
            kv_blocks_used: s.kv_blocks_used,
            kv_blocks_total: s.kv_blocks_total,
            kv_blocks_cached: s.kv_blocks_cached,
            ssm_slots_used: s.ssm_slots_used,
            ssm_slots_total: s.ssm_slots_total,
            ssm_snapshots_used: s.ssm_snapshots_used,
            ssm_snapshots_total: s.ssm_snapshots_total,
            verify_steps: s.verify_steps,
            drafted: s.drafted,
            accepted: s.accepted,
            acceptance_rate: if s.drafted > 0 {
                s.accepted as f64 / s.drafted as f64
            } else {
                0.0
            },
            mean_acceptance_length: if s.draft_verifies > 0 {
                1.0 + s.accepted as f64 / s.draft_verifies as f64
            } else {
                0.0
            },
            speculation_on: s.speculation_on,
            speculation_switches: s.speculation_switches,
            plain_decode_tok_s: s.plain_tok_s,
            speculative_decode_tok_s: s.speculative_tok_s,
        }
    }
}
