//! The launches of one step of the multi-token-prediction head, the drafter of speculative
//! decoding (`runner/mtp.rs` says which rows feed it and runs it).
//!
//! A head row at position `p` reads `h_p`, the target's final-norm output of the row whose input
//! token was `x_p`, with the embedding of the next token `x_{p+1}`, and runs the head's layer at
//! position `p`: `fc([pre_fc_norm_embedding(embed(x_{p+1})) | pre_fc_norm_hidden(h_p)])`, the
//! layer, `mtp.norm`, the shared LM head.

use metrale_gpu_runtime::DevicePtr;
use metrale_model_layers::ops::Matrix;
use metrale_model_layers::{KvBinding, LayerCtx, Ops, StepBuffers, StepShape, TransformerLayer};

use super::Model;
use crate::error::ModelError;

/// The MTP head's step buffers (rows `R` = the step's most rows, hidden `H`).
#[derive(Debug, Clone, Copy)]
pub struct MtpBuffers {
    /// u32 `[R]`: the rows of the previous step whose final-norm output each row reads.
    pub hidden_rows: DevicePtr,
    /// f32 `[R, H]`: those rows, widened.
    pub hidden: DevicePtr,
    /// bf16 `[2R, H]`: the normed embeddings (rows `0..n`), then the normed hidden states
    /// (rows `n..2n`).
    pub cat_src: DevicePtr,
    /// u32 `[2R]`: `[0, n, 1, n + 1, ...]`, which interleaves `cat_src` into `cat`.
    pub cat_ids: DevicePtr,
    /// bf16 `[R, 2H]`: `[normed embedding | normed hidden]` per row, `fc`'s input.
    pub cat: DevicePtr,
    /// bf16 `[A, H]`: final-norm rows kept for a later take-in (`StepRunner::mtp_archive`).
    pub archive: DevicePtr,
    /// `A`, the archive's rows: twice the step's.
    pub archive_rows: usize,
}

impl Model {
    /// The launches of the head for `shape` through `ops`, via its layer `layer` over the KV
    /// pools `kv`, after the hidden-row gather filled `mtp.hidden`.
    pub fn launch_mtp(
        &self,
        ops: &Ops,
        buf: &StepBuffers,
        mtp: &MtpBuffers,
        kv: KvBinding,
        shape: StepShape,
        layer: usize,
    ) -> Result<(), ModelError> {
        let head = self
            .mtp_head()
            .ok_or_else(|| ModelError::Step("the checkpoint has no MTP head".into()))?;
        let (s, d) = (self.stream, &self.dims);
        let n = shape.rows;
        let residual = Matrix::f32(buf.acts.residual, n, d.hidden);
        let (embed, rows) = (self.weights.embed.matrix(), self.weights.embed_rows);
        ops.embedding_gather(s, residual, embed, buf.meta.token_ids, rows)?;
        if d.tp_size > 1 {
            ops.all_reduce_sum(s, residual, residual)?;
        }
        let halves = [
            (
                mtp.cat_src,
                buf.acts.residual,
                head.pre_fc_norm_embedding.ptr,
            ),
            (
                mtp.cat_src.offset(n as usize * d.hidden as usize * 2),
                mtp.hidden,
                head.pre_fc_norm_hidden.ptr,
            ),
        ];
        for (out, x, w) in halves {
            let (out, x) = (Matrix::bf16(out, n, d.hidden), Matrix::f32(x, n, d.hidden));
            ops.rms_norm(s, out, x, &d.norm(w))?;
        }
        let (cat, cat_src) = (
            Matrix::bf16(mtp.cat, 2 * n, d.hidden),
            Matrix::bf16(mtp.cat_src, 2 * n, d.hidden),
        );
        ops.gather_rows(s, cat, cat_src, mtp.cat_ids)?;
        let cat = Matrix::bf16(mtp.cat, n, 2 * d.hidden);
        ops.linear_f32out(s, residual, cat, head.fc.matrix())?;
        let decoder = head
            .layers
            .get(layer)
            .ok_or_else(|| ModelError::Step(format!("the MTP head has no layer {layer}")))?;
        decoder.forward(&LayerCtx {
            ops,
            stream: s,
            buf,
            shape,
            dims: d,
            kv: Some(kv),
            ssm: None,
            first: true,
        })?;
        let (delta, normed) = (
            Matrix::bf16(buf.acts.delta, n, d.hidden),
            Matrix::bf16(buf.acts.normed, n, d.hidden),
        );
        ops.add_rms_norm(s, residual, delta, normed, &d.norm(head.norm.ptr))?;
        self.launch_lm_head(ops, buf, shape)
    }
}
