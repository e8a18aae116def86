//! Which launches take stage images: a projection whose x its producer (the residual norm, the
//! post-attention norm, `silu_mul`) also writes as the projection's stage images, wherever
//! `Ops::linear_staging` offers the buffer for the projection's shape, as the legacy forward
//! decides it (`DecoderLayer`, `Mlp`). The producer's emitter and the projection's ask the same
//! question of the same projection, so they always agree.

use metrale_circuit::kernels as k;
use metrale_circuit::{Kernel, LinearRole, Node, NormRole, Op};
use metrale_gpu_runtime::{DType, DevicePtr};

use super::bindings::WeightSlot;
use super::emit::Emitter;
use super::error::CircuitExecError;
use crate::ops::Matrix;

type Result<T> = std::result::Result<T, CircuitExecError>;

impl Emitter<'_> {
    /// A `Linear` node's weight (read as `kernel` reads it) `[n, k]`: bf16, or block FP8 with
    /// its scales.
    pub(super) fn linear_weight(&self, node: &Node, kernel: Kernel) -> Result<Matrix> {
        let (w, _, n, kk) = self.linear_shape(node, kernel)?;
        let scales = match node.op {
            Op::Linear(role) => self.bound_scales(node.block, WeightSlot::Linear(role)),
            _ => None,
        };
        Ok(match scales {
            Some(scales) => Matrix {
                scales: Some(scales),
                ..Matrix::new(w, DType::F8E4M3, n, kk)
            },
            None => Matrix::bf16(w, n, kk),
        })
    }

    /// A `Linear` node's weight (read as `kernel` reads it) and its m, n, k.
    pub(super) fn linear_shape(
        &self,
        node: &Node,
        kernel: Kernel,
    ) -> Result<(DevicePtr, u32, u32, u32)> {
        let (b, x, out) = (
            node.block,
            self.nth(node, 0, false)?,
            self.nth(node, 0, true)?,
        );
        let Op::Linear(role) = node.op else {
            return Err(CircuitExecError::NoBuffer {
                block: b,
                tensor: "(a projection's weight)",
            });
        };
        Ok((
            self.weight(b, WeightSlot::Linear(role), kernel)?,
            self.u32(b, "rows", x.rows)?,
            self.u32(b, "output columns", out.numel / x.rows.max(1))?,
            self.u32(b, "input columns", x.cols)?,
        ))
    }

    /// The stage images a `Linear` node reads its x from, as the legacy forward stages it
    /// (`DecoderLayer`, `Mlp`): the qkv or GDN input projection after the residual norm, the gate/up
    /// projection after the post-attention norm and the down projection after `silu_mul`,
    /// wherever `Ops::linear_staging` offers the buffer for the projection's shape.
    pub(super) fn staged_x(&self, linear: &Node) -> Result<Option<DevicePtr>> {
        let producer = self.x_producer(linear).map(|p| p.op);
        let staged = matches!(
            (producer, linear.op),
            (
                Some(Op::AddRmsNorm {
                    role: NormRole::Input,
                    ..
                }),
                Op::Linear(LinearRole::Qkv | LinearRole::GdnInProj)
            ) | (
                Some(Op::AddRmsNorm {
                    role: NormRole::Post,
                    ..
                }),
                Op::Linear(LinearRole::GateUp)
            ) | (Some(Op::SiluMul), Op::Linear(LinearRole::Down))
        );
        // Block-FP8 projections read images too (`linear_tma_fp8`, `linear_stream_tma_fp8`),
        // but for the GDN input projection, whose FP8 rows and bf16 b|a rows run as two
        // projections of x's rows.
        let fp8 = matches!(linear.op, Op::Linear(role) if self.bound_scales(linear.block, WeightSlot::Linear(role)).is_some());
        if !staged || (fp8 && linear.op == Op::Linear(LinearRole::GdnInProj)) {
            return Ok(None);
        }
        let kernel = if fp8 { k::LINEAR_STREAM_FP8 } else { k::LINEAR };
        let (_, m, _, _) = self.linear_shape(linear, kernel)?;
        let w = self.linear_weight(linear, kernel)?;
        Ok(self.ops.linear_staging(self.stream, w, m)?)
    }

    /// The stage images `producer` writes its output as, for the projection reading it (see
    /// [`Emitter::staged_x`]); `None`: rows only.
    pub(super) fn staged_for(&self, producer: &Node) -> Result<Option<DevicePtr>> {
        for node in self.plan.circuit().nodes() {
            let reads_it = self
                .x_producer(node)
                .is_some_and(|p| std::ptr::eq(p, producer));
            if reads_it && let Some(images) = self.staged_x(node)? {
                return Ok(Some(images));
            }
        }
        Ok(None)
    }

    /// The node writing `node`'s first input (a projection's x), if a node does.
    fn x_producer(&self, node: &Node) -> Option<&Node> {
        let circuit = self.plan.circuit();
        let value = circuit.value(*node.inputs.first()?)?;
        circuit.node(value.producer?)
    }
}
