//! `Circuit`: one step of a model as data (a decode, verify or draft step, [`Step`]). Nodes
//! (an [`Op`] in a [`Block`]) joined by
//! typed edges ([`Value`]s: a [`Tensor`], hence a format and a shape expression), built from an
//! [`Instance`] by the architecture's builder (`architectures.rs`).
//!
//! Invariants:
//! - Nodes are in launch order, which is a topological order: every value a node reads is a
//!   step input or state (no producer) or was written by an earlier node.
//! - Values are single-assignment: a node that updates a buffer in place (the residual, qkv, a
//!   state pool) reads one value and writes a new one of the same tensor.
//! - Every shape resolves, at every width of the instance, to extents >= 1 (checked by
//!   [`Circuit::new`]).

use std::collections::BTreeMap;
use std::fmt;

use crate::error::CircuitError;
use crate::instance::{Instance, Step, Width};
use crate::op::{Block, FfnKind, LayerKind, Op};
use crate::tensor::{Tensor, TensorKind};

/// A node's index in its circuit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(pub usize);

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "n{}", self.0)
    }
}

/// A value's index in its circuit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ValueId(pub usize);

/// An edge: one version of a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Value {
    /// The tensor (buffer or state pool) holding it; its format and shape are the tensor's.
    pub tensor: Tensor,
    /// The block whose state pool it is (state tensors are per layer); `None` for buffers the
    /// whole step shares.
    pub pool_of: Option<Block>,
    /// The node that writes it; `None` for a step input or the state as the step finds it.
    pub producer: Option<NodeId>,
}

/// One operation of the step.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Node {
    /// What it computes.
    pub op: Op,
    /// Where in the step.
    pub block: Block,
    /// Values it reads.
    pub inputs: Vec<ValueId>,
    /// Values it writes.
    pub outputs: Vec<ValueId>,
}

/// See the module header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Circuit {
    instance: Instance,
    step: Step,
    layer_kinds: Vec<LayerKind>,
    ffn_kinds: Vec<FfnKind>,
    nodes: Vec<Node>,
    values: Vec<Value>,
}

impl Circuit {
    /// The decode circuit of `instance`'s architecture at its dimensions; fails naming the
    /// first invariant the instance breaks.
    pub fn new(instance: &Instance) -> Result<Circuit, CircuitError> {
        Circuit::for_step(instance, Step::Decode)
    }

    /// The circuit of `step` (checked at the instance's widths of that step).
    pub fn for_step(instance: &Instance, step: Step) -> Result<Circuit, CircuitError> {
        instance.validate()?;
        let mut b = Builder::default();
        crate::architectures::build(instance, step, &mut b)?;
        let circuit = Circuit {
            instance: instance.clone(),
            step,
            layer_kinds: instance.layers.iter().map(|l| l.kind).collect(),
            ffn_kinds: instance.layers.iter().map(|l| l.ffn).collect(),
            nodes: b.nodes,
            values: b.values,
        };
        for w in instance.widths_of(step) {
            circuit.extents(w)?;
        }
        Ok(circuit)
    }

    /// The instance it was built from.
    pub fn instance(&self) -> &Instance {
        &self.instance
    }

    /// The step it computes.
    pub fn step(&self) -> Step {
        self.step
    }

    /// The widths its plans are compiled at ([`Instance::widths_of`] its step).
    pub fn widths(&self) -> Vec<Width> {
        self.instance.widths_of(self.step)
    }

    /// Each layer's mixer.
    pub fn layer_kinds(&self) -> &[LayerKind] {
        &self.layer_kinds
    }

    /// Each layer's FFN.
    pub fn ffn_kinds(&self) -> &[FfnKind] {
        &self.ffn_kinds
    }

    /// Every node, in launch order.
    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    /// A node.
    pub fn node(&self, id: NodeId) -> Option<&Node> {
        self.nodes.get(id.0)
    }

    /// Every value.
    pub fn values(&self) -> &[Value] {
        &self.values
    }

    /// A value.
    pub fn value(&self, id: ValueId) -> Option<&Value> {
        self.values.get(id.0)
    }

    /// Each value's extents at `width`, indexed like [`Circuit::values`].
    pub fn extents(&self, width: Width) -> Result<Vec<Vec<u64>>, CircuitError> {
        if width.rows == 0 || width.seqs == 0 {
            return Err(CircuitError::ZeroRows);
        }
        self.values
            .iter()
            .map(|v| {
                let spec = v.tensor.spec();
                spec.shape
                    .0
                    .iter()
                    .map(|e| {
                        let n = e.eval(|d| self.instance.dim(d, width, self.step))?;
                        // `Instance::dim` saturates, so u64::MAX stands for an overflow too.
                        match n {
                            Some(n) if (1..u64::MAX).contains(&n) => Ok(n),
                            _ => Err(CircuitError::BadExtent {
                                tensor: spec.name,
                                dim: e.to_string(),
                                value: n.map_or("overflow".into(), |n| n.to_string()),
                            }),
                        }
                    })
                    .collect()
            })
            .collect()
    }

    /// Whether `later` reads a value `earlier` writes.
    pub fn reads_from(&self, later: NodeId, earlier: NodeId) -> bool {
        let Some(node) = self.node(later) else {
            return false;
        };
        node.inputs
            .iter()
            .any(|&v| self.values.get(v.0).and_then(|v| v.producer) == Some(earlier))
    }
}

/// Appends nodes in launch order, versioning each tensor as nodes write it.
#[derive(Debug, Default)]
pub(crate) struct Builder {
    nodes: Vec<Node>,
    values: Vec<Value>,
    /// The current value of each (tensor, pool) pair.
    current: BTreeMap<(Tensor, Option<Block>), ValueId>,
}

impl Builder {
    /// Append `op` in `block`, reading the current value of each of `reads` and writing a new
    /// value of each of `writes`.
    pub(crate) fn node(&mut self, block: Block, op: Op, reads: &[Tensor], writes: &[Tensor]) {
        let id = NodeId(self.nodes.len());
        let inputs = reads.iter().map(|&t| self.read(block, t)).collect();
        let outputs = writes
            .iter()
            .map(|&t| {
                let key = (t, pool_of(block, t));
                let v = ValueId(self.values.len());
                self.values.push(Value {
                    tensor: t,
                    pool_of: key.1,
                    producer: Some(id),
                });
                self.current.insert(key, v);
                v
            })
            .collect();
        self.nodes.push(Node {
            op,
            block,
            inputs,
            outputs,
        });
    }

    fn read(&mut self, block: Block, t: Tensor) -> ValueId {
        let key = (t, pool_of(block, t));
        if let Some(&v) = self.current.get(&key) {
            return v;
        }
        let v = ValueId(self.values.len());
        self.values.push(Value {
            tensor: t,
            pool_of: key.1,
            producer: None,
        });
        self.current.insert(key, v);
        v
    }
}

/// State pools are per layer; every other tensor is one buffer of the step.
fn pool_of(block: Block, t: Tensor) -> Option<Block> {
    (t.spec().kind == TensorKind::State).then_some(block)
}
