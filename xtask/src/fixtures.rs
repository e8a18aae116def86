//! `cargo xtask fixtures [--only NAME]`: regenerate the tiny test checkpoints and their
//! transformers reference outputs under `tests/fixtures/`.
//!
//! Creates the Python venv `.xtask/fixtures-venv` (git-ignored) under the workspace root if it is
//! missing, installs the pinned `xtask/fixtures/requirements.txt` into it, then runs
//! `xtask/fixtures/gen_fixtures.py --out tests/fixtures [--only NAME]`.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

/// The venv, relative to the workspace root.
pub const VENV_DIR: &str = ".xtask/fixtures-venv";
/// Pinned Python requirements, relative to the workspace root.
pub const REQUIREMENTS: &str = "xtask/fixtures/requirements.txt";
/// The generator script, relative to the workspace root.
pub const GENERATOR: &str = "xtask/fixtures/gen_fixtures.py";
/// Output root of the fixtures, relative to the workspace root.
pub const OUT_DIR: &str = "tests/fixtures";

/// Regenerate all fixtures, or only `only`, under `<root>/tests/fixtures`.
pub fn run(root: &Path, only: Option<&str>) -> Result<()> {
    let venv = root.join(VENV_DIR);
    let python = venv_python(&venv);
    if !python.exists() {
        let host = host_python()?;
        eprintln!(
            "xtask fixtures: creating venv {} with {host}",
            venv.display()
        );
        run_cmd(Command::new(&host).arg("-m").arg("venv").arg(&venv))?;
    }

    eprintln!("xtask fixtures: pip install -r {REQUIREMENTS}");
    run_cmd(
        Command::new(&python)
            .args([
                "-m",
                "pip",
                "install",
                "--disable-pip-version-check",
                "--quiet",
                "-r",
            ])
            .arg(root.join(REQUIREMENTS))
            .current_dir(root),
    )?;

    let mut cmd = Command::new(&python);
    cmd.arg(root.join(GENERATOR))
        .arg("--out")
        .arg(root.join(OUT_DIR))
        .current_dir(root);
    if let Some(name) = only {
        cmd.arg("--only").arg(name);
    }
    run_cmd(&mut cmd)
}

/// The workspace root: the parent of the xtask crate.
pub fn workspace_root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().unwrap_or(manifest).to_path_buf()
}

fn venv_python(venv: &Path) -> PathBuf {
    if cfg!(windows) {
        venv.join("Scripts").join("python.exe")
    } else {
        venv.join("bin").join("python")
    }
}

/// A Python 3 interpreter on PATH to create the venv with.
fn host_python() -> Result<String> {
    for candidate in ["python3", "python"] {
        let ok = Command::new(candidate)
            .args([
                "-c",
                "import sys, venv; sys.exit(0 if sys.version_info >= (3, 10) else 1)",
            ])
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false);
        if ok {
            return Ok(candidate.to_string());
        }
    }
    bail!("no Python >= 3.10 with the venv module found on PATH (tried python3, python)")
}

fn run_cmd(cmd: &mut Command) -> Result<()> {
    let shown = format!("{cmd:?}");
    let status = cmd
        .status()
        .with_context(|| format!("failed to start {shown}"))?;
    if !status.success() {
        bail!("{shown} failed with {status}");
    }
    Ok(())
}
