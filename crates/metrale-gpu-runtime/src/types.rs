//! The plain values that cross the `GpuBackend` boundary: device addresses, handles, launch
//! geometry, kernel arguments and element types.
//!
//! Invariants:
//! - A `DevicePtr` is a byte address in the backend's address space; `DevicePtr::NULL` (0) is
//!   never a live allocation.
//! - A kernel's argument list is flat and ordered: device pointers first, then scalars, exactly as
//!   its typed launcher in `metrale-model-layers::ops` builds it.

use bytemuck::{Pod, Zeroable};

/// A byte address in a backend's device memory.
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

/// A kernel resolved by `GpuBackend::kernel`; an index into the backend's own table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct KernelHandle(pub u32);

/// A stream (an ordered queue of device work). `StreamHandle::DEFAULT` always exists.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct StreamHandle(pub u64);

impl StreamHandle {
    /// The backend's default stream.
    pub const DEFAULT: StreamHandle = StreamHandle(0);
}

/// A recorded event on a stream, for ordering and timing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct EventHandle(pub u64);

/// A captured sequence of device work, replayed as one unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GraphHandle(pub u64);

/// What a residency query counts ([`crate::GpuBackend::max_resident`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Residency {
    /// Clusters of a kernel compiled with a cluster size (`__cluster_dims__`).
    Clusters,
    /// Blocks of a kernel compiled without one.
    Blocks,
}

/// Grid, block and dynamic shared memory of one launch. The CPU backend ignores the geometry
/// (its kernels loop over the whole problem) but checks nothing else differs from CUDA.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchConfig {
    /// Blocks in x, y, z.
    pub grid: (u32, u32, u32),
    /// Threads per block in x, y, z.
    pub block: (u32, u32, u32),
    /// Dynamic shared memory per block, bytes.
    pub shared_mem_bytes: u32,
    /// Programmatic dependent launch (CUDA's programmatic stream serialization): the kernel may
    /// start while the kernel ahead of it on the stream is still running, and must wait for it
    /// (`pdl_wait` in `kernels/common.cuh`) before touching memory that kernel, or one before
    /// it, reads or writes. Only kernels that do so may be launched with it; the CPU backend,
    /// which runs launches one after another, ignores it.
    pub programmatic: bool,
}

impl LaunchConfig {
    /// A 1-D grid of `blocks` blocks of `threads` threads, no dynamic shared memory.
    pub fn linear(blocks: u32, threads: u32) -> LaunchConfig {
        LaunchConfig {
            grid: (blocks.max(1), 1, 1),
            block: (threads, 1, 1),
            shared_mem_bytes: 0,
            programmatic: false,
        }
    }

    /// A 2-D grid of `x` by `y` blocks of `threads` threads.
    pub fn grid2(x: u32, y: u32, threads: u32) -> LaunchConfig {
        LaunchConfig {
            grid: (x.max(1), y.max(1), 1),
            block: (threads, 1, 1),
            shared_mem_bytes: 0,
            programmatic: false,
        }
    }

    /// The same launch with `bytes` of dynamic shared memory.
    pub fn with_shared(mut self, bytes: u32) -> LaunchConfig {
        self.shared_mem_bytes = bytes;
        self
    }

    /// The same launch as a programmatic dependent launch (see `programmatic`).
    pub fn with_programmatic(mut self) -> LaunchConfig {
        self.programmatic = true;
        self
    }
}

/// One entry of a kernel's flat argument list.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KernelArg {
    /// A device address.
    Ptr(DevicePtr),
    /// A 32-bit unsigned scalar.
    U32(u32),
    /// A 32-bit signed scalar.
    I32(i32),
    /// A 32-bit float scalar.
    F32(f32),
    /// A 64-bit unsigned scalar.
    U64(u64),
}

impl KernelArg {
    /// The argument's name in error messages.
    pub fn kind(&self) -> &'static str {
        match self {
            KernelArg::Ptr(_) => "ptr",
            KernelArg::U32(_) => "u32",
            KernelArg::I32(_) => "i32",
            KernelArg::F32(_) => "f32",
            KernelArg::U64(_) => "u64",
        }
    }
}

impl From<DevicePtr> for KernelArg {
    fn from(p: DevicePtr) -> Self {
        KernelArg::Ptr(p)
    }
}
impl From<u32> for KernelArg {
    fn from(v: u32) -> Self {
        KernelArg::U32(v)
    }
}
impl From<i32> for KernelArg {
    fn from(v: i32) -> Self {
        KernelArg::I32(v)
    }
}
impl From<f32> for KernelArg {
    fn from(v: f32) -> Self {
        KernelArg::F32(v)
    }
}
impl From<u64> for KernelArg {
    fn from(v: u64) -> Self {
        KernelArg::U64(v)
    }
}

/// Element types stored on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// bfloat16.
    Bf16,
    /// IEEE half.
    F16,
    /// IEEE single.
    F32,
    /// 32-bit unsigned integer (token ids, positions, slots, block tables).
    U32,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::Bf16 | DType::F16 => 2,
            DType::F32 | DType::U32 => 4,
        }
    }

    /// The name used in configs and error messages.
    pub fn name(self) -> &'static str {
        match self {
            DType::Bf16 => "bf16",
            DType::F16 => "f16",
            DType::F32 => "f32",
            DType::U32 => "u32",
        }
    }
}
