//! The serving trace on the CPU backend: the percentile function on known inputs, the trace's
//! determinism, a whole run's invariants, and the options it refuses.

use super::*;
use metrale_gpu_runtime::CpuBackend;

#[test]
fn percentiles_interpolate_linearly_between_the_closest_ranks() {
    let v = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0];
    // Fractional index p / 100 * 9, as numpy.percentile.
    assert_eq!(percentile(&v, 0.0), 1.0);
    assert_eq!(percentile(&v, 50.0), 5.5);
    assert!((percentile(&v, 90.0) - 9.1).abs() < 1e-12);
    assert!((percentile(&v, 99.0) - 9.91).abs() < 1e-12);
    assert_eq!(percentile(&v, 100.0), 10.0);
    assert_eq!(percentile(&[3.0, 7.0], 25.0), 4.0);
    assert_eq!(percentile(&[42.0], 99.0), 42.0);
    assert!(percentile(&[], 50.0).is_nan());
    // Unsorted seconds in, sorted milliseconds out.
    let p = Percentiles::of_seconds(&[0.004, 0.001, 0.003, 0.002, 0.005]);
    assert_eq!((p.p50_ms, p.p90_ms), (3.0, 4.6));
    assert!((p.p99_ms - 4.96).abs() < 1e-9, "{p:?}");
}

fn tiny_trace() -> TraceOptions {
    let mut o = TraceOptions::new(super::super::tiny_for_cpu().unwrap());
    o.request_rates = vec![200.0, f64::INFINITY];
    o.num_requests = 8;
    o.prompt_tokens = TokenRange { min: 3, max: 9 };
    o.output_tokens = TokenRange { min: 2, max: 7 };
    o.seed = 7;
    o.max_decode_seqs = 4;
    o
}

#[test]
fn the_same_seed_draws_the_same_trace_and_another_seed_another() {
    let o = tiny_trace();
    let a = trace_requests(&o, 10.0);
    assert_eq!(a, trace_requests(&o, 10.0));
    assert_eq!(a.len(), 8);
    assert_eq!(a[0].arrival_s, 0.0);
    assert!(a.windows(2).all(|w| w[0].arrival_s < w[1].arrival_s));
    for r in &a {
        assert!((3..=9).contains(&r.prompt.len()), "{r:?}");
        assert!((2..=7).contains(&r.output_tokens), "{r:?}");
        assert!(r.prompt.iter().all(|&t| (t as usize) < 256));
    }
    // The lengths vary within their ranges (a fixed draw would not).
    assert!(a.iter().any(|r| r.output_tokens != a[0].output_tokens));
    // Another rate scales the same arrivals and keeps the requests.
    let b = trace_requests(&o, 40.0);
    for (x, y) in a.iter().zip(&b) {
        assert_eq!((&x.prompt, x.output_tokens), (&y.prompt, y.output_tokens));
        assert!((x.arrival_s - 4.0 * y.arrival_s).abs() < 1e-12);
    }
    assert!(
        trace_requests(&o, f64::INFINITY)
            .iter()
            .all(|r| r.arrival_s == 0.0)
    );
    let mut other = o.clone();
    other.seed = 8;
    assert_ne!(trace_requests(&other, 10.0), a);
    // The mean gap of a long trace is near 1 / rate.
    other.num_requests = 4000;
    let long = trace_requests(&other, 10.0);
    let mean = long[3999].arrival_s / 3999.0;
    assert!((mean - 0.1).abs() < 0.01, "{mean}");
}

#[test]
fn a_trace_runs_every_request_to_its_drawn_length_and_reports_ordered_latencies() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new(Default::default()));
    let o = tiny_trace();
    let r = serve_trace(gpu, &o).unwrap();
    assert_eq!(r.points.len(), 2);
    let drawn = trace_requests(&o, 1.0);
    for p in &r.points {
        assert_eq!(p.completed, 8);
        assert_eq!(p.requests.len(), 8);
        let want: usize = drawn.iter().map(|d| d.output_tokens).sum();
        assert_eq!(p.output_tokens, want);
        assert_eq!(p.itl_samples, want - 8);
        for (t, d) in p.requests.iter().zip(&drawn) {
            assert_eq!(t.token_s.len(), d.output_tokens);
            assert_eq!(t.prompt_tokens, d.prompt.len());
            assert!(t.ttft_s() > 0.0 && t.ttft_s() <= t.e2e_s(), "{t:?}");
            assert!(t.token_s.windows(2).all(|w| w[0] <= w[1]), "{t:?}");
            assert!(t.e2e_s() + t.arrival_s <= p.duration_s);
        }
        for q in [p.ttft, p.itl, p.e2e] {
            assert!(q.p50_ms <= q.p90_ms && q.p90_ms <= q.p99_ms, "{q:?}");
            assert!(q.p50_ms >= 0.0, "{q:?}");
        }
        assert!(p.ttft.p99_ms <= p.e2e.p99_ms, "{p:?}");
        assert!((p.req_s * p.duration_s - 8.0).abs() < 1e-9);
        assert!((p.out_tok_s * p.duration_s - want as f64).abs() < 1e-6);
        assert!(p.steps >= 7, "{p:?}");
    }
    // At 200 requests/s the last arrival comes after t = 0; at inf every one at t = 0.
    assert!(r.points[0].requests[7].arrival_s > 0.0);
    assert!(r.points[1].requests.iter().all(|t| t.arrival_s == 0.0));
    let table = r.table();
    assert!(
        table.contains("serving trace") && table.contains("TTFT"),
        "{table}"
    );
}

#[test]
fn rates_and_ranges_that_cannot_run_are_refused() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new(Default::default()));
    type Edit = fn(&mut TraceOptions);
    let cases: [(&str, Edit); 5] = [
        ("request_rates", |o| o.request_rates = vec![4.0, 0.0]),
        ("request_rates", |o| o.request_rates = vec![f64::NAN]),
        ("num_requests", |o| o.num_requests = 0),
        ("prompt_tokens", |o| {
            o.prompt_tokens = TokenRange { min: 5, max: 4 }
        }),
        ("output_tokens", |o| o.output_tokens = TokenRange::fixed(0)),
    ];
    for (name, set) in cases {
        let mut o = tiny_trace();
        set(&mut o);
        let e = serve_trace(gpu.clone(), &o).unwrap_err();
        assert!(
            matches!(e, ModelError::Options { option, .. } if option == name),
            "{name}: {e}"
        );
    }
}
