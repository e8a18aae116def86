//! The serving ladder on the CPU backend: every request runs to its last token, constrained
//! runs follow their grammar, and settings that cannot run are refused.

use super::*;
use metrale_gpu_runtime::CpuBackend;

#[test]
fn the_ladder_runs_every_request_to_its_last_token_and_frees_everything() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new(Default::default()));
    let mut o = ServeOptions::new(super::super::tiny_hybrid_for_cpu().unwrap());
    o.concurrency = vec![1, 3];
    o.prompt_tokens = 5;
    o.output_tokens = 4;
    o.copy_bytes = 1 << 16;
    let r = serve_ladder(gpu, &o).unwrap();
    assert_eq!(r.points.len(), 2);
    for p in &r.points {
        // Every request produced all its tokens; the last decode steps ran all of them.
        assert!((p.tok_s * p.wall_s - (p.concurrency * 4) as f64).abs() < 1e-6);
        assert!(p.full_steps >= 1, "{p:?}");
        assert!(p.step_ms > 0.0 && p.floor_ms > 0.0, "{p:?}");
    }
    assert!(r.points[1].step_bytes > r.points[0].step_bytes);
    assert!(r.table().contains("serving ladder"));
    assert!(r.points.iter().all(|p| p.constrained.is_none()));
    assert!(!r.table().contains("constrained runs"));
}

/// A grammar that allows the odd tokens, forever: the schema text is ignored.
#[derive(Debug)]
struct OddTokens {
    vocab: usize,
}

impl TokenConstraint for OddTokens {
    fn fill_mask(&mut self, mask: &mut [u32]) -> Result<(), ConstraintError> {
        for t in (1..self.vocab as u32).step_by(2) {
            crate::constraint::allow(mask, t);
        }
        Ok(())
    }
    fn accept(&mut self, token: u32) -> Result<(), ConstraintError> {
        match token % 2 {
            1 => Ok(()),
            _ => Err(ConstraintError {
                reason: format!("{token} is even"),
            }),
        }
    }
    fn is_finished(&self) -> bool {
        false
    }
}

#[derive(Debug)]
struct OddCompiler {
    tokenizer_vocab: usize,
}

impl JsonSchemaCompiler for OddCompiler {
    fn vocab_size(&self) -> usize {
        self.tokenizer_vocab
    }
    fn compile(
        &self,
        schema: &str,
        vocab: usize,
        _eos: &[u32],
    ) -> Result<Box<dyn TokenConstraint>, ConstraintError> {
        assert!(schema.contains("\"minItems\": 6"), "{schema}");
        Ok(Box::new(OddTokens { vocab }))
    }
}

#[test]
fn a_constrained_run_follows_its_grammar_every_step_and_reports_beside_the_plain_run() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new(Default::default()));
    let mut o = ServeOptions::new(super::super::tiny_for_cpu().unwrap());
    o.concurrency = vec![1, 3];
    o.prompt_tokens = 5;
    o.output_tokens = 6;
    o.copy_bytes = 1 << 16;
    o.constrained = 2;
    o.schemas = Some(Arc::new(OddCompiler {
        tokenizer_vocab: 200,
    }));
    let r = serve_ladder(gpu, &o).unwrap();
    assert_eq!(r.schema.as_deref(), Some(serve_schema(6).as_str()));
    for p in &r.points {
        let c = p.constrained.as_ref().expect("a constrained run");
        assert_eq!(c.requests, p.concurrency.min(2));
        // Every request ran to its last token in both runs, the constrained ones included.
        assert!((c.tok_s * c.wall_s - (p.concurrency * 6) as f64).abs() < 1e-6);
        assert_eq!(c.outputs.len(), c.requests);
        for out in &c.outputs {
            assert_eq!(out.len(), 6);
            assert!(out.iter().all(|t| t % 2 == 1), "{out:?}");
        }
        assert!(c.full_steps >= 1 && c.step_ms > 0.0, "{c:?}");
        assert!(p.constrained_ratio().is_some_and(|x| x > 0.0));
    }
    let table = r.table();
    assert!(
        table.contains("constrained runs") && table.contains("x plain"),
        "{table}"
    );
}

#[test]
fn constrained_requests_without_a_compiler_or_with_a_vocabulary_past_the_models_are_refused() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new(Default::default()));
    let mut o = ServeOptions::new(super::super::tiny_for_cpu().unwrap());
    o.constrained = 1;
    let e = serve_ladder(gpu.clone(), &o).unwrap_err();
    assert!(
        matches!(
            e,
            ModelError::Options {
                option: "constrained",
                ..
            }
        ),
        "{e}"
    );
    o.schemas = Some(Arc::new(OddCompiler {
        tokenizer_vocab: 257,
    }));
    let e = serve_ladder(gpu, &o).unwrap_err();
    assert!(
        matches!(
            e,
            ModelError::TokenizerVocab {
                tokenizer: 257,
                model: 256
            }
        ),
        "{e}"
    );
}

/// The ladder with speculation on the tiny hybrid shape (its MTP head drafts): both rungs run
/// the oracle's and the MTP head's runs after the plain one, each with exactly the plain
/// tokens (else the ladder fails); the oracle's drafts are all accepted and it speculates.
#[test]
fn speculative_rungs_generate_the_plain_tokens_and_the_oracle_keeps_every_draft() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new(Default::default()));
    let mut o = ServeOptions::new(super::super::tiny_hybrid_for_cpu().unwrap());
    o.concurrency = vec![1, 4];
    o.prompt_tokens = 5;
    o.output_tokens = 7;
    o.copy_bytes = 1 << 16;
    o.speculative = Some(ServeSpeculation::default().num_draft_tokens(2));
    let r = serve_ladder(gpu, &o).unwrap();
    assert_eq!(r.speculation, o.speculative);
    for p in &r.points {
        let drafters: Vec<&str> = p.speculative.iter().map(|s| s.drafter).collect();
        assert_eq!(drafters, ["oracle", "mtp"], "{p:?}");
        for s in &p.speculative {
            // Every request generated all its tokens, as in the plain run.
            assert!((s.tok_s * s.wall_s - (p.concurrency * 7) as f64).abs() < 1e-6);
            assert!(p.speculative_ratio(s) > 0.0 && p.speculative_ratio(s).is_finite());
            // A fresh gate speculates from the first step: the drafters were asked.
            assert!(s.verify_steps > 0 && s.draft_verifies > 0, "{s:?}");
        }
        let oracle = &p.speculative[0];
        assert!(
            oracle.drafted > 0 && oracle.accepted == oracle.drafted,
            "{oracle:?}"
        );
        assert!(oracle.accepted_per_verify().is_some_and(|a| a > 1.0));
        // Fewer steps than plain decoding's one a token.
        assert!(oracle.verify_steps + oracle.plain_steps < 6 * p.concurrency);
    }
    let table = r.table();
    assert!(table.contains("speculative runs: K = 2"), "{table}");
    assert!(table.contains("oracle") && table.contains("mtp"), "{table}");
}

#[test]
fn a_speculative_run_with_other_tokens_fails_naming_the_request_and_position() {
    let plain = vec![vec![1, 2, 3], vec![4, 5, 6]];
    assert!(speculative::same_tokens("oracle", &plain, &plain).is_ok());
    let e = speculative::same_tokens("mtp", &plain, &[vec![1, 2, 3], vec![4, 5, 7]]);
    assert!(
        matches!(
            e,
            Err(ModelError::SpeculativeMismatch {
                drafter: "mtp",
                concurrency: 2,
                request: 1,
                position: 2,
                plain: Some(6),
                speculative: Some(7),
            })
        ),
        "{e:?}"
    );
    // An output cut short differs where it ends.
    let e = speculative::same_tokens("oracle", &plain, &[vec![1, 2], vec![4, 5, 6]]);
    assert!(
        matches!(
            e,
            Err(ModelError::SpeculativeMismatch {
                request: 0,
                position: 2,
                plain: Some(3),
                speculative: None,
                ..
            })
        ),
        "{e:?}"
    );
}

#[test]
fn draft_counts_the_model_cannot_be_built_for_are_refused() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new(Default::default()));
    let mut o = ServeOptions::new(super::super::tiny_hybrid_for_cpu().unwrap());
    for k in [0, crate::options::MAX_DRAFT_TOKENS + 1] {
        o.speculative = Some(ServeSpeculation::default().num_draft_tokens(k));
        let e = serve_ladder(gpu.clone(), &o).unwrap_err();
        assert!(
            matches!(
                e,
                ModelError::Options {
                    option: "num_draft_tokens",
                    ..
                }
            ),
            "{e}"
        );
    }
}

/// A run's acceptance is the drafts accepted per sequence verify that checked drafts, and is
/// shown as "-" where there was none (a run the gate kept plain from its first step).
#[test]
fn drafts_accepted_per_verify_count_only_the_verifies_that_checked_drafts() {
    let run = SpeculativeRun {
        drafter: "mtp",
        wall_s: 2.0,
        tok_s: 30.0,
        steps: 25,
        verify_steps: 6,
        plain_steps: 18,
        draft_verifies: 8,
        drafted: 24,
        accepted: 6,
        switches: 1,
        gate_on: false,
        captures: 3,
        full_steps: 12,
        step_ms: 1.25,
        step_mean_ms: 1.5,
        rest_s: 1.82,
        drafter_s: 0.25,
    };
    assert_eq!(run.accepted_per_verify(), Some(0.75));
    let never = SpeculativeRun {
        draft_verifies: 0,
        drafted: 0,
        accepted: 0,
        verify_steps: 0,
        ..run.clone()
    };
    assert_eq!(never.accepted_per_verify(), None);
    let point = ServePoint {
        concurrency: 4,
        wall_s: 4.0,
        tok_s: 20.0,
        steps: 30,
        full_steps: 20,
        step_ms: 1.0,
        rest_s: 3.98,
        step_bytes: 1.0,
        floor_ms: 0.5,
        constrained: None,
        speculative: vec![run, never],
    };
    assert_eq!(point.speculative_ratio(&point.speculative[0]), 1.5);
    let spec = ServeSpeculation::default();
    let table = speculative::table(&spec, std::slice::from_ref(&point));
    let rows: Vec<&str> = table.lines().filter(|l| l.contains(" mtp ")).collect();
    assert_eq!(rows.len(), 2, "{table}");
    assert!(
        rows[0].contains("0.75") && rows[0].contains("1.500"),
        "{table}"
    );
    // The full steps' median and mean, the time outside them and the drafter's.
    assert!(
        rows[0].ends_with(" 12       1.250     1.500    1.820       0.250"),
        "{table}"
    );
    assert!(rows[1].split_whitespace().any(|w| w == "-"), "{table}");
}
