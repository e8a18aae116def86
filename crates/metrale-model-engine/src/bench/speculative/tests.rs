//! The speculative benchmark on the CPU backend's tiny hybrid shape: every figure a positive
//! time, the oracle's end-to-end runs at full acceptance, and the batched figures under the
//! circuit forward.

use metrale_gpu_runtime::CpuBackend;

use super::*;

/// The whole benchmark on the tiny hybrid shape: every figure is a positive time, the
/// ratios are finite, the oracle keeps every draft (K + 1 tokens per verify step, the
/// plain run's tokens), and the table states the bar and which figures are eager.
#[test]
fn the_speculative_benchmark_runs_end_to_end_on_a_tiny_hybrid_shape() {
    let mut o = SpecBenchOptions::new(super::super::tiny_hybrid_for_cpu().unwrap());
    o.context = 40;
    o.iters = 2;
    o.output_tokens = 13;
    o.copy_bytes = 1 << 16;
    let r = speculative_bench(Arc::new(CpuBackend::default()), &o).unwrap();
    assert_eq!(r.verify.len(), 4);
    let times = [
        r.plain.graphed_ms,
        r.plain.eager_ms,
        r.draft.graphed_ms,
        r.draft.eager_ms,
    ];
    assert!(times.iter().all(|t| *t > 0.0 && t.is_finite()), "{r:?}");
    for v in &r.verify {
        let ratios = [v.ms / r.plain.eager_ms, v.graphed_ms / r.plain.graphed_ms];
        assert!(ratios.iter().all(|x| x.is_finite() && *x > 0.0), "{v:?}");
        assert!(v.floor_ms > r.plain.floor_ms);
    }
    assert!(r.draft.floor_ms > 0.0 && r.draft.floor_ms < r.plain.floor_ms);
    for k in 1..=3 {
        let t = r.projected_tok_s(k, ACCEPTANCE_LENGTHS[k - 1]).unwrap();
        assert!(t > 0.0 && t.is_finite());
    }
    // Plain graphed and eager, then oracle and MTP for each K.
    assert_eq!(r.end_to_end.len(), 2 + 2 * 4);
    for e in &r.end_to_end {
        assert_eq!(e.tokens, 13, "{e:?}");
        assert!(e.matches_plain, "{e:?}");
        assert!(e.tok_s > 0.0 && e.tok_s.is_finite(), "{e:?}");
        assert!(e.cold_tok_s > 0.0 && e.cold_tok_s.is_finite(), "{e:?}");
        // The warm run replays the graphs the cold one captured (eager runs capture none).
        assert_eq!(e.captures, 0, "{e:?}");
    }
    assert_eq!(r.end_to_end[1].cold_captures, 0, "eager");
    for e in r.end_to_end.iter().filter(|e| e.name.starts_with("oracle")) {
        // 12 tokens after the first: K + 1 per verify step but the last, cut short.
        let full = (12.0 / (e.drafts + 1) as f64).ceil();
        assert!(e.tokens_per_step > 1.0, "{e:?}");
        assert!((e.tokens_per_step - 12.0 / full).abs() < 1e-9, "{e:?}");
    }
    assert!(r.batched.is_none() && r.forward == "legacy");
    assert_eq!(r.verify_program_steps, 0);
    let table = r.table();
    for want in [
        "verify K=3 (graphed, 4 rows)",
        "verify K=3 (eager, 4 rows)",
        "bar: verify K=3",
        "K=3 L=3.4",
        "oracle K=4",
    ] {
        assert!(table.contains(want), "{want}:\n{table}");
    }
}

/// Batched figures under the circuit forward: three sequences' plain and verify steps are
/// timed against floors above the single sequence's, the verify steps run from circuit
/// programs, and the table says so.
#[test]
fn the_speculative_benchmark_times_batched_verify_steps_from_circuit_programs() {
    let mut o = SpecBenchOptions::new(super::super::tiny_hybrid_for_cpu().unwrap());
    (o.context, o.iters, o.output_tokens, o.copy_bytes) = (24, 2, 5, 1 << 16);
    o.max_draft_tokens = 2;
    o.batch = 3;
    o.forward = ForwardSelect::Circuit {
        fusions: crate::runner::Fusions::ReferenceOnly,
    };
    let r = speculative_bench(Arc::new(CpuBackend::default()), &o).unwrap();
    let b = r.batched.as_ref().unwrap();
    assert_eq!((b.seqs, b.verify.len()), (3, 2));
    for v in &b.verify {
        assert!(
            v.graphed_ms > 0.0 && v.ms > 0.0 && v.graphed_ms.is_finite(),
            "{v:?}"
        );
        assert!(v.floor_ms > b.plain.floor_ms && b.plain.floor_ms > r.plain.floor_ms);
    }
    // Two timed verify shapes, each graphed and eager, over 2 + iters runs at least.
    assert!(
        r.verify_program_steps >= 2 * 2 * 2,
        "{}",
        r.verify_program_steps
    );
    let table = r.table();
    for want in [
        "circuit-reference forward",
        "batch 3",
        "verify K=2 (graphed, 9 rows)",
    ] {
        assert!(table.contains(want), "{want}:\n{table}");
    }
}
