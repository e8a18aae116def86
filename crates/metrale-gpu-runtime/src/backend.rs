//! The `GpuBackend` trait: the one interface through which the engine touches device memory and
//! launches kernels. `CpuBackend` implements it on host memory as the reference; `CudaBackend`
//! (feature `cuda`) on an NVIDIA GPU.
//!
//! Invariants:
//! - Work on one stream runs in submission order. `copy_h2d` may return before the copy has run,
//!   but the host slice may be reused as soon as it returns. `copy_d2h` returns after the data is
//!   in the host slice (it waits for the stream's earlier work).
//! - Between `begin_capture` and `end_capture` on a stream, launches, device-to-device copies and
//!   memsets on it are recorded, not run; host copies there are refused. `launch_graph` replays a
//!   recording in order, reading whatever the recorded addresses hold at replay time.

use crate::collective::{Collective, TpRank};
use crate::error::{GpuError, GpuResult};
use crate::types::{
    DType, DevicePtr, EventHandle, GraphHandle, KernelArg, KernelHandle, LaunchConfig, Residency,
    StreamHandle,
};

/// A reference GEMM `out[m, n] = x[m, k] · w[n, k]ᵀ`, row-major, bf16 out; x and w bf16, or
/// e4m3 bytes (scale 1).
#[derive(Debug, Clone, Copy)]
pub struct VendorGemm {
    /// `[m, n]` bf16.
    pub out: DevicePtr,
    /// `[m, k]` of `inputs`.
    pub x: DevicePtr,
    /// `[n, k]` of `inputs`.
    pub w: DevicePtr,
    /// The element type of x and w: `Bf16` or `F8E4M3`.
    pub inputs: DType,
    /// Rows of `x`.
    pub m: u32,
    /// Rows of `w`.
    pub n: u32,
    /// The shared dimension.
    pub k: u32,
}

/// A device: memory, kernels, streams, events and graphs.
pub trait GpuBackend: Send + Sync + std::fmt::Debug {
    /// "cpu" or "cuda".
    fn name(&self) -> &'static str;

    /// Allocate `bytes` (at least 256-byte aligned). The contents are unspecified.
    fn alloc(&self, bytes: usize) -> GpuResult<DevicePtr>;

    /// Free an allocation made by `alloc`.
    fn free(&self, ptr: DevicePtr) -> GpuResult<()>;

    /// Copy host bytes to the device.
    fn copy_h2d(&self, dst: DevicePtr, src: &[u8], stream: StreamHandle) -> GpuResult<()>;

    /// Copy device bytes to the host; returns once `dst` holds them.
    fn copy_d2h(&self, dst: &mut [u8], src: DevicePtr, stream: StreamHandle) -> GpuResult<()>;

    /// Copy `bytes` between two device addresses.
    fn copy_d2d(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        bytes: usize,
        stream: StreamHandle,
    ) -> GpuResult<()>;

    /// Set `bytes` bytes at `dst` to `value`.
    fn memset(
        &self,
        dst: DevicePtr,
        value: u8,
        bytes: usize,
        stream: StreamHandle,
    ) -> GpuResult<()>;

    /// Resolve the kernel `module::name`.
    fn kernel(&self, module: &str, name: &str) -> GpuResult<KernelHandle>;

    /// Launch a kernel with its flat argument list.
    fn launch(
        &self,
        kernel: KernelHandle,
        config: &LaunchConfig,
        args: &[KernelArg],
        stream: StreamHandle,
    ) -> GpuResult<()>;

    /// The default stream.
    fn default_stream(&self) -> StreamHandle {
        StreamHandle::DEFAULT
    }

    /// A new stream.
    fn create_stream(&self) -> GpuResult<StreamHandle>;

    /// Wait until all work queued on `stream` has finished. A backend that checks kernel
    /// faults at synchronization (`CudaBackendOptions::check_kernel_errors`) then also reports
    /// one as [`GpuError::KernelFault`](crate::GpuError::KernelFault).
    fn synchronize(&self, stream: StreamHandle) -> GpuResult<()>;

    /// Wait for all queued work, then report (and clear) the first launch a kernel refused on
    /// the device since the last call, as [`GpuError::KernelFault`](crate::GpuError::KernelFault).
    /// Refused while a stream captures. The CPU backend's kernels fail their launch instead, so
    /// it has none to report.
    fn take_kernel_error(&self) -> GpuResult<()> {
        Ok(())
    }

    /// A new event.
    fn create_event(&self) -> GpuResult<EventHandle>;

    /// Record `event` at the current end of `stream`.
    fn record_event(&self, event: EventHandle, stream: StreamHandle) -> GpuResult<()>;

    /// Milliseconds between two recorded events (waits for `end`).
    fn event_elapsed_ms(&self, start: EventHandle, end: EventHandle) -> GpuResult<f32>;

    /// Start recording the work queued on `stream`.
    fn begin_capture(&self, stream: StreamHandle) -> GpuResult<()>;

    /// Stop recording and return the recorded graph.
    fn end_capture(&self, stream: StreamHandle) -> GpuResult<GraphHandle>;

    /// Replay a captured graph on `stream`.
    fn launch_graph(&self, graph: GraphHandle, stream: StreamHandle) -> GpuResult<()>;

    /// Release a captured graph.
    fn destroy_graph(&self, graph: GraphHandle) -> GpuResult<()>;

    /// Bytes of device memory free now (the CPU backend reports the host's budget).
    fn free_memory(&self) -> GpuResult<usize>;

    /// How many clusters (`Residency::Clusters`, for a kernel compiled with a cluster size) or
    /// blocks (`Residency::Blocks`) of `kernel` can be resident on the device at once with
    /// `config`'s block size and dynamic shared memory: the most a launch of persistent clusters
    /// or blocks should use, since one that does not fit waits for another to finish. `None`
    /// where the backend has no such limit (the CPU backend runs a launch's blocks one after
    /// another).
    fn max_resident(
        &self,
        kernel: KernelHandle,
        config: &LaunchConfig,
        unit: Residency,
    ) -> Option<GpuResult<u32>> {
        let _ = (kernel, config, unit);
        None
    }

    /// The 128-byte tensor map through which a kernel's tensor memory accelerator copies boxes of
    /// `box_rows` x `box_cols` from the row-major `dtype` matrix `[rows, cols]` at `base` (16-byte
    /// aligned rows), swizzled by the box row's bytes (128 or 64: `box_cols` times the element
    /// size; other widths are refused), rows and columns past the ends read as zero: the
    /// tensor-map kernels' weights (bf16, or the bytes of `F8E4M3`). `None` where the backend has
    /// no such unit (the CPU twins do not read the map).
    fn tensor_map_2d(
        &self,
        base: DevicePtr,
        dtype: DType,
        rows: u32,
        cols: u32,
        box_rows: u32,
        box_cols: u32,
    ) -> Option<GpuResult<[u8; 128]>> {
        let _ = (base, dtype, rows, cols, box_rows, box_cols);
        None
    }

    /// The rank this backend drives in its tensor-parallel group ([`TpRank::SINGLE`] for a
    /// backend alone).
    fn tp_rank(&self) -> TpRank {
        TpRank::SINGLE
    }

    /// Queue collective `op` over the group on `stream` (recorded while it captures). Every
    /// rank must queue the same collectives in the same order. The default refuses: a backend
    /// alone has no group.
    fn collective(&self, op: &Collective, stream: StreamHandle) -> GpuResult<()> {
        let _ = stream;
        Err(GpuError::Collective {
            op: op.name(),
            problem: format!(
                "backend `{}` is not in a tensor-parallel group",
                self.name()
            ),
        })
    }

    /// Fail every collective of the group that waits now or is queued later: called when a
    /// rank's step failed, so the other ranks return instead of waiting for it. No-op for a
    /// backend alone.
    fn abort_collectives(&self) {}

    /// Queue the vendor library's GEMM (cuBLASLt on CUDA) on `stream`, bf16 or e4m3 inputs (the
    /// latter with the library's fast accumulation): the device's GEMM ceilings for the
    /// benchmark, never a path of the engine (its rounding changes with the shape). `None` where
    /// the backend has no such library.
    fn vendor_gemm(&self, gemm: &VendorGemm, stream: StreamHandle) -> Option<GpuResult<()>> {
        let _ = (gemm, stream);
        None
    }
}

/// Helpers every backend gets: typed uploads and downloads.
pub trait GpuBackendExt: GpuBackend {
    /// Upload a slice of plain values.
    fn upload<T: bytemuck::Pod>(
        &self,
        dst: DevicePtr,
        src: &[T],
        stream: StreamHandle,
    ) -> GpuResult<()> {
        self.copy_h2d(dst, bytemuck::cast_slice(src), stream)
    }

    /// Download `len` plain values.
    fn download<T: bytemuck::Pod + bytemuck::Zeroable>(
        &self,
        src: DevicePtr,
        len: usize,
        stream: StreamHandle,
    ) -> GpuResult<Vec<T>> {
        let mut out = vec![T::zeroed(); len];
        self.copy_d2h(bytemuck::cast_slice_mut(&mut out), src, stream)?;
        Ok(out)
    }

    /// Allocate and upload in one go.
    fn alloc_upload<T: bytemuck::Pod>(
        &self,
        src: &[T],
        stream: StreamHandle,
    ) -> GpuResult<DevicePtr> {
        let bytes = std::mem::size_of_val(src).max(1);
        let ptr = self.alloc(bytes)?;
        self.copy_h2d(ptr, bytemuck::cast_slice(src), stream)?;
        Ok(ptr)
    }
}

impl<B: GpuBackend + ?Sized> GpuBackendExt for B {}
