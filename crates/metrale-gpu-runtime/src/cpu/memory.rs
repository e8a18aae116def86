//! Host memory standing in for device memory, and `KernelCtx`, the checked view a CPU kernel has
//! of its launch: its parameter struct, its geometry, and slices of the buffers it points at.
//!
//! Invariants:
//! - A `DevicePtr` of the CPU backend is the host address of a byte inside a live allocation;
//!   allocations are 256-byte aligned and filled with 0xFF (NaN in every float format) so a read
//!   of never-written memory shows up as NaN instead of plausible zeros.
//! - Every slice a kernel gets lies inside one live allocation, is aligned for its element type,
//!   and never overlaps a mutable slice of the same launch (`KernelCtx` checks all three, so the
//!   CPU backend doubles as a memory checker).

use std::alloc::Layout;
use std::cell::RefCell;
use std::collections::BTreeMap;

use crate::error::{GpuError, GpuResult};
use metrale_kernel_abi::KernelParams;

use crate::types::{DevicePtr, KernelArg, LaunchConfig};

/// Alignment of every allocation, bytes.
pub const ALLOC_ALIGN: usize = 256;

#[derive(Debug)]
struct Allocation {
    len: usize,
    layout: Layout,
}

/// The live allocations, keyed by start address.
#[derive(Debug, Default)]
pub(crate) struct HostMemory {
    allocs: BTreeMap<u64, Allocation>,
    pub(crate) used: usize,
}

impl HostMemory {
    pub(crate) fn alloc(&mut self, bytes: usize) -> GpuResult<DevicePtr> {
        let len = bytes.max(1);
        let layout =
            Layout::from_size_align(len, ALLOC_ALIGN).map_err(|_| GpuError::OutOfMemory {
                requested: bytes,
                context: "size overflows a layout".into(),
            })?;
        // SAFETY: `layout` has a non-zero size (len >= 1).
        let raw = unsafe { std::alloc::alloc(layout) };
        if raw.is_null() {
            return Err(GpuError::OutOfMemory {
                requested: bytes,
                context: "host allocator".into(),
            });
        }
        // SAFETY: `raw` points at `len` freshly allocated bytes.
        unsafe { std::ptr::write_bytes(raw, 0xFF, len) };
        self.allocs.insert(raw as u64, Allocation { len, layout });
        self.used += len;
        Ok(DevicePtr(raw as u64))
    }

    pub(crate) fn free(&mut self, ptr: DevicePtr) -> GpuResult<()> {
        let a = self
            .allocs
            .remove(&ptr.0)
            .ok_or(GpuError::InvalidFree(ptr))?;
        self.used -= a.len;
        // SAFETY: `ptr` was returned by `std::alloc::alloc` with exactly `a.layout` and is
        // removed from the table, so it is freed once.
        unsafe { std::alloc::dealloc(ptr.0 as *mut u8, a.layout) };
        Ok(())
    }

    /// Check that `[ptr, ptr + bytes)` lies in one live allocation.
    pub(crate) fn check(&self, ptr: DevicePtr, bytes: usize, context: &str) -> GpuResult<()> {
        if bytes == 0 {
            return Ok(());
        }
        let bad = || GpuError::InvalidAccess {
            ptr: ptr.0,
            bytes,
            context: context.to_string(),
        };
        let (start, a) = self.allocs.range(..=ptr.0).next_back().ok_or_else(bad)?;
        let end = ptr.0.checked_add(bytes as u64).ok_or_else(bad)?;
        if end > start + a.len as u64 {
            return Err(bad());
        }
        Ok(())
    }

    pub(crate) fn copy(&self, dst: DevicePtr, src: DevicePtr, bytes: usize) -> GpuResult<()> {
        self.check(dst, bytes, "copy destination")?;
        self.check(src, bytes, "copy source")?;
        if bytes > 0 {
            // SAFETY: both ranges were checked to lie in live allocations; `copy` allows overlap.
            unsafe { std::ptr::copy(src.0 as *const u8, dst.0 as *mut u8, bytes) };
        }
        Ok(())
    }

    pub(crate) fn write_from_host(&self, dst: DevicePtr, src: &[u8]) -> GpuResult<()> {
        self.check(dst, src.len(), "host-to-device copy")?;
        if !src.is_empty() {
            // SAFETY: the destination range was checked; a host slice never lies in our heap
            // blocks' live ranges handed out as device memory, so the two cannot overlap.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst.0 as *mut u8, src.len()) };
        }
        Ok(())
    }

    pub(crate) fn read_to_host(&self, dst: &mut [u8], src: DevicePtr) -> GpuResult<()> {
        self.check(src, dst.len(), "device-to-host copy")?;
        if !dst.is_empty() {
            // SAFETY: the source range was checked; `dst` is a distinct host buffer.
            unsafe {
                std::ptr::copy_nonoverlapping(src.0 as *const u8, dst.as_mut_ptr(), dst.len())
            };
        }
        Ok(())
    }

    pub(crate) fn fill(&self, dst: DevicePtr, value: u8, bytes: usize) -> GpuResult<()> {
        self.check(dst, bytes, "memset")?;
        if bytes > 0 {
            // SAFETY: the range was checked to lie in a live allocation.
            unsafe { std::ptr::write_bytes(dst.0 as *mut u8, value, bytes) };
        }
        Ok(())
    }
}

impl Drop for HostMemory {
    fn drop(&mut self) {
        for (start, a) in std::mem::take(&mut self.allocs) {
            // SAFETY: every entry was allocated with its recorded layout and is freed once here.
            unsafe { std::alloc::dealloc(start as *mut u8, a.layout) };
        }
    }
}

// SAFETY: `HostMemory` owns its heap blocks outright; the addresses are only dereferenced under
// the backend's lock.
unsafe impl Send for HostMemory {}

/// A CPU kernel's view of one launch.
#[derive(Debug)]
pub struct KernelCtx<'a> {
    pub(crate) name: &'a str,
    pub(crate) args: &'a [KernelArg],
    pub(crate) config: &'a LaunchConfig,
    memory: &'a HostMemory,
    /// Slices handed out so far: (start, end, mutable, operand).
    borrowed: RefCell<Vec<(u64, u64, bool, &'static str)>>,
}

impl<'a> KernelCtx<'a> {
    pub(crate) fn new(
        name: &'a str,
        args: &'a [KernelArg],
        config: &'a LaunchConfig,
        memory: &'a HostMemory,
    ) -> Self {
        KernelCtx {
            name,
            args,
            config,
            memory,
            borrowed: RefCell::new(Vec::new()),
        }
    }

    /// The launch geometry.
    pub fn config(&self) -> &LaunchConfig {
        self.config
    }

    /// An error naming this kernel.
    pub fn fail(&self, problem: impl Into<String>) -> GpuError {
        GpuError::KernelFailed {
            kernel: self.name.to_string(),
            problem: problem.into(),
        }
    }

    /// The launch's parameter struct: its one argument, which must be a `P`.
    pub fn params<P: KernelParams>(&self) -> GpuResult<P> {
        let bad = |problem: String| GpuError::BadArgument {
            kernel: self.name.to_string(),
            index: 0,
            problem,
        };
        match self.args {
            [KernelArg::Params(block)] => block.get::<P>().ok_or_else(|| {
                bad(format!(
                    "the kernel takes {}, the launch passed {}",
                    P::LAYOUT.name,
                    block.layout().name
                ))
            }),
            _ => Err(bad(format!(
                "the kernel takes one {}, the launch passed {} arguments",
                P::LAYOUT.name,
                self.args.len()
            ))),
        }
    }

    /// Fails unless the launch's blocks have `threads` threads: the block size the CUDA kernel
    /// is written for (it refuses any other).
    pub fn require_block(&self, threads: u32) -> GpuResult<()> {
        if self.config.block != (threads, 1, 1) {
            return Err(self.fail(format!(
                "launched with blocks of {:?} threads; the kernel is written for {threads}",
                self.config.block
            )));
        }
        Ok(())
    }

    fn claim<T>(
        &self,
        what: &'static str,
        ptr: DevicePtr,
        len: usize,
        mutable: bool,
    ) -> GpuResult<Option<*mut T>> {
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .ok_or_else(|| self.fail(format!("operand `{what}`: length {len} overflows")))?;
        if bytes == 0 {
            return Ok(None);
        }
        self.memory.check(
            ptr,
            bytes,
            &format!("kernel `{}` operand `{what}`", self.name),
        )?;
        if !(ptr.0 as usize).is_multiple_of(std::mem::align_of::<T>()) {
            return Err(self.fail(format!("operand `{what}`: {:#x} is misaligned", ptr.0)));
        }
        let (start, end) = (ptr.0, ptr.0 + bytes as u64);
        let mut borrowed = self.borrowed.borrow_mut();
        for &(s, e, m, other) in borrowed.iter() {
            if start < e && s < end && (mutable || m) {
                return Err(GpuError::Aliasing {
                    kernel: self.name.to_string(),
                    problem: format!("operand `{what}` overlaps operand `{other}`"),
                });
            }
        }
        borrowed.push((start, end, mutable, what));
        Ok(Some(ptr.0 as *mut T))
    }

    /// `len` elements read at `ptr`, the operand `what` (its name in errors).
    pub fn slice<T: bytemuck::Pod>(
        &self,
        what: &'static str,
        ptr: DevicePtr,
        len: usize,
    ) -> GpuResult<&[T]> {
        match self.claim::<T>(what, ptr, len, false)? {
            // SAFETY: `claim` checked that the range lies in a live allocation (which outlives
            // this launch: the backend's memory lock is held), is aligned for `T`, and overlaps
            // no mutable slice of this launch. Any bit pattern is a valid `T: Pod`.
            Some(p) => Ok(unsafe { std::slice::from_raw_parts(p as *const T, len) }),
            None => Ok(&[]),
        }
    }

    /// `len` elements written (and possibly read) at `ptr`, the operand `what`.
    #[allow(clippy::mut_from_ref)]
    pub fn slice_mut<T: bytemuck::Pod>(
        &self,
        what: &'static str,
        ptr: DevicePtr,
        len: usize,
    ) -> GpuResult<&mut [T]> {
        match self.claim::<T>(what, ptr, len, true)? {
            // SAFETY: as in `slice`, and the range overlaps no other slice of this launch, so
            // this is the only reference to these bytes while the kernel runs.
            Some(p) => Ok(unsafe { std::slice::from_raw_parts_mut(p, len) }),
            None => Ok(&mut []),
        }
    }

    /// [`KernelCtx::slice`], or `None` for a null `ptr` (an operand the kernel may go without).
    pub fn slice_opt<T: bytemuck::Pod>(
        &self,
        what: &'static str,
        ptr: DevicePtr,
        len: usize,
    ) -> GpuResult<Option<&[T]>> {
        if ptr.is_null() {
            Ok(None)
        } else {
            self.slice(what, ptr, len).map(Some)
        }
    }
}
