//! `cargo xtask gpu-bundle`: everything a run on the GPU machine needs, in the git-ignored folder
//! `target/gpu-bundle/` (docs/GPU.md): the compiled kernels are embedded in release CUDA test
//! binaries (every integration test file with code under `cfg(feature = "cuda")`), the `metrale` CLI
//! built with `--features cuda` when it builds, and `run.sh LOGDIR`, which needs only the NVIDIA
//! driver (no Rust toolchain) on the machine that runs it.
//!
//! Layout: `payload.tar.gz` (holding `bin/`, the CLI, and `tests/bin/`, test binaries one per
//! target; compressed so bundle and tree fit the device's transfer limit), `run.sh`,
//! `manifest.txt`. The bundle runs inside its working tree: `run.sh` unpacks the payload into a
//! scratch directory and changes into the tree's root, so `tests/fixtures` resolves as it does in
//! the workspace.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, bail};

/// The bundle must stay under this size (it travels to the GPU machine with the working tree).
const MAX_BUNDLE_BYTES: u64 = 60 * 1024 * 1024;

/// The test binary that `run.sh` also runs under `compute-sanitizer --tool memcheck`.
const SANITIZED_TEST: &str = "gpu_kernels";

/// An integration test target that exercises the GPU.
#[derive(Debug)]
struct GpuTest {
    package: String,
    target: String,
}

/// Build `target/gpu-bundle/`; see the module header.
pub fn gpu_bundle(root: &Path) -> anyhow::Result<()> {
    crate::cuda::kernels(root)?;
    let bundle = root.join("target").join("gpu-bundle");
    if bundle.exists() {
        std::fs::remove_dir_all(&bundle)
            .with_context(|| format!("clearing {}", bundle.display()))?;
    }
    let test_bin = bundle.join("tests").join("bin");
    let bin = bundle.join("bin");
    std::fs::create_dir_all(&test_bin)?;
    std::fs::create_dir_all(&bin)?;

    let tests = gpu_tests(root)?;
    if tests.is_empty() {
        bail!("no integration test has code under `cfg(feature = \"cuda\")`; nothing to bundle");
    }
    let mut manifest = Vec::new();
    let mut packages: Vec<&str> = tests.iter().map(|t| t.package.as_str()).collect();
    packages.dedup();
    for package in packages {
        let mut cmd = cargo(root);
        cmd.args([
            "test",
            "--release",
            "--no-run",
            "--message-format=json-render-diagnostics",
            "-p",
            package,
            "--features",
            "cuda",
        ]);
        for t in tests.iter().filter(|t| t.package == package) {
            cmd.args(["--test", &t.target]);
        }
        let exes = match built_executables(&mut cmd, true) {
            Ok(exes) => exes,
            Err(e)
                if !tests
                    .iter()
                    .any(|t| t.package == package && t.target == SANITIZED_TEST) =>
            {
                eprintln!(
                    "gpu-bundle: warning: the GPU tests of {package} did not build, leaving them out: {e:#}"
                );
                for t in tests.iter().filter(|t| t.package == package) {
                    manifest.push(format!("NOT BUILT: {package} --test {}", t.target));
                }
                continue;
            }
            Err(e) => return Err(e),
        };
        for exe in exes {
            let name = target_name(&exe);
            let dst = test_bin.join(&name);
            copy_stripped(&exe, &dst)?;
            manifest.push(format!("tests/bin/{name}  ({package}, test target)"));
        }
    }

    // The CLI (`metrale bench`, `serve`, `generate`) and xtask (`xtask soak --backend cuda`:
    // the soak against the CUDA engine; the GPU machine has no cargo).
    for (package, exe_name) in [("metrale-cli", "metrale"), ("xtask", "xtask")] {
        let mut cmd = cargo(root);
        cmd.args([
            "build",
            "--release",
            "--message-format=json-render-diagnostics",
            "-p",
            package,
            "--bin",
            exe_name,
            "--features",
            "cuda",
        ]);
        match built_executables(&mut cmd, false) {
            Ok(exes) => {
                for exe in exes {
                    copy_stripped(&exe, &bin.join(exe_name))?;
                    manifest.push(format!("bin/{exe_name}  ({package} --features cuda)"));
                }
            }
            Err(e) => {
                eprintln!(
                    "gpu-bundle: warning: {package} did not build with --features cuda, leaving it out: {e:#}"
                );
                manifest.push(format!(
                    "NOT BUILT: {package} --bin {exe_name} --features cuda"
                ));
            }
        }
    }

    // The fixtures are not copied: the bundle travels inside the working tree, which holds
    // them, and `run.sh` runs the tests from the tree's root (the device's transfer limit is
    // 64 MiB for tree and bundle together).
    manifest.push("tests/fixtures/: read from the working tree (run.sh runs from its root)".into());
    pack(&bundle)?;
    manifest.push(format!(
        "{PAYLOAD}: bin/ and tests/bin/, gzip-compressed; run.sh unpacks it"
    ));
    let run_sh = bundle.join("run.sh");
    std::fs::write(&run_sh, RUN_SH.replace("__SANITIZED__", SANITIZED_TEST))?;
    set_executable(&run_sh)?;
    std::fs::write(bundle.join("manifest.txt"), manifest.join("\n") + "\n")?;

    let size = dir_size(&bundle)?;
    eprintln!(
        "gpu-bundle: {} ({:.1} MB)",
        bundle.display(),
        size as f64 / 1e6
    );
    for line in &manifest {
        eprintln!("  {line}");
    }
    if size > MAX_BUNDLE_BYTES {
        bail!("the bundle is {size} bytes, over the {MAX_BUNDLE_BYTES}-byte limit");
    }
    Ok(())
}

/// The executables' archive inside the bundle.
const PAYLOAD: &str = "payload.tar.gz";

/// Move `bin/` and `tests/bin/` into one gzip-compressed tar ([`PAYLOAD`]): stripped Rust
/// executables compress about threefold, which keeps the bundle and the tree within the device's
/// transfer limit. `run.sh` unpacks it into a scratch directory on the device.
fn pack(bundle: &Path) -> anyhow::Result<()> {
    let status = Command::new("tar")
        .current_dir(bundle)
        .args(["-czf", PAYLOAD, "bin", "tests"])
        .status()?;
    anyhow::ensure!(status.success(), "tar -czf {PAYLOAD} failed ({status})");
    std::fs::remove_dir_all(bundle.join("bin"))?;
    std::fs::remove_dir_all(bundle.join("tests"))?;
    Ok(())
}

fn cargo(root: &Path) -> Command {
    let mut cmd = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    cmd.current_dir(root);
    cmd
}

/// Integration test files (`tests/*.rs` of the root package and of `crates/*`) that mention
/// `feature = "cuda"`, as (package, target).
fn gpu_tests(root: &Path) -> anyhow::Result<Vec<GpuTest>> {
    let mut dirs = vec![(root.join("tests"), "metrale".to_string())];
    for entry in std::fs::read_dir(root.join("crates"))? {
        let path = entry?.path();
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        dirs.push((path.join("tests"), name));
    }
    let mut tests = Vec::new();
    for (dir, package) in dirs {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        let mut files: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
        files.sort();
        for file in files {
            if file.extension().is_none_or(|x| x != "rs") {
                continue;
            }
            let text = std::fs::read_to_string(&file)
                .with_context(|| format!("reading {}", file.display()))?;
            if text.contains("cfg(feature = \"cuda\")") {
                let target = file
                    .file_stem()
                    .context("a test file has a stem")?
                    .to_string_lossy()
                    .into_owned();
                tests.push(GpuTest {
                    package: package.clone(),
                    target,
                });
            }
        }
    }
    tests.sort_by(|a, b| (&a.package, &a.target).cmp(&(&b.package, &b.target)));
    Ok(tests)
}

/// Run a cargo build with JSON messages and return the executables it produced (test
/// executables when `tests`, else binaries).
fn built_executables(cmd: &mut Command, tests: bool) -> anyhow::Result<Vec<PathBuf>> {
    eprintln!("gpu-bundle: {cmd:?}");
    let out = cmd
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("starting {cmd:?}"))?;
    if !out.status.success() {
        bail!("{cmd:?} failed ({})", out.status);
    }
    let mut exes = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        if !line.contains("\"reason\":\"compiler-artifact\"") {
            continue;
        }
        let is_test = profile_is_test(line);
        if is_test != tests {
            continue;
        }
        if let Some(exe) = json_string_field(line, "executable") {
            exes.push(PathBuf::from(exe));
        }
    }
    Ok(exes)
}

/// Whether a cargo artifact line was built by the test profile (`"profile":{..."test":true}`;
/// the target object has a `test` field of its own, meaning only "is testable").
fn profile_is_test(line: &str) -> bool {
    line.split_once("\"profile\":{")
        .and_then(|(_, rest)| rest.split_once('}'))
        .is_some_and(|(profile, _)| profile.contains("\"test\":true"))
}

/// The value of a string field of a flat JSON line (cargo's paths hold no quotes or escapes).
fn json_string_field(line: &str, field: &str) -> Option<String> {
    let key = format!("\"{field}\":\"");
    let start = line.find(&key)? + key.len();
    let end = line[start..].find('"')? + start;
    Some(line[start..end].replace("\\\\", "\\"))
}

/// `gpu_kernels-0123abcd` -> `gpu_kernels`.
fn target_name(exe: &Path) -> String {
    let stem = exe
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    match stem.rsplit_once('-') {
        Some((name, hash)) if hash.len() == 16 && hash.chars().all(|c| c.is_ascii_hexdigit()) => {
            name.to_string()
        }
        _ => stem,
    }
}

/// Copy an executable, dropping its debug info with `strip` when there is one.
fn copy_stripped(src: &Path, dst: &Path) -> anyhow::Result<()> {
    std::fs::copy(src, dst)
        .with_context(|| format!("copying {} to {}", src.display(), dst.display()))?;
    match Command::new("strip").arg("--strip-all").arg(dst).status() {
        Ok(s) if s.success() => {}
        _ => eprintln!(
            "gpu-bundle: note: `strip --strip-all {}` did not run; kept as built",
            dst.display()
        ),
    }
    set_executable(dst)
}

fn set_executable(path: &Path) -> anyhow::Result<()> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mut perms = std::fs::metadata(path)?.permissions();
        perms.set_mode(0o755);
        std::fs::set_permissions(path, perms)?;
    }
    Ok(())
}

fn dir_size(dir: &Path) -> anyhow::Result<u64> {
    let mut total = 0;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        total += if entry.file_type()?.is_dir() {
            dir_size(&entry.path())?
        } else {
            entry.metadata()?.len()
        };
    }
    Ok(total)
}

/// `run.sh LOGDIR`: runs every test binary (one test at a time, output uncaptured), then its
/// ignored tests (measurements), the kernel tests again under compute-sanitizer's memcheck (device
/// memory errors only: host API errors are the backend's own `GpuError`s, and the tests provoke
/// some on purpose), and a CLI smoke run; writes each full log and
/// `results.json` to LOGDIR; prints a short summary table last. Exits non-zero if anything failed.
const RUN_SH: &str = r#"#!/usr/bin/env bash
# Run the metrale GPU bundle: bash run.sh LOGDIR  (written by `cargo xtask gpu-bundle`).
# Needs the NVIDIA driver; CUDA's tools (compute-sanitizer) are used when found.
set -uo pipefail
BUNDLE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
LOGDIR="${1:?usage: run.sh LOGDIR}"
mkdir -p "$LOGDIR"
LOGDIR="$(cd "$LOGDIR" && pwd)"
# The executables travel compressed (payload.tar.gz); unpack them into a scratch directory.
BIN_ROOT="$(mktemp -d "${TMPDIR:-/tmp}/metrale-bundle.XXXXXX")"
trap 'rm -rf "$BIN_ROOT"' EXIT
tar -xzf "$BUNDLE/payload.tar.gz" -C "$BIN_ROOT" || { echo "run.sh: cannot unpack $BUNDLE/payload.tar.gz" >&2; exit 2; }
# Run from the working tree's root (target/gpu-bundle/../..), where tests/fixtures lives.
cd "$BUNDLE/../.."
[ -d tests/fixtures ] || { echo "run.sh: no tests/fixtures under $(pwd): run the bundle inside its working tree" >&2; exit 2; }
TEST_TIMEOUT="${TEST_TIMEOUT:-300}"

declare -a ROWS=()
JSON="$LOGDIR/results.json"
echo "[" > "$JSON"
FIRST=1
FAILED=0

record() { # name status passed failed seconds log
  ROWS+=("$(printf '%-28s %-8s %7s %7s %9s' "$1" "$2" "$3" "$4" "$5")")
  [ $FIRST -eq 1 ] || echo "," >> "$JSON"
  FIRST=0
  printf '  {"name": "%s", "status": "%s", "passed": %s, "failed": %s, "seconds": %s, "log": "%s"}' \
    "$1" "$2" "$3" "$4" "$5" "$6" >> "$JSON"
  [ "$2" = "ok" ] || FAILED=1
}

counts() { # log -> "passed failed" summed over every `test result:` line
  awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i } }
       END { printf "%d %d", p, f }' "$1"
}

now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

{ nvidia-smi || true; } > "$LOGDIR/nvidia-smi.txt" 2>&1

for t in "$BIN_ROOT"/tests/bin/*; do
  [ -x "$t" ] || continue
  name="$(basename "$t")"
  log="$LOGDIR/$name.log"
  start="$(now)"
  timeout "$TEST_TIMEOUT" "$t" --test-threads=1 --nocapture > "$log" 2>&1
  rc=$?
  secs="$(elapsed "$start")"
  read -r passed failed < <(counts "$log")
  status=ok
  [ $rc -eq 0 ] || status="fail($rc)"
  [ $rc -eq 124 ] && status=timeout
  record "$name" "$status" "$passed" "$failed" "$secs" "$log"
done

# Ignored tests are measurements (speed beside its ceilings); run them after the checks.
for t in "$BIN_ROOT"/tests/bin/*; do
  [ -x "$t" ] || continue
  name="$(basename "$t")"
  if [ "$("$t" --list --ignored 2>/dev/null | grep -c ': test$')" -gt 0 ]; then
    log="$LOGDIR/$name-measure.log"
    start="$(now)"
    timeout "$TEST_TIMEOUT" "$t" --ignored --test-threads=1 --nocapture > "$log" 2>&1
    rc=$?
    read -r passed failed < <(counts "$log")
    status=ok
    [ $rc -eq 0 ] || status="fail($rc)"
    [ $rc -eq 124 ] && status=timeout
    record "$name --ignored" "$status" "$passed" "$failed" "$(elapsed "$start")" "$log"
  fi
done

SAN=""
for c in compute-sanitizer /usr/local/cuda/bin/compute-sanitizer; do
  if command -v "$c" > /dev/null 2>&1; then SAN="$c"; break; fi
done
# compute-sanitizer over the kernel tests: memcheck (the bundle's gate) and racecheck (shared
# memory hazards). Device errors only: host API errors are the backend's own `GpuError`s, and the
# tests provoke some on purpose.
for tool in memcheck racecheck; do
  [ -x "$BIN_ROOT/tests/bin/__SANITIZED__" ] || break
  log="$LOGDIR/$tool.log"
  if [ -n "$SAN" ]; then
    start="$(now)"
    timeout "$TEST_TIMEOUT" "$SAN" --tool "$tool" --report-api-errors no --error-exitcode 86 \
      "$BIN_ROOT/tests/bin/__SANITIZED__" --test-threads=1 > "$log" 2>&1
    rc=$?
    secs="$(elapsed "$start")"
    read -r passed failed < <(counts "$log")
    errors="$(grep -o -E '(ERROR SUMMARY: [0-9]+ error|RACECHECK SUMMARY: [0-9]+ hazard)' "$log" | tail -n 1 | grep -o -E '[0-9]+' || true)"
    status=ok
    [ $rc -eq 0 ] || status="fail($rc)"
    [ $rc -eq 124 ] && status=timeout
    record "$tool:__SANITIZED__(${errors:-?}err)" "$status" "$passed" "$failed" "$secs" "$log"
  else
    echo "compute-sanitizer not found" > "$log"
    record "$tool:__SANITIZED__" "skipped" 0 0 0 "$log"
  fi
done

if [ -x "$BIN_ROOT/bin/metrale" ]; then
  log="$LOGDIR/metrale-cli.log"
  start="$(now)"
  timeout 60 "$BIN_ROOT/bin/metrale" --help > "$log" 2>&1
  rc=$?
  status=ok
  [ $rc -eq 0 ] || status="fail($rc)"
  record "metrale --help" "$status" 0 0 "$(elapsed "$start")" "$log"
  # The benchmark (BENCH_SHAPES, default qwen3-8b and qwen3.5-9b): each figure beside its roofline.
  for shape in ${BENCH_SHAPES:-qwen3-8b qwen3.5-9b}; do
    log="$LOGDIR/bench-$shape.log"
    start="$(now)"
    timeout "${BENCH_TIMEOUT:-400}" "$BIN_ROOT/bin/metrale" bench --shape "$shape" --backend cuda \
      --json-out "$LOGDIR/bench-$shape.json" > "$log" 2>&1
    rc=$?
    status=ok
    [ $rc -eq 0 ] || status="fail($rc)"
    [ $rc -eq 124 ] && status=timeout
    record "bench $shape" "$status" 0 0 "$(elapsed "$start")" "$log"
  done
  # Issue 7's speculative figures on the hybrid shape (SPEC_BENCH=0 skips them): verify and
  # draft steps beside a plain decode step, projected and end-to-end tokens/s.
  if [ "${SPEC_BENCH:-1}" != 0 ]; then
    log="$LOGDIR/spec-bench-qwen3.5-9b.log"
    start="$(now)"
    timeout "${BENCH_TIMEOUT:-400}" "$BIN_ROOT/bin/metrale" bench --speculative --shape qwen3.5-9b \
      --backend cuda --num-draft-tokens 4 --json-out "$LOGDIR/spec-bench-qwen3.5-9b.json" > "$log" 2>&1
    rc=$?
    status=ok
    [ $rc -eq 0 ] || status="fail($rc)"
    [ $rc -eq 124 ] && status=timeout
    record "bench --speculative qwen3.5-9b" "$status" 0 0 "$(elapsed "$start")" "$log"
  fi
fi

# The soak (many concurrent requests with cancellations, shared prefixes and preemption; every
# output checked against its solo run) on the CUDA engine, over the dense and hybrid fixtures.
if [ -x "$BIN_ROOT/bin/xtask" ]; then
  log="$LOGDIR/soak-cuda.log"
  start="$(now)"
  timeout "${SOAK_TIMEOUT:-300}" "$BIN_ROOT/bin/xtask" soak --backend cuda \
    --model tests/fixtures/qwen3-tiny --model tests/fixtures/qwen3_5-tiny > "$log" 2>&1
  rc=$?
  status=ok
  [ $rc -eq 0 ] || status="fail($rc)"
  [ $rc -eq 124 ] && status=timeout
  record "soak cuda" "$status" 0 0 "$(elapsed "$start")" "$log"
fi

echo "" >> "$JSON"
echo "]" >> "$JSON"

# Per-kernel worst errors printed by the kernel tests (`kernel-check` lines).
grep -h -o 'kernel-check.*' "$LOGDIR"/*.log 2>/dev/null > "$LOGDIR/kernel-errors.txt" || true
if [ -s "$LOGDIR/kernel-errors.txt" ]; then
  echo "== worst error per kernel (tests/bin/__SANITIZED__) =="
  grep -h -o 'kernel-check.*' "$LOGDIR/__SANITIZED__.log" 2>/dev/null || true
fi
for f in "$LOGDIR"/bench-*.log; do
  [ -f "$f" ] && { echo "== $(basename "$f" .log) =="; tail -n 12 "$f"; }
done
for f in "$LOGDIR"/spec-bench-*.log; do
  [ -f "$f" ] && { echo "== $(basename "$f" .log) =="; tail -n 40 "$f"; }
done
if grep -q '^bench' "$LOGDIR"/*-measure.log 2>/dev/null; then
  echo "== measurements =="
  grep -h '^bench' "$LOGDIR"/*-measure.log
fi
echo "== failures =="
grep -h -A1 -E 'panicked at' "$LOGDIR"/*.log 2>/dev/null | grep -v -E '^(--|stack backtrace:)$' | head -n 40 || true
grep '^NOT BUILT' "$BUNDLE/manifest.txt" 2>/dev/null || true
echo "== summary (logs in $LOGDIR) =="
printf '%-28s %-8s %7s %7s %9s\n' "binary" "status" "passed" "failed" "seconds"
for r in "${ROWS[@]}"; do echo "$r"; done
exit $FAILED
"#;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cargo_hashes_are_dropped_from_test_names() {
        assert_eq!(
            target_name(Path::new("/t/release/deps/gpu_kernels-0a1b2c3d4e5f6789")),
            "gpu_kernels"
        );
        assert_eq!(
            target_name(Path::new("/t/release/deps/cafe-bad")),
            "cafe-bad"
        );
        assert_eq!(target_name(Path::new("/t/release/metrale")), "metrale");
        assert_eq!(
            target_name(Path::new("/t/release/deps/eager-vs-graph")),
            "eager-vs-graph"
        );
    }

    #[test]
    fn executable_paths_are_read_from_cargo_json() {
        let line = r#"{"reason":"compiler-artifact","profile":{"test":true},"executable":"/w/target/release/deps/gpu_kernels-12ab","fresh":true}"#;
        assert_eq!(
            json_string_field(line, "executable").as_deref(),
            Some("/w/target/release/deps/gpu_kernels-12ab")
        );
        assert_eq!(json_string_field(line, "missing"), None);
        assert!(profile_is_test(line));
        let bin = r#"{"reason":"compiler-artifact","target":{"kind":["bin"],"test":true},"profile":{"opt_level":"3","test":false},"executable":"/w/target/release/metrale"}"#;
        assert!(!profile_is_test(bin));
    }
}
