//! With the `cuda` feature, embeds the compiled kernels: for every `kernels/<module>.cu` of the
//! workspace, `target/kernels/<module>.cubin` and `<module>.ptx` (written by `cargo xtask
//! kernels`) become `(module, cubin, ptx)` entries of `$OUT_DIR/embedded_kernels.rs`, after
//! checking each module's entry points against the kernel manifest (`metrale-kernel-abi`): a
//! kernel the manifest lists that no module defines, an entry it does not list, or a signature
//! that is not its parameter struct's fails the build. Without the feature it writes nothing and
//! embeds nothing.

use std::path::{Path, PathBuf};

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-env-changed=CARGO_FEATURE_CUDA");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let manifest =
        PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let root = manifest
        .ancestors()
        .find(|p| {
            p.join("kernels").is_dir() && p.join("Cargo.toml").is_file() && p.join("xtask").is_dir()
        })
        .unwrap_or_else(|| {
            panic!(
                "no workspace root with kernels/ above {}",
                manifest.display()
            )
        })
        .to_path_buf();
    let sources = root.join("kernels");
    let compiled = root.join("target").join("kernels");
    println!("cargo::rerun-if-changed={}", sources.display());
    println!("cargo::rerun-if-changed={}", compiled.display());

    let mut modules: Vec<(String, PathBuf)> = std::fs::read_dir(&sources)
        .unwrap_or_else(|e| panic!("reading {}: {e}", sources.display()))
        .filter_map(|entry| {
            let path = entry.ok()?.path();
            if path.extension()? != "cu" {
                return None;
            }
            Some((path.file_stem()?.to_string_lossy().into_owned(), path))
        })
        .collect();
    modules.sort();

    let newest_header = newest_mtime(&sources, "cuh");
    let mut missing = Vec::new();
    let mut entries = String::from("&[\n");
    for (module, source) in &modules {
        let cubin = compiled.join(format!("{module}.cubin"));
        let ptx = compiled.join(format!("{module}.ptx"));
        for path in [&cubin, &ptx] {
            if !path.is_file() {
                missing.push(path.display().to_string());
            } else if is_older(path, source)
                || newest_header.is_some_and(|h| mtime(path).is_some_and(|t| t < h))
            {
                println!(
                    "cargo::warning={} is older than its sources: run `cargo xtask kernels`",
                    path.display()
                );
            }
        }
        entries.push_str(&format!(
            "    ({module:?}, include_bytes!({:?}), include_bytes!({:?})),\n",
            cubin.display().to_string(),
            ptx.display().to_string()
        ));
    }
    entries.push_str("]\n");
    let mut problems = Vec::new();
    for module in metrale_kernel_abi::manifest::modules() {
        if !modules.iter().any(|(m, _)| m == module) {
            problems.push(format!(
                "the manifest lists kernels of `{module}`, but there is no kernels/{module}.cu"
            ));
        }
    }
    for (module, _) in &modules {
        let ptx = compiled.join(format!("{module}.ptx"));
        if let Ok(text) = std::fs::read_to_string(&ptx)
            && let Err(p) = metrale_kernel_abi::check_module_entries(module, &text)
        {
            problems.extend(p);
        }
    }
    if !problems.is_empty() {
        panic!(
            "the compiled kernels disagree with the kernel manifest:\n  {}\nrun `cargo xtask kernels` after changing a kernel or the manifest",
            problems.join("\n  ")
        );
    }
    if !missing.is_empty() {
        panic!(
            "the `cuda` feature embeds the compiled kernels, but these are missing:\n  {}\nrun `cargo xtask kernels` (after `cargo xtask setup-cuda` on a fresh machine)",
            missing.join("\n  ")
        );
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"))
        .join("embedded_kernels.rs");
    std::fs::write(&out, entries).unwrap_or_else(|e| panic!("writing {}: {e}", out.display()));
}

fn mtime(path: &Path) -> Option<std::time::SystemTime> {
    std::fs::metadata(path).ok()?.modified().ok()
}

fn is_older(artifact: &Path, source: &Path) -> bool {
    matches!((mtime(artifact), mtime(source)), (Some(a), Some(s)) if a < s)
}

fn newest_mtime(dir: &Path, ext: &str) -> Option<std::time::SystemTime> {
    std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == ext))
        .filter_map(|p| mtime(&p))
        .max()
}
