//! The dense SwiGLU MLP: `down(silu(gate(x)) * up(x))`, with gate and up fused into one
//! projection at load.

use std::collections::BTreeMap;

use metrale_circuit::LinearRole;
use metrale_gpu_runtime::{DevicePtr, GpuResult};

use crate::circuit_exec::{BoundWeight, FfnFacts, WeightSlot};
use crate::layer::LayerCtx;
use crate::ops::Matrix;
use crate::weight_map::DenseWeight;

/// One MLP's weights.
#[derive(Debug, Clone)]
pub struct Mlp {
    /// `[gate ; up]` stacked on the output dim: `[2 * ffn, hidden]`.
    pub gate_up: DenseWeight,
    /// `[hidden, ffn]`.
    pub down: DenseWeight,
    /// FFN width.
    pub ffn: u32,
}

impl Mlp {
    /// Run the MLP on `normed`, leaving the result in `delta`. `staged`: `normed` was also
    /// written as stage images there (`Ops::linear_staging`), which the gate/up projection
    /// reads. The SwiGLU writes the down projection's input as stage images too where the
    /// staging buffer serves it (`Ops::linear_staging`: prefill sizes, and decode sizes that
    /// `linear_stream_tma` takes from images).
    pub fn forward(&self, cx: &LayerCtx<'_>, staged: Option<DevicePtr>) -> GpuResult<()> {
        let (ops, s, buf, d, rows) = (cx.ops, cx.stream, cx.buf, cx.dims, cx.shape.rows);
        let gate_up = Matrix::bf16(buf.acts.gate_up, rows, 2 * self.ffn);
        let normed = Matrix::bf16(buf.acts.normed, rows, d.hidden);
        let (act, delta) = (
            Matrix::bf16(buf.acts.act, rows, self.ffn),
            Matrix::bf16(buf.acts.delta, rows, d.hidden),
        );
        let (w_gate_up, w_down) = (self.gate_up.matrix(), self.down.matrix());
        // A sharded down projection reads its input plainly: its f32 partial sums go to the
        // all-reduce.
        let images = match cx.sharded() {
            true => None,
            false => ops.linear_staging(s, w_down, rows)?,
        };
        // In a prefill step (row groups for the prefill attention; decode steps keep the
        // launches the circuit's programs replay) one launch computes the SwiGLU from the
        // gate/up projection's tiles and writes it as the down projection's images into the
        // projection's own buffer, which it then no longer needs.
        if let (Some(x_images), Some(_)) = (staged, images)
            && cx.shape.att_groups > 0
            && ops.linear_swiglu_staged(s, (gate_up, normed, w_gate_up), x_images)?
        {
            return ops.linear_staged(s, (delta, act, w_down), gate_up.ptr);
        }
        match staged {
            Some(images) => ops.linear_staged(s, (gate_up, normed, w_gate_up), images)?,
            None => ops.linear(s, gate_up, normed, w_gate_up)?,
        }
        if let Some(images) = images {
            ops.silu_mul_staged(s, images, act, gate_up)?;
            return ops.linear_staged(s, (delta, act, w_down), images);
        }
        ops.silu_mul(s, act, gate_up)?;
        cx.row_parallel(act, w_down)
    }

    /// Bind the MLP's weights into `weights` and return the facts its kernels read.
    pub(crate) fn circuit_facts(
        &self,
        weights: &mut BTreeMap<WeightSlot, BoundWeight>,
    ) -> FfnFacts {
        weights.insert(
            WeightSlot::Linear(LinearRole::GateUp),
            (&self.gate_up).into(),
        );
        weights.insert(WeightSlot::Linear(LinearRole::Down), (&self.down).into());
        FfnFacts::Dense { ffn: self.ffn }
    }
}
