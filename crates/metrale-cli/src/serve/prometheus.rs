//! `EngineMetrics` in Prometheus' text exposition format (version 0.0.4): a `# HELP` and a
//! `# TYPE` line per metric, then its sample. Names start with `metrale_`; counters, and only
//! counters, end in `_total` (pool sizes are `_capacity`).

use std::fmt::Write;

use metrale::EngineMetrics;

/// The `Content-Type` of [`render`]'s text.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The metrics as Prometheus text.
pub fn render(m: &EngineMetrics) -> String {
    let ratio = |used: usize, total: usize| {
        if total == 0 {
            0.0
        } else {
            used as f64 / total as f64
        }
    };
    let sp = m.speculation.unwrap_or_default();
    let metrics: [(&str, &str, &str, f64); 31] = [
        (
            "metrale_requests_running",
            "gauge",
            "Requests admitted to the model and not finished.",
            m.requests.running as f64,
        ),
        (
            "metrale_requests_queued",
            "gauge",
            "Requests submitted and not yet admitted (preempted ones included).",
            m.requests.queued as f64,
        ),
        (
            "metrale_requests_finished_total",
            "counter",
            "Requests that finished with an output (cancelled ones included).",
            m.requests.finished as f64,
        ),
        (
            "metrale_requests_failed_total",
            "counter",
            "Requests that ended with an engine error after they were accepted.",
            m.requests.failed as f64,
        ),
        (
            "metrale_generation_tokens_total",
            "counter",
            "Tokens generated since the engine started.",
            m.steps.tokens_generated as f64,
        ),
        (
            "metrale_generation_tokens_per_second",
            "gauge",
            "Tokens generated per second over the engine's metrics window.",
            m.tokens_per_second,
        ),
        (
            "metrale_steps_total",
            "counter",
            "Model steps run (prefill chunks and decode steps).",
            m.steps.steps as f64,
        ),
        (
            "metrale_preemptions_total",
            "counter",
            "Requests preempted by recompute because the KV cache ran out.",
            m.steps.preemptions as f64,
        ),
        (
            "metrale_prefill_tokens_total",
            "counter",
            "Prompt tokens computed in prefill steps (not those served from the prefix cache).",
            m.steps.prefill_tokens as f64,
        ),
        (
            "metrale_prefix_cache_queries_total",
            "counter",
            "Prompt tokens looked up in the prefix cache, at each admission to the model.",
            m.steps.prefix.query_tokens as f64,
        ),
        (
            "metrale_prefix_cache_hits_total",
            "counter",
            "Prompt tokens served from the prefix cache instead of computed.",
            m.steps.prefix.hit_tokens as f64,
        ),
        (
            "metrale_prefix_cache_hit_rate",
            "gauge",
            "Share of the prompt tokens looked up that the prefix cache served.",
            m.prefix_hit_rate,
        ),
        (
            "metrale_prefix_cache_lookups_total",
            "counter",
            "Prefix-cache lookups: admissions to the model (readmissions after preemption included).",
            m.steps.prefix.queries as f64,
        ),
        (
            "metrale_prefix_cache_lookup_hits_total",
            "counter",
            "Prefix-cache lookups that reused a cached prefix.",
            m.steps.prefix.hits as f64,
        ),
        (
            "metrale_kv_blocks_used",
            "gauge",
            "KV-cache blocks referenced by running requests.",
            m.cache.kv_blocks_used as f64,
        ),
        (
            "metrale_kv_blocks_capacity",
            "gauge",
            "KV-cache blocks in the pool.",
            m.cache.kv_blocks_total as f64,
        ),
        (
            "metrale_kv_cache_usage_ratio",
            "gauge",
            "Fraction of the KV-cache blocks in use.",
            ratio(m.cache.kv_blocks_used, m.cache.kv_blocks_total),
        ),
        (
            "metrale_kv_blocks_cached",
            "gauge",
            "KV-cache blocks in the prefix cache, referenced or evictable.",
            m.cache.kv_blocks_cached as f64,
        ),
        (
            "metrale_ssm_slots_used",
            "gauge",
            "SSM state slots in use (hybrid models).",
            m.cache.ssm_slots_used as f64,
        ),
        (
            "metrale_ssm_slots_capacity",
            "gauge",
            "SSM state slots in the pool (hybrid models).",
            m.cache.ssm_slots_total as f64,
        ),
        (
            "metrale_ssm_slots_usage_ratio",
            "gauge",
            "Fraction of the SSM state slots in use (hybrid models).",
            ratio(m.cache.ssm_slots_used, m.cache.ssm_slots_total),
        ),
        (
            "metrale_ssm_snapshots_used",
            "gauge",
            "SSM state snapshots kept for prefix caching (hybrid models).",
            m.cache.snapshots.used as f64,
        ),
        (
            "metrale_ssm_snapshots_capacity",
            "gauge",
            "SSM state snapshot entries for prefix caching (hybrid models).",
            m.cache.snapshots.total as f64,
        ),
        (
            "metrale_spec_verify_steps_total",
            "counter",
            "Verify steps run (speculative decoding; counted in metrale_steps_total too).",
            m.steps.verify_steps as f64,
        ),
        (
            "metrale_spec_draft_tokens_total",
            "counter",
            "Draft tokens the model checked.",
            sp.drafted as f64,
        ),
        (
            "metrale_spec_accepted_tokens_total",
            "counter",
            "Draft tokens the model accepted.",
            sp.accepted as f64,
        ),
        (
            "metrale_spec_mean_acceptance_length",
            "gauge",
            "Tokens per sequence verify that checked drafts (accepted drafts plus one).",
            sp.mean_acceptance_length,
        ),
        (
            "metrale_spec_gate_on",
            "gauge",
            "1 while the speculation gate keeps speculation on, 0 while off or not speculating.",
            f64::from(u8::from(m.speculation.is_some_and(|s| s.on))),
        ),
        (
            "metrale_spec_gate_switches_total",
            "counter",
            "Times the speculation gate switched speculation on or off.",
            sp.switches as f64,
        ),
        (
            "metrale_spec_plain_decode_tokens_per_second",
            "gauge",
            "The gate's moving average of decode tokens/s without speculation (0 before measured).",
            sp.plain_decode_tok_s.unwrap_or(0.0),
        ),
        (
            "metrale_spec_speculative_decode_tokens_per_second",
            "gauge",
            "The gate's moving average of decode tokens/s with speculation (0 before measured).",
            sp.speculative_decode_tok_s.unwrap_or(0.0),
        ),
    ];
    let mut out = String::new();
    for (name, kind, help, value) in metrics {
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
        m.steps.verify_steps = 43;
        let p = &mut m.steps.prefix;
        (p.queries, p.hits, p.query_tokens, p.hit_tokens) = (31, 37, 400, 100);
        m.prefix_hit_rate = 0.25;
        let c = &mut m.cache;
        (c.kv_blocks_used, c.kv_blocks_total, c.kv_blocks_cached) = (23, 46, 41);
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
            "metrale_preemptions_total 19",
            "metrale_prefill_tokens_total 29",
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
