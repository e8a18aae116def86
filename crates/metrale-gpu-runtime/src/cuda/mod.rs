//! `CudaBackend`: the `GpuBackend` on an NVIDIA GPU, through the CUDA driver API (cudarc's `sys`
//! layer with dynamic loading, so a build needs no CUDA installed and a machine without the
//! driver gets `GpuError::Unavailable` rather than a crash).
//!
//! - Memory: `cuMemAlloc` (256-byte aligned), freed by `cuMemFree`; live allocations are tracked
//!   so a bad `free` is an `InvalidFree`, and whatever is left is freed on drop.
//! - Copies: `copy_h2d` of up to 1 MiB copies the bytes into a pinned staging ring (`staging`)
//!   and queues `cuMemcpyHtoDAsync` from there without waiting; a larger one queues it from the
//!   caller's slice and waits for the stream. Either way the host slice may be reused on return.
//!   `copy_d2h` waits for the stream. Both are refused while the stream captures.
//! - Kernels: resolved by `(module, name)` in the embedded cubins (see `modules`; a kernel of
//!   the manifest compiled with another parameter layout than its struct's is refused), launched
//!   by `cuLaunchKernel` with the parameter struct's bytes at the compiled offsets (or a flat
//!   list, each `KernelArg` packed as its C type), after checking them against the compiled
//!   signature; a `LaunchConfig::programmatic` launch goes through `cuLaunchKernelEx` with the
//!   programmatic-stream-serialization attribute (kept as a programmatic edge under capture).
//! - Faults: a kernel that refuses its launch writes its code into the fault word (`faults`);
//!   `take_kernel_error` reads it back as `GpuError::KernelFault`, and so does `synchronize`
//!   when `CudaBackendOptions::check_kernel_errors` is on (debug builds by default).
//! - Streams: `StreamHandle::DEFAULT` is a real non-blocking stream created at start (the legacy
//!   NULL stream cannot be captured); `create_stream` makes more.
//! - Capture: `cuStreamBeginCapture` in thread-local mode, `cuStreamEndCapture`, then
//!   `cuGraphInstantiate`; `launch_graph` is `cuGraphLaunch`.
//! - Collectives: a backend of a tensor-parallel group (`tensor_parallel_group`, one backend a
//!   device) queues NCCL's all-reduce and all-gather on its stream (`nccl`), captured in graphs
//!   like launches; `abort_collectives` aborts the group's communicators.
//!
//! Invariants:
//! - Every driver call runs with the backend's primary context current on the calling thread
//!   (`driver::bind`), so the backend may be used from any thread.
//! - The driver's handles (context, streams, events, graphs, modules) are owned by the backend
//!   and destroyed exactly once, in `Drop`, or by `destroy_graph`.

mod blaslt;
mod driver;
mod faults;
mod launch;
mod modules;
mod nccl;
mod open;
mod staging;

use std::collections::{HashMap, HashSet};
use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::sys;
use parking_lot::{Mutex, RwLock};

use self::blaslt::Blaslt;
use self::driver::{bind, check};
use self::faults::{FaultWord, fault_result};
use self::modules::KernelTable;
pub use self::modules::{ModuleSource, embedded_modules};
use self::nccl::NcclGroup;
use self::staging::{STAGING_MAX_COPY, Staging};
use crate::backend::{GpuBackend, VendorGemm};
use crate::collective::{Collective, TpRank};
use crate::error::{GpuError, GpuResult};
use crate::types::{
    DType, DevicePtr, EventHandle, GraphHandle, KernelArg, KernelHandle, LaunchConfig, Residency,
    StreamHandle,
};

/// Streams, events, graphs and allocations, by handle.
#[derive(Debug, Default)]
struct Handles {
    next_stream: u64,
    streams: HashMap<u64, sys::CUstream>,
    next_event: u64,
    events: HashMap<u64, sys::CUevent>,
    next_graph: u64,
    graphs: HashMap<u64, (sys::CUgraph, sys::CUgraphExec)>,
    capturing: HashSet<u64>,
    allocations: HashMap<u64, usize>,
}

/// The CUDA backend; see the module header.
#[derive(Debug)]
pub struct CudaBackend {
    instance: u64,
    ordinal: usize,
    device: sys::CUdevice,
    device_name: String,
    ctx: sys::CUcontext,
    default_stream: sys::CUstream,
    max_dynamic_smem: i32,
    handles: Mutex<Handles>,
    kernels: RwLock<KernelTable>,
    staging: Mutex<Staging>,
    /// cuBLASLt, loaded on first use (`None` inside: the library is absent).
    blaslt: Mutex<Option<Option<Blaslt>>>,
    /// The word kernels write their faults to (`faults`).
    faults: FaultWord,
    options: CudaBackendOptions,
    /// This backend's rank and its group's NCCL communicators, in a tensor-parallel group
    /// (`tensor_parallel_group`). Dropped after `Drop` destroyed the graphs.
    group: Option<(usize, Arc<NcclGroup>)>,
}

/// Settings of the CUDA backend.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct CudaBackendOptions {
    /// Read the device fault word at every `synchronize` and report a launch a kernel refused as
    /// `GpuError::KernelFault` (one 4-byte copy per synchronize). Default: on in debug builds
    /// (`cfg!(debug_assertions)`), off in release builds, where `take_kernel_error` asks
    /// explicitly.
    pub check_kernel_errors: bool,
}

impl Default for CudaBackendOptions {
    fn default() -> Self {
        CudaBackendOptions {
            check_kernel_errors: cfg!(debug_assertions),
        }
    }
}

impl CudaBackendOptions {
    /// These options with `check_kernel_errors` set to `on`.
    pub fn check_kernel_errors(mut self, on: bool) -> Self {
        self.check_kernel_errors = on;
        self
    }
}

// SAFETY: the raw handles are process-wide driver objects, valid on any thread once the context
// is current (every method binds it first); the driver API is thread-safe; all mutable
// bookkeeping is behind `handles` and `kernels`.
unsafe impl Send for CudaBackend {}
// SAFETY: as for `Send`: shared access only reads immutable handles or takes a lock.
unsafe impl Sync for CudaBackend {}

impl CudaBackend {
    fn bind(&self) -> GpuResult<()> {
        bind(self.instance, self.ctx)
    }

    fn stream(&self, stream: StreamHandle) -> GpuResult<sys::CUstream> {
        if stream == StreamHandle::DEFAULT {
            return Ok(self.default_stream);
        }
        self.handles
            .lock()
            .streams
            .get(&stream.0)
            .copied()
            .ok_or(GpuError::UnknownHandle {
                kind: "stream",
                id: stream.0,
            })
    }

    fn refuse_in_capture(&self, stream: StreamHandle, what: &str) -> GpuResult<()> {
        if self.handles.lock().capturing.contains(&stream.0) {
            return Err(GpuError::Capture(format!(
                "{what} is not allowed while stream {} is capturing",
                stream.0
            )));
        }
        Ok(())
    }

    fn event(&self, event: EventHandle) -> GpuResult<sys::CUevent> {
        self.handles
            .lock()
            .events
            .get(&event.0)
            .copied()
            .ok_or(GpuError::UnknownHandle {
                kind: "event",
                id: event.0,
            })
    }

    fn sync_stream(&self, op: &str, s: sys::CUstream) -> GpuResult<()> {
        // SAFETY: `s` is a live stream of this backend's context, which is current.
        check(op, unsafe { sys::cuStreamSynchronize(s) })
    }
}

/// A new non-blocking stream in the current context.
fn new_stream() -> GpuResult<sys::CUstream> {
    let mut s: sys::CUstream = std::ptr::null_mut();
    // SAFETY: the caller made the backend's context current; `s` is an out-pointer.
    check("cuStreamCreate", unsafe {
        sys::cuStreamCreate(&mut s, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
    })?;
    Ok(s)
}

impl GpuBackend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn alloc(&self, bytes: usize) -> GpuResult<DevicePtr> {
        self.bind()?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: the context is current; `ptr` is an out-pointer; size is at least 1.
        let code = unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes.max(1)) };
        if code == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            let free = self.free_memory().unwrap_or(0);
            return Err(GpuError::OutOfMemory {
                requested: bytes,
                context: format!(
                    "cuMemAlloc on GPU {} ({}), {free} bytes free",
                    self.ordinal, self.device_name
                ),
            });
        }
        check("cuMemAlloc", code)?;
        self.handles.lock().allocations.insert(ptr, bytes);
        Ok(DevicePtr(ptr))
    }

    fn free(&self, ptr: DevicePtr) -> GpuResult<()> {
        self.bind()?;
        if self.handles.lock().allocations.remove(&ptr.0).is_none() {
            return Err(GpuError::InvalidFree(ptr));
        }
        // SAFETY: `ptr` was returned by `cuMemAlloc` and removed from the live set, so it is
        // freed once.
        check("cuMemFree", unsafe { sys::cuMemFree_v2(ptr.0) })
    }

    fn copy_h2d(&self, dst: DevicePtr, src: &[u8], stream: StreamHandle) -> GpuResult<()> {
        self.refuse_in_capture(stream, "a host-to-device copy")?;
        let s = self.stream(stream)?;
        if src.is_empty() {
            return Ok(());
        }
        self.bind()?;
        if src.len() <= STAGING_MAX_COPY {
            return self.staging.lock().copy(dst.0, src, s);
        }
        // SAFETY: `src` is a live slice of `src.len()` bytes until we return, and we return only
        // after the stream (and so this copy) has completed; the driver checks `dst`.
        check("cuMemcpyHtoDAsync", unsafe {
            sys::cuMemcpyHtoDAsync_v2(dst.0, src.as_ptr() as *const c_void, src.len(), s)
        })?;
        self.sync_stream("cuStreamSynchronize (after a host-to-device copy)", s)
    }

    fn copy_d2h(&self, dst: &mut [u8], src: DevicePtr, stream: StreamHandle) -> GpuResult<()> {
        self.refuse_in_capture(stream, "a device-to-host copy")?;
        let s = self.stream(stream)?;
        if dst.is_empty() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: `dst` is a live, exclusively borrowed slice of `dst.len()` bytes until we
        // return, and we return only after the stream (and so this copy) has completed.
        check("cuMemcpyDtoHAsync", unsafe {
            sys::cuMemcpyDtoHAsync_v2(dst.as_mut_ptr() as *mut c_void, src.0, dst.len(), s)
        })?;
        self.sync_stream("cuStreamSynchronize (after a device-to-host copy)", s)
    }

    fn copy_d2d(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        bytes: usize,
        stream: StreamHandle,
    ) -> GpuResult<()> {
        let s = self.stream(stream)?;
        if bytes == 0 {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: both addresses are device addresses the driver checks; no host memory is
        // touched.
        check("cuMemcpyDtoDAsync", unsafe {
            sys::cuMemcpyDtoDAsync_v2(dst.0, src.0, bytes, s)
        })
    }

    fn memset(
        &self,
        dst: DevicePtr,
        value: u8,
        bytes: usize,
        stream: StreamHandle,
    ) -> GpuResult<()> {
        let s = self.stream(stream)?;
        if bytes == 0 {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: a device address the driver checks; no host memory is touched.
        check("cuMemsetD8Async", unsafe {
            sys::cuMemsetD8Async(dst.0, value, bytes, s)
        })
    }

    fn kernel(&self, module: &str, name: &str) -> GpuResult<KernelHandle> {
        if let Some(h) = self.kernels.read().lookup(module, name) {
            return Ok(h);
        }
        self.bind()?;
        self.kernels
            .write()
            .resolve(module, name, self.max_dynamic_smem, &self.faults)
    }

    fn launch(
        &self,
        kernel: KernelHandle,
        config: &LaunchConfig,
        args: &[KernelArg],
        stream: StreamHandle,
    ) -> GpuResult<()> {
        let s = self.stream(stream)?;
        let table = self.kernels.read();
        let entry = table
            .entries
            .get(kernel.0 as usize)
            .ok_or(GpuError::BadKernelHandle(kernel.0))?;
        self.bind()?;
        launch::launch(entry, config, args, s)
    }

    fn max_resident(
        &self,
        kernel: KernelHandle,
        config: &LaunchConfig,
        unit: Residency,
    ) -> Option<GpuResult<u32>> {
        let table = self.kernels.read();
        let Some(entry) = table.entries.get(kernel.0 as usize) else {
            return Some(Err(GpuError::BadKernelHandle(kernel.0)));
        };
        Some(self.bind().and_then(|()| match unit {
            Residency::Clusters => launch::max_active_clusters(entry, config),
            Residency::Blocks => launch::max_active_blocks(entry, config, self.device),
        }))
    }

    fn tensor_map_2d(
        &self,
        base: DevicePtr,
        dtype: DType,
        rows: u32,
        cols: u32,
        box_rows: u32,
        box_cols: u32,
    ) -> Option<GpuResult<[u8; 128]>> {
        Some(
            self.bind().and_then(|()| {
                launch::tensor_map_2d(base, dtype, (rows, cols), (box_rows, box_cols))
            }),
        )
    }

    fn create_stream(&self) -> GpuResult<StreamHandle> {
        self.bind()?;
        let s = new_stream()?;
        let mut h = self.handles.lock();
        let id = h.next_stream;
        h.next_stream += 1;
        h.streams.insert(id, s);
        Ok(StreamHandle(id))
    }

    fn synchronize(&self, stream: StreamHandle) -> GpuResult<()> {
        self.refuse_in_capture(stream, "synchronize")?;
        let s = self.stream(stream)?;
        self.bind()?;
        self.sync_stream("cuStreamSynchronize", s)?;
        if self.options.check_kernel_errors {
            return fault_result(self.faults.take()?);
        }
        Ok(())
    }

    fn take_kernel_error(&self) -> GpuResult<()> {
        if !self.handles.lock().capturing.is_empty() {
            return Err(GpuError::Capture(
                "reading the kernel fault word is not allowed while a stream captures".into(),
            ));
        }
        self.bind()?;
        // SAFETY: the context is current; waits for all queued work.
        check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })?;
        fault_result(self.faults.take()?)
    }

    fn create_event(&self) -> GpuResult<EventHandle> {
        self.bind()?;
        let mut e: sys::CUevent = std::ptr::null_mut();
        // SAFETY: the context is current; `e` is an out-pointer.
        check("cuEventCreate", unsafe {
            sys::cuEventCreate(&mut e, sys::CUevent_flags::CU_EVENT_DEFAULT as u32)
        })?;
        let mut h = self.handles.lock();
        let id = h.next_event;
        h.next_event += 1;
        h.events.insert(id, e);
        Ok(EventHandle(id))
    }

    fn record_event(&self, event: EventHandle, stream: StreamHandle) -> GpuResult<()> {
        let (e, s) = (self.event(event)?, self.stream(stream)?);
        self.bind()?;
        // SAFETY: both handles are live objects of this backend's context.
        check("cuEventRecord", unsafe { sys::cuEventRecord(e, s) })
    }

    fn event_elapsed_ms(&self, start: EventHandle, end: EventHandle) -> GpuResult<f32> {
        let (a, b) = (self.event(start)?, self.event(end)?);
        self.bind()?;
        // SAFETY: `b` is a live event of this context.
        check("cuEventSynchronize", unsafe { sys::cuEventSynchronize(b) })?;
        let mut ms = 0f32;
        // SAFETY: both events are live and recorded; `ms` is an out-pointer.
        check("cuEventElapsedTime", unsafe {
            sys::cuEventElapsedTime_v2(&mut ms, a, b)
        })?;
        Ok(ms)
    }

    fn begin_capture(&self, stream: StreamHandle) -> GpuResult<()> {
        let s = self.stream(stream)?;
        self.bind()?;
        let mut h = self.handles.lock();
        if h.capturing.contains(&stream.0) {
            return Err(GpuError::Capture(format!(
                "stream {} is already capturing",
                stream.0
            )));
        }
        // SAFETY: `s` is a live stream of this context.
        check("cuStreamBeginCapture", unsafe {
            sys::cuStreamBeginCapture_v2(
                s,
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
        })?;
        h.capturing.insert(stream.0);
        Ok(())
    }

    fn end_capture(&self, stream: StreamHandle) -> GpuResult<GraphHandle> {
        let s = self.stream(stream)?;
        self.bind()?;
        if !self.handles.lock().capturing.remove(&stream.0) {
            return Err(GpuError::Capture(format!(
                "stream {} is not capturing",
                stream.0
            )));
        }
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: `s` is a live stream that this backend put into capture mode; `graph` is an
        // out-pointer.
        check("cuStreamEndCapture", unsafe {
            sys::cuStreamEndCapture(s, &mut graph)
        })?;
        let mut exec: sys::CUgraphExec = std::ptr::null_mut();
        // SAFETY: `graph` is the graph just captured; `exec` is an out-pointer.
        let code = unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0) };
        if let Err(e) = check("cuGraphInstantiate", code) {
            // SAFETY: `graph` is owned here and destroyed once.
            let _ = unsafe { sys::cuGraphDestroy(graph) };
            return Err(e);
        }
        let mut h = self.handles.lock();
        let id = h.next_graph;
        h.next_graph += 1;
        h.graphs.insert(id, (graph, exec));
        Ok(GraphHandle(id))
    }

    fn launch_graph(&self, graph: GraphHandle, stream: StreamHandle) -> GpuResult<()> {
        let s = self.stream(stream)?;
        let (_, exec) =
            self.handles
                .lock()
                .graphs
                .get(&graph.0)
                .copied()
                .ok_or(GpuError::UnknownHandle {
                    kind: "graph",
                    id: graph.0,
                })?;
        self.bind()?;
        // SAFETY: `exec` is a live executable graph of this context (destroyed only by
        // `destroy_graph`, which removes it from the table first).
        check("cuGraphLaunch", unsafe { sys::cuGraphLaunch(exec, s) })
    }

    fn destroy_graph(&self, graph: GraphHandle) -> GpuResult<()> {
        let (g, exec) =
            self.handles
                .lock()
                .graphs
                .remove(&graph.0)
                .ok_or(GpuError::UnknownHandle {
                    kind: "graph",
                    id: graph.0,
                })?;
        self.bind()?;
        // SAFETY: removed from the table above, so destroyed once; a launch already queued keeps
        // its own reference (the driver defers destruction until it completes).
        check("cuGraphExecDestroy", unsafe {
            sys::cuGraphExecDestroy(exec)
        })?;
        // SAFETY: as above.
        check("cuGraphDestroy", unsafe { sys::cuGraphDestroy(g) })
    }

    fn tp_rank(&self) -> TpRank {
        self.group
            .as_ref()
            .map_or(TpRank::SINGLE, |(rank, group)| TpRank {
                rank: *rank,
                size: group.size(),
            })
    }

    /// NCCL's collective on `stream` (`nccl`): f32 sums and gathers only.
    fn collective(&self, op: &Collective, stream: StreamHandle) -> GpuResult<()> {
        let Some((rank, group)) = &self.group else {
            return Err(GpuError::Collective {
                op: op.name(),
                problem: "this CUDA backend is not in a tensor-parallel group (make one with \
                          `CudaBackend::tensor_parallel_group`)"
                    .into(),
            });
        };
        op.check(group.size())?;
        let s = self.stream(stream)?;
        self.bind()?;
        group.run(*rank, op, s)
    }

    fn abort_collectives(&self) {
        if let Some((_, group)) = &self.group {
            group.abort();
        }
    }

    fn free_memory(&self) -> GpuResult<usize> {
        self.bind()?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: the context is current; both are out-pointers.
        check("cuMemGetInfo", unsafe {
            sys::cuMemGetInfo_v2(&mut free, &mut total)
        })?;
        Ok(free)
    }

    fn vendor_gemm(&self, gemm: &VendorGemm, stream: StreamHandle) -> Option<GpuResult<()>> {
        let run = || -> GpuResult<Option<()>> {
            let s = self.stream(stream)?;
            self.bind()?;
            let mut lt = self.blaslt.lock();
            if lt.is_none() {
                *lt = Some(Blaslt::new()?);
            }
            match lt.as_mut().and_then(Option::as_mut) {
                Some(lt) => lt.gemm(gemm, s).map(Some),
                None => Ok(None),
            }
        };
        run().transpose()
    }
}
