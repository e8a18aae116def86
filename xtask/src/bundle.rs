//! `cargo xtask gpu-bundle`: everything a run on the GPU machine needs, in the git-ignored folder
//! `target/gpu-bundle/` (docs/GPU.md): the compiled kernels are embedded in release CUDA test
//! binaries (every integration test file with code under `cfg(feature = "cuda")`), the kernel
//! measurements (`metrale-model-layers`' example `kernel_bench`), the `metrale` CLI and xtask
//! built with `--features cuda` when they build, and `run.sh LOGDIR` (`bundle/run.sh`), which
//! needs only the NVIDIA driver (no Rust toolchain) on the machine that runs it.
//!
//! Layout: `payload.tar.xz` (holding `bin/`, the tools, and `tests/bin/`, test binaries one per
//! target; compressed so bundle and tree fit the device's transfer limit), `run.sh`,
//! `manifest.txt`. The bundle runs inside its working tree: `run.sh` unpacks the payload into a
//! scratch directory and changes into the tree's root, so `tests/fixtures` resolves as it does in
//! the workspace.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, bail};

/// The bundle must stay under this size (it travels to the GPU machine with the working tree).
const MAX_BUNDLE_BYTES: u64 = 60 * 1024 * 1024;

/// The test binary whose sanitizer set `run.sh` runs under compute-sanitizer's memcheck and
/// racecheck.
const SANITIZED_TEST: &str = "gpu_kernels";

/// The test filter that selects the sanitizer set in [`SANITIZED_TEST`]: every kernel at small
/// shapes, within the sanitizers' time budget.
const SANITIZER_SET: &str = "sanitizer_set";

/// The test filter of the set racecheck runs: every kernel racecheck can follow.
const RACECHECK_SET: &str = "racecheck_set";

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

    let mut manifest = build_tests(root, &test_bin)?;
    manifest.extend(build_tools(root, &bin)?);
    // The fixtures are not copied: the bundle travels inside the working tree, which holds
    // them, and `run.sh` runs the tests from the tree's root (the device's transfer limit is
    // 64 MiB for tree and bundle together).
    manifest.push("tests/fixtures/: read from the working tree (run.sh runs from its root)".into());
    pack(&bundle)?;
    manifest.push(format!(
        "{PAYLOAD}: bin/ and tests/bin/, xz-compressed; run.sh unpacks it"
    ));
    let run_sh = bundle.join("run.sh");
    let script = RUN_SH
        .replace("__SANITIZED__", SANITIZED_TEST)
        .replace("__SANITIZER_SET__", SANITIZER_SET)
        .replace("__RACECHECK_SET__", RACECHECK_SET);
    std::fs::write(&run_sh, script)?;
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

/// Build every GPU test target in release with `--features cuda` into `test_bin`; the manifest's
/// lines. A package whose tests do not build is left out (noted), unless it holds
/// [`SANITIZED_TEST`].
fn build_tests(root: &Path, test_bin: &Path) -> anyhow::Result<Vec<String>> {
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
            copy_stripped(&exe, &test_bin.join(&name))?;
            manifest.push(format!("tests/bin/{name}  ({package}, test target)"));
        }
    }
    Ok(manifest)
}

/// Build the tools `run.sh` runs into `bin`, each with `--features cuda`: the kernel
/// measurements (`kernel_bench`), the CLI (`metrale bench`, `serve`, `generate`) and xtask
/// (`xtask soak --backend cuda`: the soak against the CUDA engine; the GPU machine has no
/// cargo). One that does not build is left out (noted in the manifest).
fn build_tools(root: &Path, bin: &Path) -> anyhow::Result<Vec<String>> {
    let mut manifest = Vec::new();
    for (package, kind, exe_name) in [
        ("metrale-model-layers", "--example", "kernel_bench"),
        ("metrale-cli", "--bin", "metrale"),
        ("xtask", "--bin", "xtask"),
    ] {
        let mut cmd = cargo(root);
        cmd.args([
            "build",
            "--release",
            "--message-format=json-render-diagnostics",
            "-p",
            package,
            kind,
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
                    "gpu-bundle: warning: {package} {kind} {exe_name} did not build with --features cuda, leaving it out: {e:#}"
                );
                manifest.push(format!(
                    "NOT BUILT: {package} {kind} {exe_name} --features cuda"
                ));
            }
        }
    }
    Ok(manifest)
}

/// The executables' archive inside the bundle.
const PAYLOAD: &str = "payload.tar.xz";

/// Move `bin/` and `tests/bin/` into one xz-compressed tar ([`PAYLOAD`]), which keeps the bundle
/// and the tree within the device's transfer limit: every executable embeds the same compiled
/// kernels and most of the same code, and a 64 MiB xz dictionary reaches back across whole
/// executables (20 to 36 MB each) to find it, where level 6's 8 MiB finds it only inside one:
/// about 15 MB against 42 MB for nine test binaries and the tools (and 70 MB as gzip). `run.sh`
/// unpacks it into a scratch directory on the device.
fn pack(bundle: &Path) -> anyhow::Result<()> {
    let status = Command::new("tar")
        .current_dir(bundle)
        .env("XZ_OPT", "-T0 --lzma2=preset=6,dict=64MiB")
        .args(["-cJf", PAYLOAD, "bin", "tests"])
        .status()?;
    anyhow::ensure!(status.success(), "tar -cJf {PAYLOAD} failed ({status})");
    std::fs::remove_dir_all(bundle.join("bin"))?;
    std::fs::remove_dir_all(bundle.join("tests"))?;
    Ok(())
}

fn cargo(root: &Path) -> Command {
    let mut cmd = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    cmd.current_dir(root);
    cmd
}

/// Integration test files (`tests/*.rs` of the root package and of `crates/*`, one test binary
/// each) as (package, file), sorted by package, then file.
fn integration_tests(root: &Path) -> anyhow::Result<Vec<(String, PathBuf)>> {
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
        for file in entries.filter_map(|e| e.ok().map(|e| e.path())) {
            if file.is_file() && file.extension().is_some_and(|x| x == "rs") {
                tests.push((package.clone(), file));
            }
        }
    }
    tests.sort();
    Ok(tests)
}

/// The integration test files that mention `feature = "cuda"` (the `gpu_*` binaries, which run
/// only on a GPU, and CPU binaries with GPU variants), as (package, target).
fn gpu_tests(root: &Path) -> anyhow::Result<Vec<GpuTest>> {
    let mut tests = Vec::new();
    for (package, file) in integration_tests(root)? {
        let text = std::fs::read_to_string(&file)
            .with_context(|| format!("reading {}", file.display()))?;
        if text.contains("cfg(feature = \"cuda\")") {
            let target = file
                .file_stem()
                .context("a test file has a stem")?
                .to_string_lossy()
                .into_owned();
            tests.push(GpuTest { package, target });
        }
    }
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

/// `run.sh LOGDIR`, with `__SANITIZED__` and `__SANITIZER_SET__` to fill in: what it runs is
/// in its header.
const RUN_SH: &str = include_str!("bundle/run.sh");

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
    fn run_sh_runs_a_sanitizer_set_that_exists() {
        assert!(RUN_SH.contains("__SANITIZED__") && RUN_SH.contains("__SANITIZER_SET__"));
        assert!(RUN_SH.contains("__RACECHECK_SET__"));
        let tests = include_str!("../../crates/metrale-model-layers/tests/gpu_kernels/sanitize.rs");
        assert!(tests.contains(&format!("fn {SANITIZER_SET}")));
        assert!(tests.contains(&format!("fn {RACECHECK_SET}")));
        assert!(
            tests.contains("KERNELS"),
            "the sanitizer set checks it reached every kernel"
        );
    }

    /// The tests that need two GPUs run apart from the single-GPU run, in run.sh's
    /// tensor-parallel section, which exists with its benchmark and NCCL's settings.
    #[test]
    fn run_sh_runs_the_two_gpu_tests_apart_with_nccl_set_up() {
        assert!(RUN_SH.contains("--nocapture --skip on_two_gpus"));
        assert!(RUN_SH.contains("\"$t\" on_two_gpus --test-threads=1"));
        assert!(RUN_SH.contains("export NCCL_NVLS_ENABLE=0"));
        assert!(RUN_SH.contains("--tensor-parallel-size 2 --batches 1,32"));
        for shape in ["qwen3-32b", "qwen3-next-80b-a3b"] {
            assert!(RUN_SH.contains(shape), "{shape}");
        }
        let engine = include_str!("../../tests/gpu_engine.rs");
        assert!(engine.matches("_on_two_gpus() {").count() >= 2);
    }

    /// The naming convention of the integration tests (README, "Tests"): a binary that only
    /// runs on a GPU (its file `#![cfg(feature = "cuda")]` as a whole) is named `gpu_*`, and
    /// every `gpu_*` binary is one; the bundle finds them, and the CPU binaries with GPU
    /// variants, and puts them in one folder, so their names differ across packages.
    #[test]
    fn gpu_only_test_binaries_and_only_they_are_named_gpu() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .expect("xtask sits in the workspace");
        let files = integration_tests(root).unwrap();
        let mut gpu_only = Vec::new();
        for (package, file) in &files {
            let text = std::fs::read_to_string(file).unwrap();
            let whole = text.contains("#![cfg(feature = \"cuda\")]");
            let stem = file.file_stem().unwrap().to_string_lossy().into_owned();
            assert_eq!(
                whole,
                stem.starts_with("gpu_"),
                "{package}: {}: a test binary is named gpu_* exactly when it runs only on a GPU",
                file.display()
            );
            if whole {
                gpu_only.push(stem);
            }
        }
        assert!(gpu_only.iter().any(|t| t == SANITIZED_TEST), "{gpu_only:?}");
        let mut targets: Vec<String> = gpu_tests(root)
            .unwrap()
            .into_iter()
            .map(|t| t.target)
            .collect();
        assert!(
            targets.len() > gpu_only.len(),
            "CPU binaries with GPU variants"
        );
        let count = targets.len();
        targets.sort();
        targets.dedup();
        assert_eq!(targets.len(), count, "GPU test targets share a name");
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
