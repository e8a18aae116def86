//! `cargo xtask setup-cuda` and `cargo xtask kernels`: CUDA's compiler from the Python package
//! registry, pinned to the GPU machine's version (docs/GPU.md), in the git-ignored virtual
//! environment `.xtask/cuda-venv`; then `kernels/abi.cuh` written from `metrale-kernel-abi`
//! (`c_header`), every `kernels/*.cu` compiled to `target/kernels/<family>.cubin` (sm_90a) and
//! `target/kernels/<family>.ptx` (compute_90, the driver's fallback), which
//! `metrale-gpu-runtime`'s build script embeds under `--features cuda`, and each module's entry
//! points checked against the kernel manifest (`check_module_entries`): a kernel the manifest
//! lists but no `.cu` defines, an entry the manifest does not list, or a signature that is not
//! its parameter struct's fails the command.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use anyhow::{Context, bail};

/// The nvcc release the GPU machine runs; its cubins must not be newer than its driver.
const NVCC_VERSION: &str = "13.0.88";

/// What `pip install` puts in the environment (compiler, NVVM, headers, runtime headers).
const PACKAGES: &[&str] = &[
    "nvidia-cuda-nvcc==13.0.88",
    "nvidia-nvvm==13.0.88",
    "nvidia-cuda-crt==13.0.88",
    "nvidia-cuda-cccl==13.0.*",
    "nvidia-cuda-runtime==13.0.*",
];

/// Flags shared by both outputs: optimised, with line info for profilers, no fast math.
const COMMON_FLAGS: &[&str] = &["-O3", "-lineinfo", "-std=c++17", "-Xptxas=-warn-spills"];

/// The virtual environment holding nvcc.
pub fn venv_dir(root: &Path) -> PathBuf {
    root.join(".xtask").join("cuda-venv")
}

/// `<venv>/lib/python3.*/site-packages/nvidia/cu13`, if the packages are installed.
fn cuda_home(venv: &Path) -> Option<PathBuf> {
    let lib = venv.join("lib");
    let mut pythons: Vec<PathBuf> = std::fs::read_dir(&lib)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("python3"))
        })
        .collect();
    pythons.sort();
    pythons
        .into_iter()
        .map(|p| p.join("site-packages").join("nvidia").join("cu13"))
        .find(|home| home.join("bin").join("nvcc").is_file())
}

/// The installed nvcc, if it reports the pinned version.
fn pinned_nvcc(venv: &Path) -> Option<PathBuf> {
    let nvcc = cuda_home(venv)?.join("bin").join("nvcc");
    let out = Command::new(&nvcc).arg("--version").output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    (out.status.success() && text.contains(&format!("V{NVCC_VERSION}"))).then_some(nvcc)
}

/// Make sure `.xtask/cuda-venv` holds nvcc 13.0.88 (reusing it when it does) and return nvcc.
pub fn setup_cuda(root: &Path) -> anyhow::Result<PathBuf> {
    let venv = venv_dir(root);
    if let Some(nvcc) = pinned_nvcc(&venv) {
        eprintln!("setup-cuda: reusing {}", nvcc.display());
        return Ok(nvcc);
    }
    let python = venv.join("bin").join("python");
    if !python.is_file() {
        eprintln!("setup-cuda: creating {}", venv.display());
        std::fs::create_dir_all(venv.parent().context("venv path has a parent")?)?;
        run(
            Command::new("python3").args(["-m", "venv"]).arg(&venv),
            "python3 -m venv",
        )?;
    }
    eprintln!("setup-cuda: pip install {}", PACKAGES.join(" "));
    let started = std::time::Instant::now();
    run(
        Command::new(&python)
            .args([
                "-m",
                "pip",
                "install",
                "--disable-pip-version-check",
                "--no-input",
                "--progress-bar",
                "off",
            ])
            .args(PACKAGES),
        "pip install (CUDA compiler packages)",
    )?;
    eprintln!(
        "setup-cuda: installed in {:.0} s",
        started.elapsed().as_secs_f64()
    );
    pinned_nvcc(&venv).with_context(|| {
        format!("pip finished but no nvcc {NVCC_VERSION} under {}/lib/python3.*/site-packages/nvidia/cu13/bin", venv.display())
    })
}

/// Run a command with inherited output; fail naming `what` unless it succeeds.
fn run(cmd: &mut Command, what: &str) -> anyhow::Result<()> {
    let status = cmd
        .status()
        .with_context(|| format!("starting {what} ({cmd:?})"))?;
    if !status.success() {
        bail!("{what} failed ({status}): {cmd:?}");
    }
    Ok(())
}

/// One nvcc invocation: a source, an output, and what kind of output.
struct Job {
    source: PathBuf,
    output: PathBuf,
    args: Vec<String>,
}

/// Write `kernels/abi.cuh` from the kernel ABI crate, leaving the file (and its modification
/// time) alone when it already holds that text.
pub fn write_abi_header(root: &Path) -> anyhow::Result<()> {
    let path = root.join(metrale_kernel_abi::header::HEADER_PATH);
    let text = metrale_kernel_abi::c_header();
    if std::fs::read_to_string(&path).ok().as_deref() != Some(text.as_str()) {
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        eprintln!("kernels: wrote {}", path.display());
    }
    Ok(())
}

/// Every module's PTX entry points against the manifest; and every module of the manifest has a
/// `.cu` source.
fn check_manifest(out_dir: &Path, sources: &[PathBuf]) -> anyhow::Result<()> {
    let mut problems = Vec::new();
    let stems: Vec<String> = sources
        .iter()
        .filter_map(|p| p.file_stem().map(|s| s.to_string_lossy().into_owned()))
        .collect();
    for module in metrale_kernel_abi::manifest::modules() {
        if !stems.iter().any(|s| s == module) {
            problems.push(format!(
                "the manifest lists kernels of module `{module}`, but there is no kernels/{module}.cu"
            ));
        }
    }
    for stem in &stems {
        let ptx = out_dir.join(format!("{stem}.ptx"));
        let text =
            std::fs::read_to_string(&ptx).with_context(|| format!("reading {}", ptx.display()))?;
        if let Err(p) = metrale_kernel_abi::check_module_entries(stem, &text) {
            problems.extend(p);
        }
    }
    if !problems.is_empty() {
        bail!(
            "the compiled kernels disagree with the kernel manifest:\n  {}",
            problems.join("\n  ")
        );
    }
    Ok(())
}

/// Write `kernels/abi.cuh`, compile every `kernels/*.cu` to `target/kernels/<family>.cubin` and
/// `.ptx`, and check the entry points against the manifest. Shows every warning; fails
/// (removing that output) on any compile error.
pub fn kernels(root: &Path) -> anyhow::Result<()> {
    write_abi_header(root)?;
    let nvcc = setup_cuda(root)?;
    let home = nvcc
        .parent()
        .and_then(Path::parent)
        .context("nvcc lies in <home>/bin")?;
    let cccl = home.join("include").join("cccl");
    let sources_dir = root.join("kernels");
    let out_dir = root.join("target").join("kernels");
    std::fs::create_dir_all(&out_dir).with_context(|| format!("creating {}", out_dir.display()))?;

    let mut sources: Vec<PathBuf> = std::fs::read_dir(&sources_dir)
        .with_context(|| format!("reading {}", sources_dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "cu"))
        .collect();
    sources.sort();
    if sources.is_empty() {
        bail!("no kernels/*.cu found under {}", sources_dir.display());
    }

    let include = format!("-I{}", cccl.display());
    let jobs = compile_jobs(&sources, &out_dir, &include, &sources_dir)?;
    let started = std::time::Instant::now();
    let results = run_jobs(&nvcc, &jobs);
    let failed = report(&nvcc, &jobs, results);
    if !failed.is_empty() {
        bail!("nvcc failed for: {}", failed.join(", "));
    }
    check_manifest(&out_dir, &sources)?;
    eprintln!(
        "kernels: {} families compiled to {} in {:.1} s",
        sources.len(),
        out_dir.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// One cubin and one PTX job for each source, into `out_dir`.
fn compile_jobs(
    sources: &[PathBuf],
    out_dir: &Path,
    include: &str,
    sources_dir: &Path,
) -> anyhow::Result<Vec<Job>> {
    let mut jobs = Vec::new();
    for source in sources {
        let stem = source
            .file_stem()
            .context("a .cu file has a stem")?
            .to_string_lossy()
            .into_owned();
        let cubin = ["-cubin", "-gencode=arch=compute_90a,code=sm_90a"];
        let ptx = ["-ptx", "-arch=compute_90"];
        for (kind, target) in [("cubin", &cubin[..]), ("ptx", &ptx[..])] {
            let output = out_dir.join(format!("{stem}.{kind}"));
            let mut args: Vec<String> = target.iter().map(|s| s.to_string()).collect();
            args.extend(COMMON_FLAGS.iter().map(|s| s.to_string()));
            args.push(include.to_string());
            args.push(format!("-I{}", sources_dir.display()));
            args.push("-o".into());
            args.push(output.display().to_string());
            args.push(source.display().to_string());
            jobs.push(Job {
                source: source.clone(),
                output,
                args,
            });
        }
    }
    Ok(jobs)
}

/// Run the jobs on every core; each job's index with its output, in job order.
fn run_jobs(nvcc: &Path, jobs: &[Job]) -> Vec<(usize, std::io::Result<Output>)> {
    let workers = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .min(jobs.len());
    let next = std::sync::atomic::AtomicUsize::new(0);
    let mut results: Vec<(usize, std::io::Result<Output>)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                scope.spawn(|| {
                    let mut done = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(job) = jobs.get(i) else { break };
                        done.push((i, Command::new(nvcc).args(&job.args).output()));
                    }
                    done
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_default())
            .collect()
    });
    results.sort_by_key(|(i, _)| *i);
    results
}

/// Print every job's diagnostics; the outputs that failed (each removed).
fn report(
    nvcc: &Path,
    jobs: &[Job],
    results: Vec<(usize, std::io::Result<Output>)>,
) -> Vec<String> {
    let mut failed = Vec::new();
    for (i, result) in results {
        let job = &jobs[i];
        let name = job
            .output
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        match result {
            Ok(out) => {
                let diagnostics = format!(
                    "{}{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                );
                if !diagnostics.trim().is_empty() {
                    eprintln!(
                        "--- {name} ({}):\n{}",
                        job.source.display(),
                        diagnostics.trim_end()
                    );
                }
                if !out.status.success() {
                    let _ = std::fs::remove_file(&job.output);
                    failed.push(name);
                }
            }
            Err(e) => {
                eprintln!("--- {name}: could not start {}: {e}", nvcc.display());
                failed.push(name);
            }
        }
    }
    failed
}
