//! `metrale bench --tensor-parallel-size N` on the CPU backend's ranks and the tiny shapes, as a
//! user runs it: the decode steps of the sharded model print beside their floor per GPU and
//! reach `--json-out` with the collectives each step runs; settings it does not shard are
//! refused.

#![allow(clippy::unwrap_used)]

use std::process::Command;

/// `metrale bench --backend cpu --iters 1 --context 20 ARGS` with `--json-out`: whether it
/// succeeded, its stdout and stderr, and the JSON it wrote (if any).
fn bench(args: &[&str]) -> (bool, String, Option<serde_json::Value>) {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("bench.json");
    let out = Command::new(env!("CARGO_BIN_EXE_metrale"))
        .args([
            "bench",
            "--backend",
            "cpu",
            "--iters",
            "1",
            "--context",
            "20",
        ])
        .args(args)
        .arg("--json-out")
        .arg(&json)
        .output()
        .unwrap();
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let v = std::fs::read_to_string(&json)
        .ok()
        .map(|t| serde_json::from_str(&t).unwrap());
    (out.status.success(), text, v)
}

#[test]
fn a_sharded_bench_prints_and_writes_each_step_beside_its_floor_per_gpu() {
    for (shape, collectives) in [("tiny", 6), ("tiny-moe", 14)] {
        let (ok, text, v) = bench(&[
            "--shape",
            shape,
            "--tensor-parallel-size",
            "2",
            "--batches",
            "1,3",
        ]);
        assert!(ok, "{text}");
        assert!(text.contains("x 2 ranks"), "{text}");
        let v = v.unwrap();
        assert_eq!(v["tensor_parallel_size"], 2);
        let decode = v["decode"].as_array().unwrap();
        assert_eq!(decode.len(), 2, "{v}");
        for d in decode {
            assert_eq!(d["collectives"], collectives, "{shape}: {d}");
            let (floor, coll) = (
                d["floor_ms"].as_f64().unwrap(),
                d["collectives_ms"].as_f64().unwrap(),
            );
            assert!(
                coll > 0.0 && floor > coll && d["ms"].as_f64().unwrap() > 0.0,
                "{d}"
            );
        }
    }
}

#[test]
fn a_sharded_bench_refuses_what_it_does_not_shard() {
    for (args, needle) in [
        (
            &["--tensor-parallel-size", "2", "--quantization", "fp8"][..],
            "bf16",
        ),
        (&["--tensor-parallel-size", "3"], "tensor_parallel_size"),
        (
            &["--tensor-parallel-size", "2", "--speculative"],
            "--speculative",
        ),
    ] {
        let (ok, text, _) = bench(&[&["--shape", "tiny"][..], args].concat());
        assert!(!ok && text.contains(needle), "{args:?}: {text}");
    }
}
