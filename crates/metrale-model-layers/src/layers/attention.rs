//! Full (softmax) attention over the paged KV cache: fused QKV projection, per-head q/k norm and
//! RoPE, cache store, paged attention (with the output gate of the Qwen3.5 family when present),
//! output projection.

use std::collections::BTreeMap;

use metrale_circuit::LinearRole;
use metrale_gpu_runtime::{DevicePtr, GpuError, GpuResult};

use crate::circuit_exec::{AttnFacts, BoundWeight, RopeFacts, WeightSlot};
use crate::layer::{LayerCtx, ModelDims};
use crate::ops::{Matrix, PagedAttention, RowGroups, STEP_PROGRAMMATIC_ROWS};
use crate::weight_map::DenseWeight;

/// The softmax scale of attention heads of `head_dim`: `1 / sqrt(head_dim)`.
pub(crate) fn softmax_scale(head_dim: u32) -> f32 {
    1.0 / (head_dim as f32).sqrt()
}

/// One attention layer's weights.
#[derive(Debug, Clone)]
pub struct Attention {
    /// `[q (with gates) ; k ; v]` stacked on the output dim: `[qkv_width, hidden]`.
    pub qkv: DenseWeight,
    /// Per-head q norm `[head_dim]`; `None` for Llama.
    pub q_norm: Option<DenseWeight>,
    /// Per-head k norm `[head_dim]`; `None` for Llama.
    pub k_norm: Option<DenseWeight>,
    /// `[hidden, num_q_heads * head_dim]`.
    pub o_proj: DenseWeight,
}

impl Attention {
    /// Run attention on `normed`, leaving the projected output in `delta`. `staged`: `normed`
    /// was also written as stage images there (`Ops::linear_staging`), which the qkv projection
    /// reads.
    pub fn forward(&self, cx: &LayerCtx<'_>, staged: Option<DevicePtr>) -> GpuResult<()> {
        let (ops, s, buf, d) = (cx.ops, cx.stream, cx.buf, cx.dims);
        let kv = cx.kv.ok_or_else(|| GpuError::KernelFailed {
            kernel: "Attention::forward".into(),
            problem: "an attention layer was run without a KV cache binding".into(),
        })?;
        let rows = cx.shape.rows;
        let width = d.qkv_width();
        let qkv = Matrix::bf16(buf.acts.qkv, rows, width);
        let normed = Matrix::bf16(buf.acts.normed, rows, d.hidden);
        match staged {
            Some(images) => ops.linear_staged(s, (qkv, normed, self.qkv.matrix()), images)?,
            None => ops.linear(s, qkv, normed, self.qkv.matrix())?,
        }
        let norms = (
            self.q_norm.as_ref().map_or(Default::default(), |w| w.ptr),
            self.k_norm.as_ref().map_or(Default::default(), |w| w.ptr),
        );
        let rope = d.rope_params(buf.acts.qkv, norms, buf.inv_freq, buf.meta.positions, rows);
        let store = d.store_params(buf.acts.qkv, &kv, buf.meta.slot_mapping, rows);
        // Prefill sizes (outside every circuit program) store the cache in the rotation's
        // launch; decode sizes keep the two launches `circuit-reference` reproduces.
        if rows > STEP_PROGRAMMATIC_ROWS {
            ops.qk_norm_rope_kv_store(s, &rope, &store)?;
        } else {
            ops.qk_norm_rope(s, &rope)?;
            ops.kv_store(s, &store)?;
        }
        let attention = PagedAttention {
            out: buf.acts.attn_out,
            qkv: buf.acts.qkv,
            k_cache: kv.k,
            v_cache: kv.v,
            block_tables: buf.meta.block_tables,
            row_seq: buf.meta.row_seq,
            positions: buf.meta.positions,
            rows,
            row_stride: width,
            q_head_stride: d.q_head_stride(),
            num_q_heads: d.num_q_heads,
            num_kv_heads: d.num_kv_heads,
            head_dim: d.head_dim,
            block_size: kv.block_size,
            max_blocks: cx.shape.max_blocks,
            num_seqs: cx.shape.num_seqs,
            num_slots: kv.num_slots,
            scale: softmax_scale(d.head_dim),
            gated: d.attn_gated,
            kv_dtype: kv.dtype,
            kv_scales: kv.scales,
        };
        let delta = Matrix::bf16(buf.acts.delta, rows, d.hidden);
        let attn_out = Matrix::bf16(buf.acts.attn_out, rows, d.attn_out_width());
        let o_proj = self.o_proj.matrix();
        match cx.shape.att_groups {
            0 => ops.paged_attention(s, &attention)?,
            n => {
                // At prefill sizes the attention writes the o projection's stage images itself
                // (no permute launch) when the projection can read them; a sharded projection
                // reads its input plainly (its f32 partial sums go to the all-reduce), and so
                // does a step with prompt rows (`paged_attention_prompt` writes rows).
                let prompt = cx.shape.att_prompt.min(n);
                let images = match cx.sharded() || prompt > 0 {
                    true => None,
                    false => ops.linear_staging(s, o_proj, rows)?,
                };
                ops.paged_attention_prompt(s, &attention, buf.meta.att_groups, prompt)?;
                if n > prompt {
                    // Each group is two u32.
                    let groups = RowGroups {
                        at: buf.meta.att_groups.offset(8 * prompt as usize),
                        count: n - prompt,
                        split: cx.shape.att_split,
                    };
                    ops.paged_attention_prefill(s, &attention, groups, images)?;
                }
                if let Some(images) = images {
                    return ops.linear_staged(s, (delta, attn_out, o_proj), images);
                }
            }
        }
        cx.row_parallel(attn_out, o_proj)
    }

    /// Bind the layer's weights into `weights` and return the facts its kernels read; a q norm
    /// without a k norm (or the reverse) is recorded in `unmodelled`.
    pub(crate) fn circuit_facts(
        &self,
        d: &ModelDims,
        weights: &mut BTreeMap<WeightSlot, BoundWeight>,
        unmodelled: &mut Vec<String>,
    ) -> AttnFacts {
        weights.insert(WeightSlot::Linear(LinearRole::Qkv), (&self.qkv).into());
        weights.insert(WeightSlot::Linear(LinearRole::O), (&self.o_proj).into());
        if let Some(w) = &self.q_norm {
            weights.insert(WeightSlot::QNorm, w.into());
        }
        if let Some(w) = &self.k_norm {
            weights.insert(WeightSlot::KNorm, w.into());
        }
        if self.q_norm.is_some() != self.k_norm.is_some() {
            unmodelled.push("a per-head norm on only one of q and k".into());
        }
        AttnFacts {
            num_q_heads: d.num_q_heads,
            num_kv_heads: d.num_kv_heads,
            head_dim: d.head_dim,
            gated: d.attn_gated,
            qk_norm: self.q_norm.is_some() && self.k_norm.is_some(),
            rope: RopeFacts {
                rotary_dim: d.rotary_dim,
                attention_scaling: d.rope_attention_scaling,
            },
            softmax_scale: softmax_scale(d.head_dim),
        }
    }
}
