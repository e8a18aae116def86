//! The kernel ABI: what the CUDA sources in `kernels/` and the Rust side must agree on, defined
//! once. Pure data: no GPU, no I/O.
//!
//! - The manifest ([`for_each_kernel!`], [`KERNELS`]): every kernel as `(module, name)` with its
//!   parameter struct. The CPU twin table, the launchers' kernel table and the circuit's kernel
//!   names are generated from it; `cargo xtask kernels` checks the compiled entry points against
//!   it.
//! - The parameter structs ([`params`]): one `#[repr(C)]` `Pod` struct per kernel signature,
//!   whose bytes the backends pass as the kernel's parameters.
//! - The shared constants ([`consts`]): tile sizes, thread counts, splits, shared-memory budgets;
//!   and the attention kernels' geometry ([`attention`]), which both sides compute.
//! - The device fault codes ([`fault`]): how a kernel reports a launch it refuses.
//! - [`c_header`]: `kernels/abi.cuh`, the C mirror of all of the above.
//!
//! Invariant: `kernels/abi.cuh` is `c_header()` byte for byte (a test checks it).

pub mod attention;
pub mod consts;
pub mod fault;
pub mod header;
pub mod layout;
pub mod manifest;
pub mod params;

pub use consts::*;
pub use fault::{FAULT_WORD_SYMBOL, FaultReason, decode_fault, fault_code};
pub use header::c_header;
pub use layout::{Field, FieldKind, KernelParams, ParamsLayout};
pub use manifest::{KERNELS, KernelInfo, check_module_entries, kernel_index, kernel_info};
pub use params::*;

use bytemuck::{Pod, Zeroable};

/// A byte address in a backend's device memory; a typed C pointer on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Pod, Zeroable)]
#[repr(transparent)]
pub struct DevicePtr(pub u64);

impl DevicePtr {
    /// The null address; never a live allocation.
    pub const NULL: DevicePtr = DevicePtr(0);

    /// The address `bytes` past this one.
    pub fn offset(self, bytes: usize) -> DevicePtr {
        DevicePtr(self.0 + bytes as u64)
    }

    /// Whether this is [`DevicePtr::NULL`].
    pub fn is_null(self) -> bool {
        self.0 == 0
    }
}

/// The most bytes a parameter struct has (the backends keep a launch's parameters inline).
pub const MAX_PARAMS_BYTES: usize = 128;

const _: () = {
    let mut i = 0;
    while i < KERNELS.len() {
        assert!(
            KERNELS[i].params.size <= MAX_PARAMS_BYTES,
            "a parameter struct outgrew MAX_PARAMS_BYTES"
        );
        i += 1;
    }
};
