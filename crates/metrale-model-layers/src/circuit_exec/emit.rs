//! Emitters: one plan group to its launches, through the typed launchers of `ops` (the ones the
//! legacy forward calls), with every address taken from the circuit's edges ([`Fixed`]) or the
//! bindings, and every extent from the plan's.
//!
//! Invariants:
//! - An emitter launches exactly its group's kernels, in order (`compile.rs` checks it).
//! - A reference group's launch is the legacy forward's launch for the same op, argument for
//!   argument: the same buffers, the same extents, the same facts.
//! - Every weight an emitter reads has the format family the group's kernel reads.

use metrale_circuit::kernels as k;
use metrale_circuit::{
    Block, Format, Group, Kernel, LinearRole, Node, NormWeight, Op, Plan, Tensor,
};
use metrale_gpu_runtime::{DType, DevicePtr, StreamHandle};

use super::bindings::{AttnFacts, CircuitLayer, HeadBinding, WeightSlot, norm_slot};
use super::draft::DraftBinding;
use super::error::CircuitExecError;
use super::fixed::Fixed;
use crate::layer::ModelDims;
use crate::ops::{KvStore, Matrix, Norm, Ops, PagedAttention, QkNormRope, VocabRows};

type Result<T> = std::result::Result<T, CircuitExecError>;

/// A tensor as one node sees it: its address and its extents at the plan's width.
#[derive(Debug, Clone, Copy)]
pub(super) struct Edge {
    pub(super) ptr: DevicePtr,
    /// The outermost extent (rows, or pairs).
    pub(super) rows: u64,
    /// The innermost extent.
    pub(super) cols: u64,
    /// Every extent multiplied.
    pub(super) numel: u64,
    /// Element format.
    pub(super) format: Format,
}

/// What a group's launches are built from.
#[derive(Debug)]
pub(crate) struct Emitter<'a> {
    /// Launchers (recording ones, when compiling).
    pub ops: &'a Ops,
    /// The stream passed to the launchers.
    pub stream: StreamHandle,
    /// The plan being compiled.
    pub plan: &'a Plan,
    /// The model's dimensions (norm epsilon).
    pub dims: &'a ModelDims,
    /// The bound layers, in order.
    pub layers: &'a [CircuitLayer],
    /// The model's own weights.
    pub head: &'a HeadBinding,
    /// The MTP draft head's own weights, when it is bound.
    pub draft: Option<&'a DraftBinding>,
    /// The draft head's bound layers, in order (empty without one).
    pub draft_layers: &'a [CircuitLayer],
    /// The fixed addresses.
    pub fixed: &'a Fixed,
}

/// Scratch bytes `group` needs beyond the step buffers at `plan`'s width. None: every
/// emitter writes the step buffer the legacy forward writes for its op.
pub(crate) fn scratch_bytes(_plan: &Plan, _group: &Group) -> u64 {
    0
}

impl Emitter<'_> {
    /// Launch `group`'s kernels.
    pub(crate) fn group(&self, group: &Group) -> Result<()> {
        let emitted = match (self.plan.group_nodes(group), group.kernels.as_slice()) {
            ([node], kernels) => self.single(node, kernels)?,
            ([rope, store], [kernel @ k::QK_NORM_ROPE_KV_STORE])
                if matches!(rope.op, Op::QkNormRope(_) | Op::Rope) && store.op == Op::KvStore =>
            {
                let (r, st) = (self.rope_params(rope, *kernel)?, self.store_params(store)?);
                self.ops.qk_norm_rope_kv_store(self.stream, &r, &st)?;
                true
            }
            ([gate_up, silu], [kernel @ k::LINEAR_SWIGLU])
                if silu.op == Op::SiluMul
                    && matches!(
                        gate_up.op,
                        Op::Linear(LinearRole::GateUp | LinearRole::SharedGateUp)
                    ) =>
            {
                // The projection's input and weight, the activation's output: the gate/up rows
                // are never written. Only the narrow widths lower to this kernel
                // (`kernels_at`), where no producer writes stage images.
                let b = gate_up.block;
                let x = self.view(b, &self.nth(gate_up, 0, false)?)?;
                let act = self.view(b, &self.nth(silu, 0, true)?)?;
                let w = self.linear_weight(gate_up, *kernel)?;
                self.ops.linear_swiglu(self.stream, act, x, w)?;
                true
            }
            _ => false,
        };
        if emitted {
            return Ok(());
        }
        let chain: Vec<String> = group.ops.iter().map(ToString::to_string).collect();
        let kernels: Vec<String> = group.kernels.iter().map(ToString::to_string).collect();
        Err(CircuitExecError::NoEmitter {
            block: group.block,
            chain: chain.join(" > "),
            kernels: kernels.join(", "),
        })
    }

    fn edge(&self, node: &Node, tensor: Tensor, outputs: bool) -> Result<Edge> {
        let circuit = self.plan.circuit();
        let ids = if outputs { &node.outputs } else { &node.inputs };
        let id = ids
            .iter()
            .copied()
            .find(|&v| circuit.value(v).is_some_and(|x| x.tensor == tensor))
            .ok_or(CircuitExecError::NoBuffer {
                block: node.block,
                tensor: tensor.name(),
            })?;
        let mut ptr = self.fixed.tensor(tensor, node.block)?;
        let ext = self.plan.extents(id);
        if tensor == Tensor::MtpNormedHidden {
            // The second half of `mtp.cat_src`, after the normed embeddings' bf16 rows.
            let half = 2 * ext.iter().product::<u64>();
            ptr = ptr.offset(
                usize::try_from(half).map_err(|_| CircuitExecError::TooLarge {
                    block: node.block,
                    what: "mtp.cat_src half",
                    value: half,
                })?,
            );
        }
        // Every tensor's shape has at least one extent (`Tensor::spec`).
        Ok(Edge {
            ptr,
            rows: ext.first().copied().unwrap_or(1),
            cols: ext.last().copied().unwrap_or(1),
            numel: ext.iter().product(),
            format: tensor.spec().format,
        })
    }

    /// `e` as the launchers' matrix view: `rows` rows of the rest of its elements.
    pub(super) fn view(&self, block: Block, e: &Edge) -> Result<Matrix> {
        let dtype = match e.format {
            Format::Bf16 => DType::Bf16,
            Format::F32 => DType::F32,
            Format::U32 => DType::U32,
        };
        Ok(Matrix::new(
            e.ptr,
            dtype,
            self.u32(block, "rows", e.rows)?,
            self.u32(block, "columns", e.numel / e.rows.max(1))?,
        ))
    }

    pub(super) fn input(&self, node: &Node, tensor: Tensor) -> Result<Edge> {
        self.edge(node, tensor, false)
    }

    pub(super) fn output(&self, node: &Node, tensor: Tensor) -> Result<Edge> {
        self.edge(node, tensor, true)
    }

    /// The tensor of the node's `i`-th input (or output).
    pub(super) fn nth(&self, node: &Node, i: usize, outputs: bool) -> Result<Edge> {
        let ids = if outputs { &node.outputs } else { &node.inputs };
        let tensor = ids
            .get(i)
            .and_then(|&v| self.plan.circuit().value(v))
            .map(|v| v.tensor)
            .ok_or(CircuitExecError::NoBuffer {
                block: node.block,
                tensor: "(an operand)",
            })?;
        self.edge(node, tensor, outputs)
    }

    /// Whether `node` reads `tensor` (an optional input).
    pub(super) fn reads(&self, node: &Node, tensor: Tensor) -> bool {
        let circuit = self.plan.circuit();
        node.inputs
            .iter()
            .any(|&v| circuit.value(v).is_some_and(|x| x.tensor == tensor))
    }

    /// `value` as a 32-bit kernel argument.
    pub(super) fn u32(&self, block: Block, what: &'static str, value: u64) -> Result<u32> {
        u32::try_from(value).map_err(|_| CircuitExecError::TooLarge { block, what, value })
    }

    /// The `qk_norm_rope` launch of a rope node (`Op::QkNormRope` or `Op::Rope`), its norm
    /// weights read as `kernel` reads them.
    fn rope_params(&self, node: &Node, kernel: Kernel) -> Result<QkNormRope> {
        let b = node.block;
        let u = |what: &'static str, v: u64| self.u32(b, what, v);
        let a = self.attn(b)?;
        let qkv = self.input(node, Tensor::Qkv)?;
        let positions = self.input(node, Tensor::Positions)?;
        let (q_norm, k_norm, unit_offset) = match node.op {
            Op::QkNormRope(w) => (
                self.weight(b, WeightSlot::QNorm, kernel)?,
                self.weight(b, WeightSlot::KNorm, kernel)?,
                w == NormWeight::ZeroCentred,
            ),
            _ => (DevicePtr::NULL, DevicePtr::NULL, false),
        };
        let inv_freq = self.fixed.buffers.inv_freq;
        if inv_freq.is_null() {
            return Err(CircuitExecError::NoBuffer {
                block: b,
                tensor: "inv_freq",
            });
        }
        Ok(QkNormRope {
            qkv: qkv.ptr,
            q_norm,
            k_norm,
            inv_freq,
            positions: positions.ptr,
            rows: u("rows", qkv.rows)?,
            row_stride: u("qkv width", qkv.cols)?,
            num_q_heads: a.num_q_heads,
            q_head_stride: q_head_stride(&a),
            k_offset: k_offset(&a),
            num_kv_heads: a.num_kv_heads,
            head_dim: a.head_dim,
            rotary_dim: a.rope.rotary_dim,
            attention_scaling: a.rope.attention_scaling,
            eps: self.dims.eps,
            unit_offset,
        })
    }

    /// The `kv_store` launch of a `KvStore` node.
    fn store_params(&self, node: &Node) -> Result<KvStore> {
        let b = node.block;
        let u = |what: &'static str, v: u64| self.u32(b, what, v);
        let a = self.attn(b)?;
        let kv = self.kv(b)?;
        let qkv = self.input(node, Tensor::Qkv)?;
        Ok(KvStore {
            k_cache: self.input(node, Tensor::KCache)?.ptr,
            v_cache: self.input(node, Tensor::VCache)?.ptr,
            qkv: qkv.ptr,
            slot_mapping: self.input(node, Tensor::SlotMapping)?.ptr,
            rows: u("rows", qkv.rows)?,
            row_stride: u("qkv width", qkv.cols)?,
            k_offset: k_offset(&a),
            v_offset: k_offset(&a) + a.num_kv_heads * a.head_dim,
            num_kv_heads: a.num_kv_heads,
            head_dim: a.head_dim,
            num_slots: kv.num_slots,
            kv_fp8: kv.fp8() as u32,
            k_scale: kv.scales.k,
            v_scale: kv.scales.v,
        })
    }

    /// Emit a one-node group; `false` when no emitter lowers `node` to `kernels`.
    fn single(&self, node: &Node, kernels: &[Kernel]) -> Result<bool> {
        let (ops, s, b, eps) = (self.ops, self.stream, node.block, self.dims.eps);
        let u = |what: &'static str, v: u64| self.u32(b, what, v);
        match (node.op, kernels) {
            (Op::Embedding, [kernel @ k::EMBEDDING_GATHER]) => {
                let ids = self.input(node, Tensor::TokenIds)?;
                let out = self.view(b, &self.output(node, Tensor::Residual)?)?;
                let table = self.weight(b, WeightSlot::Embedding, *kernel)?;
                let vocab = u("vocab", self.plan.circuit().instance().dims.vocab)?;
                let table = Matrix::bf16(table, vocab, out.cols);
                ops.embedding_gather(s, out, table, ids.ptr, VocabRows::whole(vocab))?;
            }
            (Op::RmsNorm { role, weight }, [kernel @ k::RMS_NORM]) => {
                // The residual stream, or a draft step's hidden rows.
                let x = self.view(b, &self.nth(node, 0, false)?)?;
                let out = self.view(b, &self.nth(node, 0, true)?)?;
                let norm = Norm {
                    w: self.weight(b, norm_slot(role), *kernel)?,
                    eps,
                    unit_offset: weight == NormWeight::ZeroCentred,
                };
                ops.rms_norm(s, out, x, &norm)?;
            }
            (Op::AddRmsNorm { role, weight }, [kernel @ k::ADD_RMS_NORM]) => {
                let residual = self.view(b, &self.input(node, Tensor::Residual)?)?;
                let delta = self.view(b, &self.input(node, Tensor::Delta)?)?;
                let out = self.view(b, &self.output(node, Tensor::Normed)?)?;
                let norm = Norm {
                    w: self.weight(b, norm_slot(role), *kernel)?,
                    eps,
                    unit_offset: weight == NormWeight::ZeroCentred,
                };
                match self.staged_for(node)? {
                    Some(images) => {
                        ops.add_rms_norm_staged(s, (residual, delta, out), images, &norm)?
                    }
                    None => ops.add_rms_norm(s, residual, delta, out, &norm)?,
                }
            }
            // The GDN input projection of a block-FP8 layer: its FP8 q|k|v|z rows (as any FP8
            // projection), then its bf16 b|a rows after them (`GatedDeltaNet::forward`).
            (Op::Linear(LinearRole::GdnInProj), [qkvz @ .., k::LINEAR]) if !qkvz.is_empty() => {
                self.gdn_in_proj_split(node)?;
            }
            (Op::Linear(_), [kernel @ (k::LINEAR | k::LINEAR_F32OUT | k::LINEAR_STREAM_FP8)]) => {
                let x = self.view(b, &self.nth(node, 0, false)?)?;
                let out = self.view(b, &self.nth(node, 0, true)?)?;
                let w = self.linear_weight(node, *kernel)?;
                if *kernel == k::LINEAR_F32OUT {
                    ops.linear_f32out(s, out, x, w)?;
                } else if let Some(images) = self.staged_x(node)? {
                    ops.linear_staged(s, (out, x, w), images)?;
                } else {
                    ops.linear(s, out, x, w)?;
                }
            }
            (Op::QkNormRope(_) | Op::Rope, [kernel @ k::QK_NORM_ROPE]) => {
                ops.qk_norm_rope(s, &self.rope_params(node, *kernel)?)?;
            }
            (Op::KvStore, [k::KV_STORE]) => {
                ops.kv_store(s, &self.store_params(node)?)?;
            }
            (Op::PagedAttention { gated }, [k::PAGED_ATTENTION]) => {
                let a = self.attn(b)?;
                let kv = self.kv(b)?;
                let qkv = self.input(node, Tensor::Qkv)?;
                let tables = self.input(node, Tensor::BlockTables)?;
                ops.paged_attention(
                    s,
                    &PagedAttention {
                        out: self.output(node, Tensor::AttnOut)?.ptr,
                        qkv: qkv.ptr,
                        k_cache: self.input(node, Tensor::KCache)?.ptr,
                        v_cache: self.input(node, Tensor::VCache)?.ptr,
                        block_tables: tables.ptr,
                        row_seq: self.input(node, Tensor::RowSeq)?.ptr,
                        positions: self.input(node, Tensor::Positions)?.ptr,
                        rows: u("rows", qkv.rows)?,
                        row_stride: u("qkv width", qkv.cols)?,
                        q_head_stride: q_head_stride(&a),
                        num_q_heads: a.num_q_heads,
                        num_kv_heads: a.num_kv_heads,
                        head_dim: a.head_dim,
                        block_size: kv.block_size,
                        max_blocks: u("blocks per sequence", tables.cols)?,
                        num_seqs: u("sequences", tables.rows)?,
                        num_slots: kv.num_slots,
                        scale: a.softmax_scale,
                        gated,
                        kv_dtype: kv.dtype,
                        kv_scales: kv.scales,
                    },
                )?;
            }
            (Op::SiluMul, [k::SILU_MUL]) => {
                let x = self.view(b, &self.nth(node, 0, false)?)?;
                let out = self.view(b, &self.nth(node, 0, true)?)?;
                match self.staged_for(node)? {
                    Some(images) => ops.silu_mul_staged(s, images, out, x)?,
                    None => ops.silu_mul(s, out, x)?,
                }
            }
            (Op::GatherRows, [k::GATHER_ROWS]) => {
                let x = self.view(b, &self.input(node, Tensor::Normed)?)?;
                let rows = self.input(node, Tensor::LogitRows)?;
                let out = self.view(b, &self.output(node, Tensor::LogitsIn)?)?;
                ops.gather_rows(s, out, x, rows.ptr)?;
            }
            (Op::Argmax, [k::ARGMAX]) => {
                let logits = self.view(b, &self.input(node, Tensor::Logits)?)?;
                let out = self.output(node, Tensor::Sampled)?;
                ops.argmax(s, out.ptr, logits)?;
            }
            _ => return self.hybrid_single(node, kernels),
        }
        Ok(true)
    }
}

impl Emitter<'_> {
    /// The two GEMMs of a GDN input projection whose b|a rows are a bf16 weight of their own:
    /// `[rows, conv_dim + value_dim]` from the FP8 q|k|v|z rows, then `[rows, 2 * Hv]` from the
    /// b|a rows, into the projection's buffer as
    /// [`GdnProjLayout::split`](crate::ops_hybrid::GdnProjLayout::split) lays them out.
    fn gdn_in_proj_split(&self, node: &Node) -> Result<()> {
        let b = node.block;
        let (ptr, m, _, kk) = self.linear_shape(node, k::LINEAR_STREAM_FP8)?;
        let x = self.view(b, &self.nth(node, 0, false)?)?;
        let out = self.nth(node, 0, true)?;
        let layout = self.gdn_layout(b, out.rows)?;
        let w = Matrix {
            scales: self.bound_scales(b, WeightSlot::Linear(LinearRole::GdnInProj)),
            ..Matrix::new(ptr, DType::F8E4M3, layout.proj_stride, kk)
        };
        let ba = Matrix::bf16(
            self.weight(b, WeightSlot::GdnInProjBa, k::LINEAR)?,
            layout.ba_stride,
            kk,
        );
        let qkvz_out = Matrix::bf16(out.ptr, m, layout.proj_stride);
        let ba_out = Matrix::bf16(
            out.ptr.offset(layout.ba_offset as usize * 2),
            m,
            layout.ba_stride,
        );
        self.ops.linear(self.stream, qkvz_out, x, w)?;
        self.ops.linear(self.stream, ba_out, x, ba)?;
        Ok(())
    }
}

/// Elements from one query head to the next in a qkv row.
fn q_head_stride(a: &AttnFacts) -> u32 {
    if a.gated { 2 * a.head_dim } else { a.head_dim }
}

/// Element offset of the first key head in a qkv row.
fn k_offset(a: &AttnFacts) -> u32 {
    a.num_q_heads * q_head_stride(a)
}
