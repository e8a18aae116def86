//! `metrale circuit plan` as a user runs it on the committed fixtures: an FP8 pack's plan names
//! the FP8 kernels, and the plan of its bf16 source with `--quantization fp8` is the same plan
//! (an FP8 KV cache is named in the header); a
//! verify plan of several sequences names them, and the verify steps compiled follow
//! `--circuit-speculative-seqs`.

#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::Command;

/// `metrale circuit plan --model DIR ARGS`, which must succeed: its stdout.
fn plan(dir: &Path, args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_metrale"))
        .args(["circuit", "plan", "--model"])
        .arg(dir)
        .args(args)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// The line of `text` starting with `key `.
fn line<'a>(text: &'a str, key: &str) -> &'a str {
    text.lines()
        .find(|l| l.starts_with(&format!("{key} ")))
        .unwrap_or_else(|| panic!("no {key} line in\n{text}"))
}

#[test]
fn quantizing_at_load_plans_the_kernels_of_the_fp8_pack() {
    let pack = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen3-fp8-tiny");
    let packed = plan(&pack, &[]);
    let quantized = plan(&pack.join("source"), &["--quantization", "fp8"]);
    let bf16 = plan(&pack.join("source"), &[]);
    assert!(packed.contains("weights block_fp8") && packed.contains("gemm::linear_stream_fp8"));
    assert!(!bf16.contains("linear_stream_fp8"), "{bf16}");
    assert_eq!(line(&quantized, "digest"), line(&packed, "digest"));
    assert_eq!(
        line(&quantized, "plans_digest"),
        line(&packed, "plans_digest")
    );
    assert_ne!(line(&bf16, "digest"), line(&packed, "digest"));
    // An FP8 KV cache is named in the header: the same kernels, another digest.
    let fp8_kv = plan(&pack, &["--kv-cache-dtype", "fp8"]);
    assert!(fp8_kv.contains("\nkv_cache e4m3\n") && !packed.contains("kv_cache"));
    assert_ne!(line(&fp8_kv, "digest"), line(&packed, "digest"));
    assert_eq!(line(&fp8_kv, "launches"), line(&packed, "launches"));
}

#[test]
fn a_verify_plan_of_several_sequences_says_so_and_more_sequences_compile_more_plans() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen3_5-tiny");
    let k2 = ["--step", "verify", "--num-draft-tokens", "2"];
    let single = plan(&dir, &[&k2[..], &["--rows", "3"]].concat());
    let batched = plan(&dir, &[&k2[..], &["--rows", "6", "--seqs", "2"]].concat());
    assert!(!single.contains("\nseqs "), "{single}");
    assert!(
        batched.contains("\nstep verify\nrows 6\nseqs 2\n"),
        "{batched}"
    );
    // Verify and draft steps of 2 to 4 sequences (the default) compile 2 * (2 + 3 + 4) verify
    // and 5 + 7 + 9 draft plans beside the decode ladder's 4 and the single sequence's 2 verify
    // and 3 draft plans; of one sequence only, none.
    let plans = |text: &str| line(text, "plans_digest").to_string();
    assert!(plans(&batched).contains("(48 plans"), "{batched}");
    let alone = plan(
        &dir,
        &[&k2[..], &["--rows", "3", "--circuit-speculative-seqs", "1"]].concat(),
    );
    assert!(plans(&alone).contains("(9 plans"), "{alone}");
    assert_eq!(line(&alone, "digest"), line(&single, "digest"));
    let decode = Command::new(env!("CARGO_BIN_EXE_metrale"))
        .args(["circuit", "plan", "--seqs", "2", "--model"])
        .arg(&dir)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&decode.stderr);
    assert!(
        !decode.status.success() && stderr.contains("--seqs is for verify and draft steps"),
        "{stderr}"
    );
}
