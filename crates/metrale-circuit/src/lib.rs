//! `metrale-circuit`: the decode step of a model as data, and its lowering to kernels.
//!
//! - A [`Circuit`] is one decode step (or one sequence's verify or draft step, [`Step`]) as a graph: nodes ([`Op`]s, such as
//!   `Linear(LinearRole::Qkv)` or `GdnRecurrence`) joined by typed edges (a [`Tensor`] with its
//!   [`Format`] and [`Shape`] over named [`Dim`]s). [`Circuit::new`] builds the circuit of an
//!   [`Instance`]: an [`Architecture`], the model's [`Dims`], each layer's [`LayerKind`] and
//!   [`FfnKind`], and the decode widths to compile.
//! - A [`RuleTable`] (one per architecture, [`RuleTable::for_architecture`]) lowers op chains
//!   to named [`Kernel`]s, each rule tagged [`Numerics`]: `Reference` (what the legacy forward
//!   launches), `BitIdentical` or `Differs`.
//! - The fuser ([`fuse`]) covers every node with exactly one rule match, deterministically:
//!   longest match first, table order among equals. [`Fusions::ReferenceOnly`] uses only
//!   reference rules; [`Fusions::All`] every rule whose kernels the caller's [`KernelSet`] has.
//! - A [`Plan`] is the result at one width: groups of nodes with their kernels, each edge's
//!   extents, a canonical text and its SHA-256 [`Digest`], and [`Plan::launches_per_step`].
//!
//! Architecture invariant: this crate is pure. No GPU, no I/O, no environment, no clock, and no
//! dependency on another metrale crate; the same inputs give the same plan text, byte for byte.

mod architectures;
mod circuit;
mod error;
mod fuser;
mod instance;
pub mod kernels;
mod op;
mod plan;
mod rules;
mod shape;
mod tables;
mod tensor;

pub use circuit::{Circuit, Node, NodeId, Value, ValueId};
pub use error::{CircuitError, Excluded};
pub use fuser::{Group, Lowering, fuse};
pub use instance::{
    Architecture, Dims, GdnDims, Instance, KvFormat, MoeDims, SharedExpertDims, Step, WeightFormat,
    Width, decode_ladder,
};
pub use op::{Block, FfnKind, Format, LayerKind, LayerSpec, LinearRole, NormRole, NormWeight, Op};
pub use plan::{Digest, PLAN_FORMAT, Plan, plans_digest};
pub use rules::{Fusions, Kernel, KernelSet, Numerics, Rule, RuleTable};
pub use shape::{Dim, Extent, Shape};
pub use tensor::{Tensor, TensorKind, TensorSpec};
