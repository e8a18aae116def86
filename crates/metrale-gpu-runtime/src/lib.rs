//! The device layer: `DevicePtr` and handles, the `GpuBackend` trait, `CpuBackend` (the reference
//! backend that runs every kernel in Rust), `CudaBackend` behind the `cuda` feature, and
//! `BufferArena`, where every activation buffer is allocated once at fixed addresses.
//!
//! Architecture invariant: this is the only crate that imports cudarc.

pub mod arena;
pub mod backend;
pub mod collective;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod error;
pub mod fp8;
pub mod types;

pub use arena::BufferArena;
pub use backend::{GpuBackend, GpuBackendExt, VendorGemm};
pub use collective::{Collective, CpuCommunicator, TpRank};
pub use cpu::{CpuBackend, CpuBackendOptions};
#[cfg(feature = "cuda")]
pub use cuda::{CudaBackend, CudaBackendOptions};
pub use error::{GpuError, GpuResult};
pub use metrale_kernel_abi::FaultReason;
pub use types::{
    DType, DevicePtr, EventHandle, GraphHandle, KernelArg, KernelHandle, LaunchConfig, ParamBlock,
    Residency, StreamHandle,
};
