//! The emitters only a draft step (the MTP head, `Step::Draft`) has: its concat, the row
//! gather that interleaves each row's normed embedding and normed hidden row into `fc`'s
//! input through `mtp.cat_ids` (`Model::launch_mtp`'s `gather_rows`). The head's
//! norms, `fc`, its layer and the LM head go through the decode step's emitters.
//!
//! Invariant: as every emitter, a launch here is the legacy launch for the same op, argument
//! for argument.

use metrale_circuit::kernels as k;
use metrale_circuit::{Kernel, Node, Op, Tensor};

use super::emit::Emitter;
use super::error::CircuitExecError;
use crate::ops::Matrix;

impl Emitter<'_> {
    /// Emit a one-node group of the draft step; `false` when no emitter lowers `node` to
    /// `kernels`.
    pub(super) fn draft_single(
        &self,
        node: &Node,
        kernels: &[Kernel],
    ) -> Result<bool, CircuitExecError> {
        let b = node.block;
        let u = |what: &'static str, v: u64| self.u32(b, what, v);
        match (node.op, kernels) {
            (Op::DraftConcat, [k::GATHER_ROWS]) => {
                // `mtp.cat_src` (both halves, starting at the normed embeddings) gathered by
                // `2n` ids into `n` rows of `2H`, i.e. `2n` rows of `H`.
                let src = self.input(node, Tensor::MtpNormedEmbedding)?;
                let ids = self.input(node, Tensor::MtpCatIds)?;
                let out = self.output(node, Tensor::MtpCat)?;
                let half_rows = u("concat rows", ids.numel)?;
                let hidden = u("hidden", src.cols)?;
                let out = Matrix::bf16(out.ptr, half_rows, hidden);
                let src = Matrix::bf16(src.ptr, half_rows, hidden);
                self.ops.gather_rows(self.stream, out, src, ids.ptr)?;
                Ok(true)
            }
            _ => Ok(false),
        }
    }
}
