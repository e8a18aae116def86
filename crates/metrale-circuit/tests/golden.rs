//! Golden plan texts: each architecture's small instance (`support::every_architecture`) at
//! width 1, lowered with `Fusions::ReferenceOnly` and with `Fusions::All` (every kernel
//! assumed to exist), compared byte for byte with `tests/golden/<architecture>.<fusions>.plan`;
//! and the hybrid architectures' verify step of 3 rows (one sequence, two drafts) in
//! `tests/golden/<architecture>.verify.<fusions>.plan`; and their draft step (the MTP head) of
//! 2 rows (a take-in after one accepted draft) in `tests/golden/<architecture>.draft.<fusions>.plan`.
//!
//! To regenerate a golden file, delete it and run `cargo test -p metrale-circuit --test golden`
//! twice: the first run writes the missing file and fails so that the new text gets reviewed
//! (`git diff`), the second compares against it.

#![allow(clippy::unwrap_used, clippy::type_complexity)]

mod support;

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use metrale_circuit::{Fusions, KernelSet, Step};

fn golden_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden")
}

/// Compare `text` with the golden file `name`, writing it when missing.
fn check(name: &str, text: &str) -> Result<Option<String>> {
    let path = golden_dir().join(name);
    if !path.exists() {
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        return Ok(Some(format!(
            "{name}: missing, written; review it and re-run"
        )));
    }
    let want =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    if want == text {
        return Ok(None);
    }
    let (line, got, expected) = want
        .lines()
        .zip(text.lines())
        .enumerate()
        .find(|(_, (w, g))| w != g)
        .map(|(i, (w, g))| (i + 1, g.to_string(), w.to_string()))
        .unwrap_or((
            want.lines().count().min(text.lines().count()) + 1,
            "(length differs)".into(),
            String::new(),
        ));
    Ok(Some(format!(
        "{name}: differs from the golden text at line {line}\n  golden: {expected}\n  now:    {got}\n\
         (if the change is intended, delete {} and re-run twice)",
        path.display()
    )))
}

#[test]
fn plans_match_their_golden_texts() -> Result<()> {
    let mut problems = Vec::new();
    for (stem, instance) in support::every_architecture() {
        for (mode, fusions) in [("reference", Fusions::ReferenceOnly), ("all", Fusions::All)] {
            let plan = support::plan(&instance, fusions, &KernelSet::all(), 1);
            if let Some(p) = check(&format!("{stem}.{mode}.plan"), plan.text())? {
                problems.push(p);
            }
            if !stem.starts_with("hybrid") {
                continue;
            }
            let verify = support::step_plan(&instance, Step::Verify, fusions, &KernelSet::all(), 3);
            if let Some(p) = check(&format!("{stem}.verify.{mode}.plan"), verify.text())? {
                problems.push(p);
            }
            let draft = support::step_plan(&instance, Step::Draft, fusions, &KernelSet::all(), 2);
            if let Some(p) = check(&format!("{stem}.draft.{mode}.plan"), draft.text())? {
                problems.push(p);
            }
        }
    }
    if !problems.is_empty() {
        bail!("{}", problems.join("\n"));
    }
    Ok(())
}
