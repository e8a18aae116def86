//! The plain values that cross the `GpuBackend` boundary: device addresses, handles, launch
//! geometry, kernel arguments and element types.
//!
//! Invariants:
//! - A `DevicePtr` is a byte address in the backend's address space; `DevicePtr::NULL` (0) is
//!   never a live allocation.
//! - A kernel's arguments are its parameter struct (`metrale-kernel-abi`), passed as one
//!   [`KernelArg::Params`]: the struct's bytes are the kernel's parameter buffer. A flat list of
//!   scalars and pointers is still accepted by the CUDA backend (checked against the compiled
//!   signature), which the tests of bad launches use; every launcher passes its struct.

use metrale_kernel_abi::{KernelParams, MAX_PARAMS_BYTES, ParamsLayout};

pub use metrale_kernel_abi::DevicePtr;

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

/// A kernel's parameter struct as bytes, kept inline (a launch recorded for a graph or a
/// program owns its arguments), with the layout of the struct they came from.
#[derive(Clone, Copy)]
pub struct ParamBlock {
    layout: &'static ParamsLayout,
    len: u8,
    bytes: [u8; MAX_PARAMS_BYTES],
}

impl ParamBlock {
    /// The bytes of `params`.
    pub fn new<P: KernelParams>(params: &P) -> ParamBlock {
        let src = bytemuck::bytes_of(params);
        let mut bytes = [0u8; MAX_PARAMS_BYTES];
        bytes[..src.len()].copy_from_slice(src);
        ParamBlock {
            layout: &P::LAYOUT,
            len: src.len() as u8,
            bytes,
        }
    }

    /// The layout of the struct the bytes came from.
    pub fn layout(&self) -> &'static ParamsLayout {
        self.layout
    }

    /// The struct's bytes: the kernel's parameter buffer.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len)]
    }

    /// The struct, when it is a `P`.
    pub fn get<P: KernelParams>(&self) -> Option<P> {
        (self.layout.name == P::LAYOUT.name && self.bytes().len() == std::mem::size_of::<P>())
            .then(|| bytemuck::pod_read_unaligned(self.bytes()))
    }

    /// Each device pointer by name, in order.
    pub fn ptr_fields(&self) -> impl Iterator<Item = (&'static str, DevicePtr)> + '_ {
        self.layout
            .fields
            .iter()
            .filter(|f| f.kind == metrale_kernel_abi::FieldKind::Ptr)
            .map(|f| {
                let mut b = [0u8; 8];
                b.copy_from_slice(&self.bytes[f.offset..f.offset + 8]);
                (f.name, DevicePtr(u64::from_le_bytes(b)))
            })
    }

    /// Each 4-byte unsigned field by name, in order (the shape scalars of most kernels).
    pub fn u32_fields(&self) -> impl Iterator<Item = (&'static str, u32)> + '_ {
        self.layout
            .fields
            .iter()
            .filter(|f| f.kind == metrale_kernel_abi::FieldKind::U32)
            .map(|f| {
                let b = &self.bytes[f.offset..f.offset + 4];
                (f.name, u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            })
    }
}

impl PartialEq for ParamBlock {
    fn eq(&self, other: &ParamBlock) -> bool {
        self.layout.name == other.layout.name && self.bytes() == other.bytes()
    }
}

impl std::fmt::Debug for ParamBlock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}({} bytes)", self.layout.name, self.len)
    }
}

/// One launch argument: a kernel's parameter struct, or one entry of a flat argument list.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KernelArg {
    /// The kernel's parameter struct; the launch's only argument.
    Params(ParamBlock),
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
    /// The argument list of a kernel taking `params`.
    pub fn params<P: KernelParams>(params: &P) -> KernelArg {
        KernelArg::Params(ParamBlock::new(params))
    }

    /// The argument's name in error messages.
    pub fn kind(&self) -> &'static str {
        match self {
            KernelArg::Params(p) => p.layout().name,
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
    /// FP8 E4M3 (OCP `e4m3fn`: no infinities, ±448 at most), the element type of block-FP8
    /// weights; such a weight always comes with its f32 block scales.
    F8E4M3,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::Bf16 | DType::F16 => 2,
            DType::F32 | DType::U32 => 4,
            DType::F8E4M3 => 1,
        }
    }

    /// The name used in configs and error messages.
    pub fn name(self) -> &'static str {
        match self {
            DType::Bf16 => "bf16",
            DType::F16 => "f16",
            DType::F32 => "f32",
            DType::U32 => "u32",
            DType::F8E4M3 => "fp8_e4m3",
        }
    }
}
