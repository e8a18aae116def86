//! `Recorder`: a `GpuBackend` that records kernel launches instead of running them, so the
//! typed launchers of `ops` (the ones the legacy forward uses) build a program's launches.
//! [`Recorder::over`] gives an `Ops` bound to the same resolved kernels as a live one, whose
//! every launch lands in the recorder as a [`Launch`].
//!
//! Invariants:
//! - A recorded launch is exactly what the launcher would have passed to the device: the same
//!   kernel handle, geometry and argument list, so replaying it is launching it.
//! - The recorder touches no memory: allocations, copies, memsets, streams, events and graphs
//!   are refused with an error naming the operation.
//! - Collectives are not launches: the recorder reports its backend's tensor-parallel rank and
//!   skips them, so the launches recorded from a sharded model's step are not the whole step.
//!   Nothing replays such a list: the circuit refuses sharded models, and a sharded step's
//!   launches are recorded only to make tensor maps before a capture.

use std::sync::{Arc, Mutex, MutexGuard};

use metrale_gpu_runtime::{
    DType, DevicePtr, EventHandle, GpuBackend, GpuError, GpuResult, GraphHandle, KernelArg,
    KernelHandle, LaunchConfig, Residency, StreamHandle,
};

use crate::ops::Ops;

/// One kernel launch: what `GpuBackend::launch` receives.
#[derive(Debug, Clone, PartialEq)]
pub struct Launch {
    /// The kernel.
    pub kernel: KernelHandle,
    /// Its geometry.
    pub config: LaunchConfig,
    /// Its arguments: the kernel's parameter struct.
    pub args: Vec<KernelArg>,
}

impl Launch {
    /// Its parameter struct, when it is a `P`.
    pub fn params<P: metrale_kernel_abi::KernelParams>(&self) -> Option<P> {
        match self.args.as_slice() {
            [KernelArg::Params(block)] => block.get::<P>(),
            _ => None,
        }
    }

    /// Launch it on `gpu`.
    pub fn run(&self, gpu: &dyn GpuBackend, stream: StreamHandle) -> GpuResult<()> {
        gpu.launch(self.kernel, &self.config, &self.args, stream)
    }
}

/// See the module header.
#[derive(Debug)]
pub struct Recorder {
    /// Resolves kernels; nothing else reaches it.
    inner: Arc<dyn GpuBackend>,
    launches: Mutex<Vec<Launch>>,
}

impl Recorder {
    /// A recorder, and launchers over it with `ops`'s resolved kernels.
    pub fn over(ops: &Ops) -> (Arc<Recorder>, Ops) {
        let recorder = Arc::new(Recorder {
            inner: ops.gpu.clone(),
            launches: Mutex::new(Vec::new()),
        });
        let recording = Ops {
            gpu: recorder.clone(),
            k: ops.k,
            resident: ops.resident.clone(),
            tma: ops.tma.clone(),
        };
        (recorder, recording)
    }

    fn list(&self) -> MutexGuard<'_, Vec<Launch>> {
        // A panic while holding the lock cannot leave the list half-pushed.
        self.launches.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Launches recorded so far.
    pub fn len(&self) -> usize {
        self.list().len()
    }

    /// Whether nothing has been recorded.
    pub fn is_empty(&self) -> bool {
        self.list().is_empty()
    }

    /// The launches recorded since `from`, in order.
    pub fn since(&self, from: usize) -> Vec<Launch> {
        self.list()
            .get(from..)
            .map(<[Launch]>::to_vec)
            .unwrap_or_default()
    }

    /// Every launch recorded, in order, leaving the recorder empty.
    pub fn take(&self) -> Vec<Launch> {
        std::mem::take(&mut *self.list())
    }

    fn refuse<T>(what: &str) -> GpuResult<T> {
        Err(GpuError::Capture(format!(
            "the launch recorder records kernel launches only; {what} is refused"
        )))
    }
}

impl GpuBackend for Recorder {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn alloc(&self, _bytes: usize) -> GpuResult<DevicePtr> {
        Self::refuse("an allocation")
    }

    fn free(&self, _ptr: DevicePtr) -> GpuResult<()> {
        Self::refuse("a free")
    }

    fn copy_h2d(&self, _dst: DevicePtr, _src: &[u8], _stream: StreamHandle) -> GpuResult<()> {
        Self::refuse("a host-to-device copy")
    }

    fn copy_d2h(&self, _dst: &mut [u8], _src: DevicePtr, _stream: StreamHandle) -> GpuResult<()> {
        Self::refuse("a device-to-host copy")
    }

    fn copy_d2d(
        &self,
        _dst: DevicePtr,
        _src: DevicePtr,
        _bytes: usize,
        _stream: StreamHandle,
    ) -> GpuResult<()> {
        Self::refuse("a device-to-device copy")
    }

    fn memset(
        &self,
        _dst: DevicePtr,
        _value: u8,
        _bytes: usize,
        _stream: StreamHandle,
    ) -> GpuResult<()> {
        Self::refuse("a memset")
    }

    fn kernel(&self, module: &str, name: &str) -> GpuResult<KernelHandle> {
        self.inner.kernel(module, name)
    }

    fn launch(
        &self,
        kernel: KernelHandle,
        config: &LaunchConfig,
        args: &[KernelArg],
        _stream: StreamHandle,
    ) -> GpuResult<()> {
        self.list().push(Launch {
            kernel,
            config: *config,
            args: args.to_vec(),
        });
        Ok(())
    }

    fn create_stream(&self) -> GpuResult<StreamHandle> {
        Self::refuse("creating a stream")
    }

    fn synchronize(&self, _stream: StreamHandle) -> GpuResult<()> {
        Self::refuse("a synchronize")
    }

    fn create_event(&self) -> GpuResult<EventHandle> {
        Self::refuse("creating an event")
    }

    fn record_event(&self, _event: EventHandle, _stream: StreamHandle) -> GpuResult<()> {
        Self::refuse("recording an event")
    }

    fn event_elapsed_ms(&self, _start: EventHandle, _end: EventHandle) -> GpuResult<f32> {
        Self::refuse("timing events")
    }

    fn begin_capture(&self, _stream: StreamHandle) -> GpuResult<()> {
        Self::refuse("a graph capture")
    }

    fn end_capture(&self, _stream: StreamHandle) -> GpuResult<GraphHandle> {
        Self::refuse("a graph capture")
    }

    fn launch_graph(&self, _graph: GraphHandle, _stream: StreamHandle) -> GpuResult<()> {
        Self::refuse("a graph launch")
    }

    fn destroy_graph(&self, _graph: GraphHandle) -> GpuResult<()> {
        Self::refuse("destroying a graph")
    }

    fn tp_rank(&self) -> metrale_gpu_runtime::TpRank {
        self.inner.tp_rank()
    }

    fn collective(
        &self,
        _op: &metrale_gpu_runtime::Collective,
        _stream: StreamHandle,
    ) -> GpuResult<()> {
        Ok(())
    }

    fn free_memory(&self) -> GpuResult<usize> {
        self.inner.free_memory()
    }

    fn max_resident(
        &self,
        kernel: KernelHandle,
        config: &LaunchConfig,
        unit: Residency,
    ) -> Option<GpuResult<u32>> {
        self.inner.max_resident(kernel, config, unit)
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
        self.inner
            .tensor_map_2d(base, dtype, rows, cols, box_rows, box_cols)
    }
}
