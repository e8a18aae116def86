//! Every CUDA kernel against its CPU twin, through the same `Ops` launcher: random inputs (never
//! zeros), outputs poisoned with 0xFF (NaN) on both sides first, compared with a `Tolerance` per
//! output dtype; each case prints its worst error as a `kernel-check` line. Shapes cover
//! dimensions that are not multiples of 8 (the scalar fallbacks), grouped-query attention,
//! several rows, padding slots (`u32::MAX`) and non-contiguous block tables. Also: CUDA results
//! are deterministic and batch-invariant (a row's output does not depend on `m`), a captured
//! graph replayed with new inputs at the same addresses equals eager execution bitwise, and a
//! launch a kernel refuses comes back as `GpuError::KernelFault` (`backend`); and NCCL's
//! collectives on a group of one rank (`collective`).
//!
//! `sanitize::sanitizer_set_reaches_every_kernel` runs the same checks at small shapes and
//! asserts that they launched every kernel of the manifest: `run.sh` runs it alone under
//! compute-sanitizer's memcheck and racecheck.
//!
//! Runs only with the `cuda` feature, on the GPU machine (from `cargo xtask gpu-bundle`).

#![allow(clippy::unwrap_used, clippy::type_complexity)]
#![cfg(feature = "cuda")]

#[path = "gpu_kernels/attention.rs"]
mod attention;
#[path = "gpu_kernels/attention_case.rs"]
mod attention_case;
#[path = "gpu_kernels/backend.rs"]
mod backend;
#[path = "gpu_kernels/collective.rs"]
mod collective;
#[path = "gpu_kernels/fp8.rs"]
mod fp8;
#[path = "gpu_kernels/fused.rs"]
mod fused;
#[path = "gpu_kernels/harness.rs"]
mod harness;
#[path = "gpu_kernels/hybrid.rs"]
mod hybrid;
#[path = "gpu_kernels/linear.rs"]
mod linear;
#[path = "gpu_kernels/moe.rs"]
mod moe;
#[path = "gpu_kernels/rows.rs"]
mod rows;
#[path = "gpu_kernels/sampling.rs"]
mod sampling;
#[path = "gpu_kernels/sanitize.rs"]
mod sanitize;
#[path = "gpu_kernels/staged.rs"]
mod staged;
#[path = "gpu_kernels/step.rs"]
mod step;
