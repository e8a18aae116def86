//! `GpuError`: everything a backend call can fail with, each variant naming what and where.

use metrale_kernel_abi::FaultReason;

use crate::types::DevicePtr;

/// An error from a `GpuBackend` call.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// The device has too little free memory for an allocation.
    #[error("out of device memory: asked for {requested} bytes ({context})")]
    OutOfMemory {
        /// Bytes asked for.
        requested: usize,
        /// What the allocation was for.
        context: String,
    },
    /// An address does not lie inside a live allocation of the needed length.
    #[error(
        "invalid device access: {bytes} bytes at {ptr:#x} are not inside one live allocation ({context})"
    )]
    InvalidAccess {
        /// Start address.
        ptr: u64,
        /// Bytes accessed.
        bytes: usize,
        /// Which kernel or copy made the access.
        context: String,
    },
    /// `free` of an address that is not the start of a live allocation.
    #[error("free of {0:?}, which is not a live allocation")]
    InvalidFree(DevicePtr),
    /// `kernel(module, name)` found no such kernel.
    #[error("no kernel `{module}::{name}` in this backend{hint}")]
    UnknownKernel {
        /// Module (family) name.
        module: String,
        /// Function name.
        name: String,
        /// Extra guidance, e.g. "run cargo xtask kernels".
        hint: String,
    },
    /// A kernel handle that this backend never returned.
    #[error("kernel handle {0} is not known to this backend")]
    BadKernelHandle(u32),
    /// A launch whose argument list does not match what the kernel reads.
    #[error("kernel `{kernel}`: argument {index}: {problem}")]
    BadArgument {
        /// `module::name`.
        kernel: String,
        /// Position in the flat argument list.
        index: usize,
        /// What was wrong.
        problem: String,
    },
    /// A launcher's operands do not fit together (a dtype, a shape that differs from what
    /// another operand says): refused before anything is launched.
    #[error("kernel `{kernel}`: operand `{operand}`: {problem}")]
    BadOperand {
        /// `module::name`.
        kernel: String,
        /// The operand's name in the launcher.
        operand: &'static str,
        /// What does not fit.
        problem: String,
    },
    /// A kernel found its inputs inconsistent (a shape, an index out of range).
    #[error("kernel `{kernel}`: {problem}")]
    KernelFailed {
        /// `module::name`.
        kernel: String,
        /// What was wrong.
        problem: String,
    },
    /// A kernel refused its launch on the device: it wrote its fault code (its manifest index
    /// and the reason) into the backend's fault word instead of computing, and the backend read
    /// it back ([`crate::GpuBackend::take_kernel_error`]).
    #[error("kernel `{kernel}` refused its launch: it was {}", .reason.describe())]
    KernelFault {
        /// `module::name`, or the raw code where no kernel of the manifest wrote it.
        kernel: String,
        /// Why.
        reason: FaultReason,
    },
    /// Two buffers of one launch overlap where the kernel needs them apart.
    #[error("kernel `{kernel}`: buffers overlap ({problem})")]
    Aliasing {
        /// `module::name`.
        kernel: String,
        /// Which buffers.
        problem: String,
    },
    /// An operation not allowed in the current capture state.
    /// A collective that did not run because its group was aborted: another rank failed its
    /// step (that rank's own error says why).
    #[error("collective `{op}`: the group was aborted: another rank failed its step")]
    CollectiveAborted {
        /// The collective.
        op: &'static str,
    },
    /// A collective of tensor parallelism failed or is not available on this backend.
    #[error("collective `{op}`: {problem}")]
    Collective {
        /// The collective (`all_reduce_sum`, `all_gather_cols`), or `communicator_init` for
        /// making a group's NCCL communicators.
        op: &'static str,
        /// What went wrong.
        problem: String,
    },
    #[error("capture: {0}")]
    Capture(String),
    /// A stream, event or graph handle this backend does not know.
    #[error("unknown {kind} handle {id}")]
    UnknownHandle {
        /// "stream", "event" or "graph".
        kind: &'static str,
        /// The handle's value.
        id: u64,
    },
    /// This build has no such backend.
    #[error("backend `{0}` is not available: {1}")]
    Unavailable(String, String),
    /// An error reported by the CUDA driver or a CUDA library.
    #[error("CUDA: {op}: {message}")]
    Driver {
        /// The operation that failed.
        op: String,
        /// The driver's message.
        message: String,
    },
}

/// `Result` with a [`GpuError`].
pub type GpuResult<T> = Result<T, GpuError>;
