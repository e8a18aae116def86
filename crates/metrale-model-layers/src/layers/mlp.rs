//! The dense SwiGLU MLP: `down(silu(gate(x)) * up(x))`, with gate and up fused into one
//! projection at load.

use std::collections::BTreeMap;

use metrale_circuit::LinearRole;
use metrale_gpu_runtime::GpuResult;

use crate::circuit_exec::{BoundWeight, FfnFacts, WeightSlot};
use crate::layer::LayerCtx;
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
    /// Run the MLP on `normed`, leaving the result in `delta`.
    pub fn forward(&self, cx: &LayerCtx<'_>) -> GpuResult<()> {
        let (ops, s, buf, d, rows) = (cx.ops, cx.stream, cx.buf, cx.dims, cx.shape.rows);
        ops.linear(
            s,
            buf.gate_up,
            buf.normed,
            self.gate_up.ptr,
            rows,
            2 * self.ffn,
            d.hidden,
        )?;
        ops.silu_mul(s, buf.act, buf.gate_up, rows, self.ffn)?;
        ops.linear(
            s,
            buf.delta,
            buf.act,
            self.down.ptr,
            rows,
            d.hidden,
            self.ffn,
        )
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
