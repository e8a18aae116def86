//! Weights, layers and launchers: `weight_map` loads a checkpoint's tensors onto the device,
//! `ops` holds one typed launcher per kernel, and `layers` composes them into decoder layers that
//! run one step of rows (prefill chunks and decode alike). `circuit_exec` compiles a model's
//! decode step from its circuit into fixed-address launch programs through the same launchers.
//!
//! Architecture invariant: layers launch kernels only through `ops`.

pub mod circuit_exec;
pub mod layer;
pub mod layers;
pub mod ops;
pub mod ops_attention;
pub mod ops_collective;
pub mod ops_fused;
pub mod ops_gdn_decode;
pub mod ops_gemm;
pub mod ops_hybrid;
pub mod ops_moe;
pub mod ops_rows;
pub mod ops_view;
pub mod weight_map;

pub use layer::{KvBinding, LayerCtx, ModelDims, StepBuffers, StepShape, TransformerLayer};
pub use ops::Ops;
