//! `metrale bench --serve --speculative` on the CPU backend and the tiny hybrid shape (it has
//! an MTP head), as a user runs it: each rung runs plain, with the oracle's drafts and with the
//! MTP head's, the speculative runs generating the plain tokens (else the command fails), and
//! the figures go to the table and to `--json-out`; combinations it does not run are refused.

#![allow(clippy::unwrap_used)]

use std::process::Command;

/// `metrale bench --shape tiny-hybrid --backend cpu --serve --speculative ARGS`.
fn bench(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_metrale"))
        .args([
            "bench",
            "--shape",
            "tiny-hybrid",
            "--backend",
            "cpu",
            "--serve",
            "--speculative",
        ])
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn the_speculative_ladder_prints_and_writes_each_rungs_runs() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("bench.json");
    let out = bench(&[
        "--concurrency",
        "1,4",
        "--prompt-tokens",
        "5",
        "--output-tokens",
        "9",
        "--num-draft-tokens",
        "2",
        "--max-speculative-graphs",
        "16",
        "--json-out",
        json.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("speculative runs: K = 2"), "{stdout}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(v["speculation"]["num_draft_tokens"], 2);
    assert_eq!(v["speculation"]["forward"], "legacy");
    assert_eq!(v["speculation"]["max_speculative_graphs"], 16);
    let points = v["serve"].as_array().unwrap();
    let concurrency: Vec<u64> = points
        .iter()
        .map(|p| p["concurrency"].as_u64().unwrap())
        .collect();
    assert_eq!(concurrency, [1, 4]);
    for p in points {
        let runs = p["speculative"].as_array().unwrap();
        let drafters: Vec<&str> = runs
            .iter()
            .map(|r| r["drafter"].as_str().unwrap())
            .collect();
        assert_eq!(drafters, ["oracle", "mtp"], "{p}");
        for r in runs {
            assert!(r["tok_s"].as_f64().unwrap() > 0.0, "{r}");
            assert!(r["vs_plain"].as_f64().unwrap() > 0.0, "{r}");
            assert!(r["verify_steps"].as_u64().unwrap() > 0, "{r}");
        }
        // The oracle drafts each request's own tokens: every draft accepted.
        let oracle = &runs[0];
        assert_eq!(oracle["accepted"], oracle["drafted"], "{oracle}");
        assert!(
            oracle["accepted_per_verify"].as_f64().unwrap() > 1.0,
            "{oracle}"
        );
    }
}

#[test]
fn speculation_with_the_trace_or_a_draft_count_past_the_limit_is_refused() {
    let out = bench(&["--request-rate", "4"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--speculative"), "{stderr}");
    let out = bench(&["--num-draft-tokens", "9", "--concurrency", "1"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("num_draft_tokens"), "{stderr}");
}
