//! The harness of the GPU kernel tests: the seeded generator (`metrale_testkit::Rng`, re-exported
//! for the test modules), the `Tolerance` type with its per-dtype presets, and `Pair`, which holds
//! the same buffers on `CpuBackend` and `CudaBackend` and runs one `Ops` launcher on both.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, OnceLock, RwLock, RwLockReadGuard, RwLockWriteGuard};

use half::bf16;
use metrale_gpu_runtime::{
    CpuBackend, CudaBackend, CudaBackendOptions, DType, DevicePtr, EventHandle, GpuBackend,
    GpuBackendExt, GpuResult, GraphHandle, KernelArg, KernelHandle, LaunchConfig, Residency,
    StreamHandle,
};
use metrale_kernel_abi::KernelParams;
use metrale_model_layers::Ops;
use metrale_model_layers::ops_gemm::{LinearStaging, linear_staging_bytes};
pub use metrale_testkit::Rng;

/// The stream every test uses.
pub const S: StreamHandle = StreamHandle::DEFAULT;

/// How far a CUDA result may be from the CPU twin's: `|gpu - cpu| <= abs + rel * |cpu|`.
#[derive(Debug, Clone, Copy)]
pub struct Tolerance {
    pub rel: f32,
    pub abs: f32,
}

impl Tolerance {
    /// Bitwise the same (copies, integer outputs, the reproducible fill).
    pub const EXACT: Tolerance = Tolerance { rel: 0.0, abs: 0.0 };
    /// bf16 outputs of values of order one: a bf16 ulp is 2^-8 relative, and the two sides may
    /// round a value on either side of a tie after slightly different f32 sums.
    pub const BF16: Tolerance = Tolerance {
        rel: 1e-2,
        abs: 1e-2,
    };
    /// f32 outputs of long dot products (k in the thousands) summed in another order, on tensor
    /// cores, for values of order one.
    pub const F32_DOT: Tolerance = Tolerance {
        rel: 1e-3,
        abs: 1e-3,
    };
    /// f32 results of short element-wise formulas (norm scales, gates, softmax): a few ulps
    /// apart after sums in another order and `expf` against Rust's `exp`.
    pub const F32_ELEMENTWISE: Tolerance = Tolerance {
        rel: 1e-5,
        abs: 1e-6,
    };
}

/// The worst deviation seen in one comparison.
#[derive(Debug, Clone, Copy, Default)]
pub struct Worst {
    pub max_abs: f32,
    pub max_rel: f32,
    pub count: usize,
}

/// Compare element by element; panics naming the first element out of tolerance (NaN on either
/// side counts, unless both hold the same bits), and prints a `kernel-check` line that
/// `run.sh` collects.
pub fn compare(kernel: &str, case: &str, got: &[f32], want: &[f32], tol: Tolerance) -> Worst {
    assert_eq!(got.len(), want.len(), "{kernel} {case}: length");
    let mut worst = Worst {
        count: got.len(),
        ..Worst::default()
    };
    let mut first_bad = None;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if g.to_bits() == w.to_bits() {
            continue;
        }
        let err = (g - w).abs();
        let rel = err / w.abs().max(1e-6);
        if err.is_nan() {
            first_bad.get_or_insert((i, g, w));
            continue;
        }
        worst.max_abs = worst.max_abs.max(err);
        worst.max_rel = worst.max_rel.max(if w.abs() > tol.abs { rel } else { 0.0 });
        if err > tol.abs + tol.rel * w.abs() {
            first_bad.get_or_insert((i, g, w));
        }
    }
    println!(
        "kernel-check {kernel:<18} {case:<44} n={:<9} max_abs={:.3e} max_rel={:.3e} tol(rel={:.0e}, abs={:.0e}) {}",
        worst.count,
        worst.max_abs,
        worst.max_rel,
        tol.rel,
        tol.abs,
        if first_bad.is_none() { "ok" } else { "FAIL" }
    );
    if let Some((i, g, w)) = first_bad {
        panic!("{kernel} {case}: element {i}: cuda {g} vs cpu {w} (tolerance {tol:?})");
    }
    worst
}

pub fn widen(v: &[bf16]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

/// The same allocation on both backends.
#[derive(Debug, Clone, Copy)]
pub struct Buf {
    pub cpu: DevicePtr,
    pub gpu: DevicePtr,
    pub bytes: usize,
}

/// Which side a launcher call is for; `at` maps a `Buf` to that side's address.
pub type At<'a> = &'a dyn Fn(&Buf) -> DevicePtr;

/// The CPU reference and the CUDA backend, with an `Ops` on each.
#[derive(Debug)]
pub struct Pair {
    pub cpu: Arc<dyn GpuBackend>,
    pub gpu: Arc<dyn GpuBackend>,
    /// The CUDA side, which remembers the kernels launched.
    pub cuda: Arc<TestCuda>,
    pub cpu_ops: Ops,
    pub gpu_ops: Ops,
    live: std::cell::RefCell<Vec<Buf>>,
    _device: DeviceTurn,
}

/// A test's hold on the process's one device: shared, or alone for a test that makes kernels
/// fault on purpose (the fault word is the device's, so a fault would fail whichever test
/// synchronizes next).
#[derive(Debug)]
pub enum DeviceTurn {
    Shared {
        _guard: RwLockReadGuard<'static, ()>,
    },
    Alone {
        _guard: RwLockWriteGuard<'static, ()>,
    },
}

static DEVICE_TURNS: RwLock<()> = RwLock::new(());

/// A shared turn on the device, for a test that holds no [`Pair`].
pub fn device_shared() -> DeviceTurn {
    DeviceTurn::Shared {
        _guard: DEVICE_TURNS.read().unwrap_or_else(|e| e.into_inner()),
    }
}

/// The one CUDA backend of this test process, with `check_kernel_errors` on: a launch a kernel
/// refuses fails the `synchronize` after it.
pub fn cuda() -> Arc<CudaBackend> {
    static GPU: OnceLock<Arc<CudaBackend>> = OnceLock::new();
    GPU.get_or_init(|| {
        let options = CudaBackendOptions::default().check_kernel_errors(true);
        Arc::new(
            CudaBackend::with_options(0, options)
                .expect("a CUDA GPU (run this from the GPU bundle)"),
        )
    })
    .clone()
}

/// `CudaBackend` that remembers the kernels launched through it (`launched`), so a test can
/// check that it reached every kernel of the manifest. Everything else is the real backend's.
#[derive(Debug)]
pub struct TestCuda {
    inner: Arc<CudaBackend>,
    /// `module::name` of every handle `kernel` returned.
    names: Mutex<HashMap<u32, String>>,
    /// The handles launched.
    launched: Mutex<BTreeSet<u32>>,
}

impl TestCuda {
    pub fn new() -> Arc<TestCuda> {
        Arc::new(TestCuda {
            inner: cuda(),
            names: Default::default(),
            launched: Default::default(),
        })
    }

    /// `module::name` of every kernel launched through this backend.
    pub fn launched(&self) -> BTreeSet<String> {
        let names = self.names.lock().expect("lock");
        self.launched
            .lock()
            .expect("lock")
            .iter()
            .filter_map(|h| names.get(h).cloned())
            .collect()
    }
}

impl GpuBackend for TestCuda {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn alloc(&self, bytes: usize) -> GpuResult<DevicePtr> {
        self.inner.alloc(bytes)
    }
    fn free(&self, ptr: DevicePtr) -> GpuResult<()> {
        self.inner.free(ptr)
    }
    fn copy_h2d(&self, dst: DevicePtr, src: &[u8], s: StreamHandle) -> GpuResult<()> {
        self.inner.copy_h2d(dst, src, s)
    }
    fn copy_d2h(&self, dst: &mut [u8], src: DevicePtr, s: StreamHandle) -> GpuResult<()> {
        self.inner.copy_d2h(dst, src, s)
    }
    fn copy_d2d(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        bytes: usize,
        s: StreamHandle,
    ) -> GpuResult<()> {
        self.inner.copy_d2d(dst, src, bytes, s)
    }
    fn memset(&self, dst: DevicePtr, value: u8, bytes: usize, s: StreamHandle) -> GpuResult<()> {
        self.inner.memset(dst, value, bytes, s)
    }
    fn kernel(&self, module: &str, name: &str) -> GpuResult<KernelHandle> {
        let handle = self.inner.kernel(module, name)?;
        self.names
            .lock()
            .expect("lock")
            .insert(handle.0, format!("{module}::{name}"));
        Ok(handle)
    }
    fn launch(
        &self,
        k: KernelHandle,
        cfg: &LaunchConfig,
        args: &[KernelArg],
        s: StreamHandle,
    ) -> GpuResult<()> {
        self.launched.lock().expect("lock").insert(k.0);
        self.inner.launch(k, cfg, args, s)
    }
    fn create_stream(&self) -> GpuResult<StreamHandle> {
        self.inner.create_stream()
    }
    fn synchronize(&self, s: StreamHandle) -> GpuResult<()> {
        self.inner.synchronize(s)
    }
    fn take_kernel_error(&self) -> GpuResult<()> {
        self.inner.take_kernel_error()
    }
    fn create_event(&self) -> GpuResult<EventHandle> {
        self.inner.create_event()
    }
    fn record_event(&self, e: EventHandle, s: StreamHandle) -> GpuResult<()> {
        self.inner.record_event(e, s)
    }
    fn event_elapsed_ms(&self, a: EventHandle, b: EventHandle) -> GpuResult<f32> {
        self.inner.event_elapsed_ms(a, b)
    }
    fn begin_capture(&self, s: StreamHandle) -> GpuResult<()> {
        self.inner.begin_capture(s)
    }
    fn end_capture(&self, s: StreamHandle) -> GpuResult<GraphHandle> {
        self.inner.end_capture(s)
    }
    fn launch_graph(&self, g: GraphHandle, s: StreamHandle) -> GpuResult<()> {
        self.inner.launch_graph(g, s)
    }
    fn destroy_graph(&self, g: GraphHandle) -> GpuResult<()> {
        self.inner.destroy_graph(g)
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

impl Pair {
    /// Both backends, sharing the device with the other tests running.
    pub fn new() -> Pair {
        Pair::with_turn(device_shared())
    }

    /// Both backends, with no other test on the device until this `Pair` is dropped: for a test
    /// whose kernels fault on purpose.
    pub fn alone() -> Pair {
        let _guard = DEVICE_TURNS.write().unwrap_or_else(|e| e.into_inner());
        Pair::with_turn(DeviceTurn::Alone { _guard })
    }

    fn with_turn(turn: DeviceTurn) -> Pair {
        let cpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::default());
        let cuda = TestCuda::new();
        let gpu: Arc<dyn GpuBackend> = cuda.clone();
        let cpu_ops = Ops::new(cpu.clone()).expect("CPU kernels resolve");
        let gpu_ops = Ops::new(gpu.clone()).expect("every kernel resolves on CUDA");
        Pair {
            cpu,
            gpu,
            cuda,
            cpu_ops,
            gpu_ops,
            live: Default::default(),
            _device: turn,
        }
    }

    /// Give both sides' `linear` a staging buffer for `m` rows of up to `k` (prefill-sized calls
    /// then run `linear_tma`), or take it back (`None`).
    pub fn stage_linear(&self, rows_k: Option<(u32, u32)>) {
        match rows_k {
            Some((m, k)) => {
                let images = linear_staging_bytes(m, k);
                let buf = self.poisoned(LinearStaging::bytes(images, 4));
                for (ops, base) in [(&self.cpu_ops, buf.cpu), (&self.gpu_ops, buf.gpu)] {
                    ops.set_linear_staging(Some(LinearStaging::at(base, images, 4)));
                }
            }
            None => {
                self.cpu_ops.set_linear_staging(None);
                self.gpu_ops.set_linear_staging(None);
            }
        }
    }

    /// Upload `data` to both sides.
    pub fn upload<T: bytemuck::Pod>(&self, data: &[T]) -> Buf {
        let buf = self.alloc(std::mem::size_of_val(data));
        self.cpu.upload(buf.cpu, data, S).expect("cpu upload");
        self.gpu.upload(buf.gpu, data, S).expect("gpu upload");
        buf
    }

    /// `bytes` on both sides, filled with 0xFF (NaN in every float format).
    pub fn poisoned(&self, bytes: usize) -> Buf {
        let buf = self.alloc(bytes);
        self.cpu
            .memset(buf.cpu, 0xFF, bytes, S)
            .expect("cpu memset");
        self.gpu
            .memset(buf.gpu, 0xFF, bytes, S)
            .expect("gpu memset");
        buf
    }

    fn alloc(&self, bytes: usize) -> Buf {
        let buf = Buf {
            cpu: self.cpu.alloc(bytes).expect("cpu alloc"),
            gpu: self.gpu.alloc(bytes).expect("gpu alloc"),
            bytes,
        };
        self.live.borrow_mut().push(buf);
        buf
    }

    /// Run one launcher on the CPU, then on CUDA (and wait for it).
    pub fn run(&self, f: impl Fn(&Ops, At<'_>) -> GpuResult<()>) {
        f(&self.cpu_ops, &|b: &Buf| b.cpu).expect("CPU launch");
        f(&self.gpu_ops, &|b: &Buf| b.gpu).expect("CUDA launch");
        self.gpu
            .synchronize(S)
            .expect("CUDA kernel ran without a device error");
    }

    /// Run only on CUDA (and wait).
    pub fn run_gpu(&self, f: impl Fn(&Ops, At<'_>) -> GpuResult<()>) {
        f(&self.gpu_ops, &|b: &Buf| b.gpu).expect("CUDA launch");
        self.gpu
            .synchronize(S)
            .expect("CUDA kernel ran without a device error");
    }

    /// Launch `module::name` directly (bypassing its launcher) with `params(at)` and `cfg`, on
    /// the CPU, then on CUDA (and wait for it).
    pub fn launch<P: KernelParams>(
        &self,
        (module, name): (&str, &str),
        cfg: &LaunchConfig,
        params: impl Fn(At<'_>) -> P,
    ) {
        let (cpu_at, gpu_at) = (|b: &Buf| b.cpu, |b: &Buf| b.gpu);
        let sides: [(&dyn GpuBackend, At<'_>); 2] =
            [(self.cpu.as_ref(), &cpu_at), (self.gpu.as_ref(), &gpu_at)];
        for (gpu, at) in sides {
            let kernel = gpu.kernel(module, name).expect("the kernel resolves");
            let args = [KernelArg::params(&params(at))];
            gpu.launch(kernel, cfg, &args, S).expect("launch");
            gpu.synchronize(S).expect("the kernel ran");
        }
    }

    /// `launch` on CUDA only.
    pub fn launch_gpu<P: KernelParams>(
        &self,
        (module, name): (&str, &str),
        cfg: &LaunchConfig,
        params: &P,
    ) {
        let gpu = self.gpu.as_ref();
        let kernel = gpu.kernel(module, name).expect("the kernel resolves");
        gpu.launch(kernel, cfg, &[KernelArg::params(params)], S)
            .expect("launch");
        gpu.synchronize(S).expect("the kernel ran");
    }

    /// Both sides' contents, `(cuda, cpu)`.
    pub fn download<T: bytemuck::Pod + bytemuck::Zeroable>(&self, buf: &Buf) -> (Vec<T>, Vec<T>) {
        let n = buf.bytes / std::mem::size_of::<T>();
        (
            self.gpu.download(buf.gpu, n, S).expect("gpu download"),
            self.cpu.download(buf.cpu, n, S).expect("cpu download"),
        )
    }

    /// The CUDA side's contents.
    pub fn download_gpu<T: bytemuck::Pod + bytemuck::Zeroable>(&self, buf: &Buf) -> Vec<T> {
        self.gpu
            .download(buf.gpu, buf.bytes / std::mem::size_of::<T>(), S)
            .expect("gpu download")
    }

    /// Compare a bf16 output.
    pub fn check_bf16(&self, kernel: &str, case: &str, buf: &Buf, tol: Tolerance) -> Worst {
        let (g, c) = self.download::<bf16>(buf);
        compare(kernel, case, &widen(&g), &widen(&c), tol)
    }

    /// Compare an f32 output.
    pub fn check_f32(&self, kernel: &str, case: &str, buf: &Buf, tol: Tolerance) -> Worst {
        let (g, c) = self.download::<f32>(buf);
        compare(kernel, case, &g, &c, tol)
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        for b in self.live.borrow_mut().drain(..) {
            let _ = self.cpu.free(b.cpu);
            let _ = self.gpu.free(b.gpu);
        }
    }
}
