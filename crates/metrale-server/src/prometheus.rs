//! `EngineMetrics` in Prometheus' text exposition format (version 0.0.4): a `# HELP` and a
//! `# TYPE` line per metric, then its sample. Names start with `metrale_`; counters, and only
//! counters, end in `_total` (pool sizes are `_capacity`).

use std::fmt::Write;

use metrale::EngineMetrics;

/// The `Content-Type` of [`render`]'s text.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// One metric: its name, Prometheus type, help text, and how it reads `EngineMetrics`.
struct Metric {
    name: &'static str,
    kind: &'static str,
    help: &'static str,
    value: fn(&EngineMetrics) -> f64,
}

/// `used / total`, 0 for an empty pool.
fn ratio(used: usize, total: usize) -> f64 {
    if total == 0 {
        0.0
    } else {
        used as f64 / total as f64
    }
}

/// Every metric, in the order they are written.
const METRICS: [Metric; 35] = [
    Metric {
        name: "metrale_requests_running",
        kind: "gauge",
        help: "Sequences admitted to the model and not finished (one per choice of a request).",
        value: |m| m.requests.running as f64,
    },
    Metric {
        name: "metrale_requests_queued",
        kind: "gauge",
        help: "Requests submitted and not yet admitted (preempted ones included).",
        value: |m| m.requests.queued as f64,
    },
    Metric {
        name: "metrale_requests_finished_total",
        kind: "counter",
        help: "Requests that finished with an output (cancelled ones included).",
        value: |m| m.requests.finished as f64,
    },
    Metric {
        name: "metrale_requests_failed_total",
        kind: "counter",
        help: "Requests that ended with an engine error after they were accepted.",
        value: |m| m.requests.failed as f64,
    },
    Metric {
        name: "metrale_generation_tokens_total",
        kind: "counter",
        help: "Tokens generated since the engine started.",
        value: |m| m.steps.tokens_generated as f64,
    },
    Metric {
        name: "metrale_generation_tokens_per_second",
        kind: "gauge",
        help: "Tokens generated per second over the engine's metrics window.",
        value: |m| m.tokens_per_second,
    },
    Metric {
        name: "metrale_steps_total",
        kind: "counter",
        help: "Model steps run (prefill chunks, decode steps, and mixed steps holding both).",
        value: |m| m.steps.steps as f64,
    },
    Metric {
        name: "metrale_mixed_steps_total",
        kind: "counter",
        help: "Model steps that held decode rows and a prefill chunk together.",
        value: |m| m.steps.mixed_steps as f64,
    },
    Metric {
        name: "metrale_preemptions_total",
        kind: "counter",
        help: "Requests preempted by recompute because the KV cache ran out.",
        value: |m| m.steps.preemptions as f64,
    },
    Metric {
        name: "metrale_prefill_tokens_total",
        kind: "counter",
        help: "Prompt tokens computed in prefill steps (not those served from the prefix cache).",
        value: |m| m.steps.prefill_tokens as f64,
    },
    Metric {
        name: "metrale_reprefill_tokens_total",
        kind: "counter",
        help: "Tokens of finished conversations prefilled again so that follow-up turns share their answers (hybrid models).",
        value: |m| m.steps.reprefill_tokens as f64,
    },
    Metric {
        name: "metrale_reprefills_pending",
        kind: "gauge",
        help: "Re-prefills of finished conversations running or queued.",
        value: |m| m.reprefills as f64,
    },
    Metric {
        name: "metrale_prefix_cache_queries_total",
        kind: "counter",
        help: "Prompt tokens looked up in the prefix cache, at each admission to the model.",
        value: |m| m.steps.prefix.query_tokens as f64,
    },
    Metric {
        name: "metrale_prefix_cache_hits_total",
        kind: "counter",
        help: "Prompt tokens served from the prefix cache instead of computed.",
        value: |m| m.steps.prefix.hit_tokens as f64,
    },
    Metric {
        name: "metrale_prefix_cache_hit_rate",
        kind: "gauge",
        help: "Share of the prompt tokens looked up that the prefix cache served.",
        value: |m| m.prefix_hit_rate,
    },
    Metric {
        name: "metrale_prefix_cache_lookups_total",
        kind: "counter",
        help: "Prefix-cache lookups: admissions to the model (readmissions after preemption included).",
        value: |m| m.steps.prefix.queries as f64,
    },
    Metric {
        name: "metrale_prefix_cache_lookup_hits_total",
        kind: "counter",
        help: "Prefix-cache lookups that reused a cached prefix.",
        value: |m| m.steps.prefix.hits as f64,
    },
    Metric {
        name: "metrale_kv_blocks_used",
        kind: "gauge",
        help: "KV-cache blocks referenced by running requests.",
        value: |m| m.cache.kv_blocks_used as f64,
    },
    Metric {
        name: "metrale_kv_blocks_capacity",
        kind: "gauge",
        help: "KV-cache blocks in the pool.",
        value: |m| m.cache.kv_blocks_total as f64,
    },
    Metric {
        name: "metrale_kv_tokens_capacity",
        kind: "gauge",
        help: "Tokens the KV cache holds, every block full (twice as many in FP8 as in bf16).",
        value: |m| m.cache.kv_tokens_capacity as f64,
    },
    Metric {
        name: "metrale_kv_cache_usage_ratio",
        kind: "gauge",
        help: "Fraction of the KV-cache blocks in use.",
        value: |m| ratio(m.cache.kv_blocks_used, m.cache.kv_blocks_total),
    },
    Metric {
        name: "metrale_kv_blocks_cached",
        kind: "gauge",
        help: "KV-cache blocks in the prefix cache, referenced or evictable.",
        value: |m| m.cache.kv_blocks_cached as f64,
    },
    Metric {
        name: "metrale_ssm_slots_used",
        kind: "gauge",
        help: "SSM state slots in use (hybrid models).",
        value: |m| m.cache.ssm_slots_used as f64,
    },
    Metric {
        name: "metrale_ssm_slots_capacity",
        kind: "gauge",
        help: "SSM state slots in the pool (hybrid models).",
        value: |m| m.cache.ssm_slots_total as f64,
    },
    Metric {
        name: "metrale_ssm_slots_usage_ratio",
        kind: "gauge",
        help: "Fraction of the SSM state slots in use (hybrid models).",
        value: |m| ratio(m.cache.ssm_slots_used, m.cache.ssm_slots_total),
    },
    Metric {
        name: "metrale_ssm_snapshots_used",
        kind: "gauge",
        help: "SSM state snapshots kept for prefix caching (hybrid models).",
        value: |m| m.cache.snapshots.used as f64,
    },
    Metric {
        name: "metrale_ssm_snapshots_capacity",
        kind: "gauge",
        help: "SSM state snapshot entries for prefix caching (hybrid models).",
        value: |m| m.cache.snapshots.total as f64,
    },
    Metric {
        name: "metrale_spec_verify_steps_total",
        kind: "counter",
        help: "Verify steps run (speculative decoding; counted in metrale_steps_total too).",
        value: |m| m.steps.verify_steps as f64,
    },
    Metric {
        name: "metrale_spec_draft_tokens_total",
        kind: "counter",
        help: "Draft tokens the model checked.",
        value: |m| m.speculation.unwrap_or_default().drafted as f64,
    },
    Metric {
        name: "metrale_spec_accepted_tokens_total",
        kind: "counter",
        help: "Draft tokens the model accepted.",
        value: |m| m.speculation.unwrap_or_default().accepted as f64,
    },
    Metric {
        name: "metrale_spec_mean_acceptance_length",
        kind: "gauge",
        help: "Tokens per sequence verify that checked drafts (accepted drafts plus one).",
        value: |m| m.speculation.unwrap_or_default().mean_acceptance_length,
    },
    Metric {
        name: "metrale_spec_gate_on",
        kind: "gauge",
        help: "1 while the speculation gate keeps speculation on at the batch width of the last decode step, 0 while off or not speculating.",
        value: |m| f64::from(u8::from(m.speculation.is_some_and(|s| s.on))),
    },
    Metric {
        name: "metrale_spec_gate_switches_total",
        kind: "counter",
        help: "Times the speculation gate switched speculation on or off, every batch width together.",
        value: |m| m.speculation.unwrap_or_default().switches as f64,
    },
    Metric {
        name: "metrale_spec_plain_decode_tokens_per_second",
        kind: "gauge",
        help: "The gate's moving average of decode tokens/s without speculation at the batch width of the last decode step (0 before measured).",
        value: |m| {
            m.speculation
                .unwrap_or_default()
                .plain_decode_tok_s
                .unwrap_or(0.0)
        },
    },
    Metric {
        name: "metrale_spec_speculative_decode_tokens_per_second",
        kind: "gauge",
        help: "The gate's moving average of decode tokens/s with speculation at the batch width of the last decode step (0 before measured).",
        value: |m| {
            m.speculation
                .unwrap_or_default()
                .speculative_decode_tok_s
                .unwrap_or(0.0)
        },
    },
];

/// The metrics as Prometheus text.
pub fn render(m: &EngineMetrics) -> String {
    let mut out = String::new();
    for Metric {
        name,
        kind,
        help,
        value,
    } in &METRICS
    {
        let value = value(m);
        // Writing to a String cannot fail.
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}"
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use metrale::SpeculationMetrics;

    #[test]
    fn every_field_has_its_sample() {
        let mut m = EngineMetrics::default();
        (m.requests.running, m.requests.queued) = (3, 5);
        (m.requests.finished, m.requests.failed) = (7, 11);
        m.steps.tokens_generated = 13;
        m.tokens_per_second = 2.5;
        (m.steps.steps, m.steps.preemptions, m.steps.prefill_tokens) = (17, 19, 29);
        (m.steps.reprefill_tokens, m.reprefills) = (47, 2);
        m.steps.verify_steps = 43;
        m.steps.mixed_steps = 7;
        let p = &mut m.steps.prefix;
        (p.queries, p.hits, p.query_tokens, p.hit_tokens) = (31, 37, 400, 100);
        m.prefix_hit_rate = 0.25;
        let c = &mut m.cache;
        (c.kv_blocks_used, c.kv_blocks_total, c.kv_blocks_cached) = (23, 46, 41);
        c.kv_tokens_capacity = 736;
        (c.ssm_slots_used, c.ssm_slots_total) = (1, 4);
        (c.snapshots.used, c.snapshots.total) = (3, 8);
        let mut sp = SpeculationMetrics::default();
        (sp.drafted, sp.accepted, sp.acceptance_rate) = (300, 120, 0.4);
        (sp.mean_acceptance_length, sp.on, sp.switches) = (2.5, true, 2);
        sp.plain_decode_tok_s = Some(50.0);
        m.speculation = Some(sp);
        let text = render(&m);
        for line in [
            "metrale_requests_running 3",
            "metrale_requests_queued 5",
            "metrale_requests_finished_total 7",
            "metrale_requests_failed_total 11",
            "metrale_generation_tokens_total 13",
            "metrale_generation_tokens_per_second 2.5",
            "metrale_steps_total 17",
            "metrale_mixed_steps_total 7",
            "metrale_preemptions_total 19",
            "metrale_prefill_tokens_total 29",
            "metrale_reprefill_tokens_total 47",
            "metrale_reprefills_pending 2",
            "metrale_prefix_cache_lookups_total 31",
            "metrale_prefix_cache_lookup_hits_total 37",
            "metrale_prefix_cache_queries_total 400",
            "metrale_prefix_cache_hits_total 100",
            "metrale_prefix_cache_hit_rate 0.25",
            "metrale_kv_blocks_cached 41",
            "metrale_ssm_snapshots_used 3",
            "metrale_ssm_snapshots_capacity 8",
            "metrale_kv_blocks_used 23",
            "metrale_kv_blocks_capacity 46",
            "metrale_kv_tokens_capacity 736",
            "metrale_kv_cache_usage_ratio 0.5",
            "metrale_ssm_slots_used 1",
            "metrale_ssm_slots_capacity 4",
            "metrale_ssm_slots_usage_ratio 0.25",
            "metrale_spec_verify_steps_total 43",
            "metrale_spec_draft_tokens_total 300",
            "metrale_spec_accepted_tokens_total 120",
            "metrale_spec_mean_acceptance_length 2.5",
            "metrale_spec_gate_on 1",
            "metrale_spec_gate_switches_total 2",
            "metrale_spec_plain_decode_tokens_per_second 50",
            "metrale_spec_speculative_decode_tokens_per_second 0",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing `{line}` in\n{text}"
            );
        }
    }
}
