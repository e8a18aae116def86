//! `OracleDrafter`: drafts a known continuation of each request (the model's own greedy output,
//! computed beforehand), optionally made wrong at a chosen depth. Under greedy decoding its
//! drafts are all accepted, or accepted exactly up to the wrong one, so tests reach multi-token
//! acceptance and every rollback depth on purpose; it also bounds what any drafter can gain.

use super::{DraftInput, Drafter};
use crate::error::ModelError;
use crate::runner::StepRunner;

/// Chooses, for `(request, round)`, the depth at which the drafts go wrong (`None`: all right).
pub type WrongAt = Box<dyn FnMut(usize, usize) -> Option<usize> + Send>;

/// See the module header.
pub struct OracleDrafter {
    /// Per request: the prompt, then the continuation to draft.
    expected: Vec<Vec<u32>>,
    wrong_at: WrongAt,
    /// Draft rounds so far, per request.
    rounds: Vec<usize>,
}

impl std::fmt::Debug for OracleDrafter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OracleDrafter")
            .field("expected", &self.expected)
            .field("rounds", &self.rounds)
            .finish_non_exhaustive()
    }
}

impl OracleDrafter {
    /// Draft `expected[request]` (prompt then continuation) exactly. A request is matched to
    /// the script of its index when it follows it, else to the first script it follows.
    pub fn new(expected: Vec<Vec<u32>>) -> OracleDrafter {
        OracleDrafter::wrong_at(expected, Box::new(|_, _| None))
    }

    /// Draft `expected[request]`, but at round `r` of request `i` replace the draft at depth
    /// `wrong_at(i, r)` (when it is `Some` and below the drafts wanted) by another token.
    pub fn wrong_at(expected: Vec<Vec<u32>>, wrong_at: WrongAt) -> OracleDrafter {
        let n = expected.len();
        OracleDrafter {
            expected,
            wrong_at,
            rounds: vec![0; n],
        }
    }
}

impl Drafter for OracleDrafter {
    fn draft(
        &mut self,
        runner: &mut StepRunner,
        inputs: &[DraftInput<'_>],
    ) -> Result<Vec<Vec<u32>>, ModelError> {
        let vocab = runner.model().config().tokens.vocab_size as u32;
        let mut out = Vec::with_capacity(inputs.len());
        for inp in inputs {
            let follows = |e: &Vec<u32>| (0..inp.len()).all(|p| e.get(p).copied() == inp.token(p));
            // The script of the request's own index when it follows it (a fresh scheduler
            // numbers requests from 0), else the first script it follows.
            let own = self.expected.get(inp.request).filter(|e| follows(e));
            let index = match own {
                Some(_) => Some(inp.request),
                None => (self.expected.iter().position(follows))
                    .or_else(|| (inp.request < self.expected.len()).then_some(inp.request)),
            };
            let Some(i) = index else {
                out.push(Vec::new());
                continue;
            };
            if inp.num_drafts == 0 {
                out.push(Vec::new());
                continue;
            }
            let expected = &self.expected[i];
            // Off the script (the sequence diverged): nothing to propose.
            let on_script = follows(expected);
            let mut drafts: Vec<u32> = if on_script {
                expected
                    .iter()
                    .skip(inp.len())
                    .take(inp.num_drafts)
                    .copied()
                    .collect()
            } else {
                Vec::new()
            };
            let round = &mut self.rounds[i];
            if let Some(w) = (self.wrong_at)(i, *round)
                && let Some(d) = drafts.get_mut(w)
            {
                *d = (*d + 1) % vocab.max(1);
            }
            *round += 1;
            out.push(drafts);
        }
        Ok(out)
    }
}
