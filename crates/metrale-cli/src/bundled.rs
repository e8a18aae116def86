//! The bundled tiny checkpoint (a random Qwen3 with a small tokenizer, `qwen3-tiny`), which
//! `metrale generate` and `metrale serve` use without `--model`, so the binary runs wherever it
//! is copied or installed.
//!
//! Its files are embedded in the binary; `checkpoint` writes them, once, to a directory
//! under the system's temporary directory named by their SHA-256 (`metrale-qwen3-tiny-<hash>/
//! qwen3-tiny`), which the engine then loads like any other checkpoint.
//!
//! Invariants:
//! - The directory is used only when every file in it has exactly the embedded bytes; anything
//!   else (a partial write by another process, a change) is replaced.
//! - The directory appears whole or not at all: the files are written to a staging directory of
//!   this process, which is then renamed into place; of processes racing to write it, the first
//!   rename wins and the others use its result.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use sha2::{Digest, Sha256};

/// The checkpoint's name, its directory's name.
pub const NAME: &str = "qwen3-tiny";

/// The embedded files, by name.
const FILES: [(&str, &[u8]); 4] = [
    (
        "config.json",
        include_bytes!("../../../tests/fixtures/qwen3-tiny/config.json"),
    ),
    (
        "generation_config.json",
        include_bytes!("../../../tests/fixtures/qwen3-tiny/generation_config.json"),
    ),
    (
        "model.safetensors",
        include_bytes!("../../../tests/fixtures/qwen3-tiny/model.safetensors"),
    ),
    (
        "tokenizer.json",
        include_bytes!("../../../tests/fixtures/qwen3-tiny/tokenizer.json"),
    ),
];

/// The bundled checkpoint's directory, written under the temporary directory on first use.
pub fn checkpoint() -> Result<PathBuf> {
    checkpoint_in(&std::env::temp_dir())
}

/// The bundled checkpoint's directory under `base`; see the module header.
fn checkpoint_in(base: &Path) -> Result<PathBuf> {
    let root = base.join(format!("metrale-{NAME}-{}", content_key()));
    let dir = root.join(NAME);
    if holds_the_files(&dir) {
        return Ok(dir);
    }
    let staging = base.join(format!(
        "metrale-{NAME}-staging-{}-{}",
        std::process::id(),
        unique_suffix()
    ));
    let written = write_files(&staging.join(NAME));
    let placed = written.and_then(|()| place(&staging, &root, &dir));
    // The staging directory is gone after a rename; after a failure, or when another process
    // won the race, it is removed here.
    let _ = std::fs::remove_dir_all(&staging);
    placed?;
    Ok(dir)
}

/// Rename `staging` to `root`, replacing a `root` whose files are not the embedded ones.
fn place(staging: &Path, root: &Path, dir: &Path) -> Result<()> {
    if std::fs::rename(staging, root).is_ok() || holds_the_files(dir) {
        return Ok(());
    }
    // `root` exists and is stale or incomplete: replace it.
    let _ = std::fs::remove_dir_all(root);
    if std::fs::rename(staging, root).is_ok() || holds_the_files(dir) {
        return Ok(());
    }
    anyhow::bail!(
        "cannot write the bundled checkpoint to {}: {} is in the way",
        dir.display(),
        root.display()
    )
}

fn write_files(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    for (name, bytes) in FILES {
        let path = dir.join(name);
        std::fs::write(&path, bytes).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// Whether `dir` holds every embedded file with exactly its bytes.
fn holds_the_files(dir: &Path) -> bool {
    FILES
        .iter()
        .all(|(name, bytes)| std::fs::read(dir.join(name)).is_ok_and(|b| b == *bytes))
}

/// The first 16 hex digits of the SHA-256 of the files' names and contents.
fn content_key() -> String {
    let mut h = Sha256::new();
    for (name, bytes) in FILES {
        h.update((name.len() as u64).to_le_bytes());
        h.update(name.as_bytes());
        h.update((bytes.len() as u64).to_le_bytes());
        h.update(bytes);
    }
    h.finalize()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Distinguishes the staging directories of one process's calls.
fn unique_suffix() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_files_are_written_once_and_a_damaged_copy_is_replaced() {
        let base = tempfile::tempdir().expect("a temporary directory");
        let dir = checkpoint_in(base.path()).expect("written");
        assert_eq!(dir.file_name().and_then(|n| n.to_str()), Some(NAME));
        assert!(holds_the_files(&dir));
        let config = metrale::ModelConfig::from_dir(&dir).expect("a checkpoint's config");
        assert!(config.tokens.vocab_size > 0);

        // Found again, at the same place; nothing else left behind.
        assert_eq!(checkpoint_in(base.path()).expect("found"), dir);
        let entries = std::fs::read_dir(base.path()).expect("listed").count();
        assert_eq!(entries, 1);

        // A truncated file is noticed and the directory rewritten.
        std::fs::write(dir.join("model.safetensors"), b"short").expect("damaged");
        assert!(!holds_the_files(&dir));
        assert_eq!(checkpoint_in(base.path()).expect("rewritten"), dir);
        assert!(holds_the_files(&dir));
        assert_eq!(std::fs::read_dir(base.path()).expect("listed").count(), 1);
    }
}
