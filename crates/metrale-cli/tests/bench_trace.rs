//! `metrale bench --serve --request-rate` on the CPU backend and the tiny shape, as a user runs
//! it: the serving trace prints its table and writes every rate's figures to `--json-out`;
//! `--request-rate` without `--serve` is refused; and `--serve --interference-prompt-tokens`
//! prints and writes its runs with mixed steps on and off.

#![allow(clippy::unwrap_used)]

use std::process::Command;

/// `metrale bench --shape tiny --backend cpu --serve ARGS --json-out FILE`, which must
/// succeed: its stdout and the JSON it wrote.
fn bench_serve(args: &[&str]) -> (String, serde_json::Value) {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("bench.json");
    let out = Command::new(env!("CARGO_BIN_EXE_metrale"))
        .args(["bench", "--shape", "tiny", "--backend", "cpu", "--serve"])
        .args(args)
        .arg("--json-out")
        .arg(&json)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    (stdout, v)
}

#[test]
fn the_serving_trace_prints_a_row_per_rate_and_writes_its_json() {
    let (stdout, v) = bench_serve(&[
        "--request-rate",
        "300,inf",
        "--num-prompts",
        "6",
        "--prompt-tokens",
        "4",
        "--prompt-tokens-max",
        "9",
        "--output-tokens",
        "2",
        "--output-tokens-max",
        "6",
        "--seed",
        "3",
        "--max-decode-seqs",
        "4",
    ]);
    assert!(
        stdout.contains("serving trace, 6 requests per rate"),
        "{stdout}"
    );
    assert!(stdout.contains("prompt 4..=9 + output 2..=6"), "{stdout}");
    let points = v["trace"].as_array().unwrap();
    assert_eq!(points.len(), 2);
    assert_eq!(points[0]["request_rate"], 300.0);
    assert_eq!(points[1]["request_rate"], "inf");
    for p in points {
        assert_eq!(p["completed"], 6);
        let requests = p["requests"].as_array().unwrap();
        let tokens: u64 = requests
            .iter()
            .map(|r| r["output_tokens"].as_u64().unwrap())
            .sum();
        assert_eq!(p["output_tokens"].as_u64(), Some(tokens));
        assert_eq!(p["itl_samples"].as_u64(), Some(tokens - 6));
        for part in ["ttft", "itl", "e2e"] {
            let (p50, p99) = (
                p[part]["p50_ms"].as_f64().unwrap(),
                p[part]["p99_ms"].as_f64().unwrap(),
            );
            assert!(0.0 <= p50 && p50 <= p99, "{part}: {p}");
        }
    }
    // Both rates ran the same drawn requests.
    let lens = |p: &serde_json::Value| -> Vec<(u64, u64)> {
        p["requests"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                (
                    r["prompt_tokens"].as_u64().unwrap(),
                    r["output_tokens"].as_u64().unwrap(),
                )
            })
            .collect()
    };
    assert_eq!(lens(&points[0]), lens(&points[1]));
}

#[test]
fn a_request_rate_without_serve_is_refused() {
    let out = Command::new(env!("CARGO_BIN_EXE_metrale"))
        .args([
            "bench",
            "--shape",
            "tiny",
            "--backend",
            "cpu",
            "--request-rate",
            "4",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--serve"));
}

/// `metrale bench --serve --interference-prompt-tokens` on the CPU backend and the tiny shape:
/// a row per rung and mixing mode, and the JSON of both runs, the mixed one never leaving the
/// streams out of a step while the long prompt prefills.
#[test]
fn the_interference_scenario_prints_and_writes_both_runs() {
    let (stdout, v) = bench_serve(&[
        "--interference-prompt-tokens",
        "100",
        "--concurrency",
        "3",
        "--prompt-tokens",
        "4",
        "--output-tokens",
        "16",
        "--max-batch-tokens",
        "32",
    ]);
    assert!(
        stdout.contains("a prompt of 100 tokens arrives"),
        "{stdout}"
    );
    assert_eq!(v["max_batch_tokens"], 32);
    let points = v["interference"].as_array().unwrap();
    assert_eq!(points.len(), 1);
    assert_eq!(points[0]["concurrency"], 3);
    let runs = points[0]["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2);
    assert_eq!(runs[0]["mixed_steps"], true);
    assert_eq!(runs[0]["stalled_steps"], 0);
    assert_eq!(runs[1]["mixed_steps"], false);
    assert!(runs[1]["stalled_steps"].as_u64().unwrap() >= 2, "{v}");
    for r in runs {
        for field in [
            "ttft_ms",
            "median_gap_ms",
            "plain_step_ms",
            "max_gap_ms",
            "worst_ratio",
            "median_window_step_ms",
        ] {
            assert!(r[field].as_f64().unwrap() > 0.0, "{field}: {r}");
        }
        assert!(!r["slowest_steps"].as_array().unwrap().is_empty(), "{r}");
    }
}
