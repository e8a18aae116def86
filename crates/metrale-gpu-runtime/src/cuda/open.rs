//! Opening and closing a `CudaBackend`: the driver loaded and initialised, the device's primary
//! context retained, the default stream and the fault word made (and, for a tensor-parallel
//! group, one backend per device sharing NCCL communicators); and, on drop, every handle
//! destroyed once.

use std::sync::Arc;

use parking_lot::{Mutex, RwLock};

use cudarc::driver::sys;

use super::driver::{self, bind, check};
use super::faults::FaultWord;
use super::modules::{KernelTable, ModuleSource};
use super::nccl::NcclGroup;
use super::staging::Staging;
use super::{CudaBackend, CudaBackendOptions, Handles, new_stream};
use crate::error::{GpuError, GpuResult};

impl CudaBackend {
    /// Open GPU `device_ordinal` with the default options.
    pub fn new(device_ordinal: usize) -> GpuResult<CudaBackend> {
        CudaBackend::with_options(device_ordinal, CudaBackendOptions::default())
    }

    /// Open GPU `device_ordinal`: retain its primary context, create the default stream and the
    /// fault word. `GpuError::Unavailable` when the driver library cannot be loaded or there is
    /// no such GPU.
    pub fn with_options(
        device_ordinal: usize,
        options: CudaBackendOptions,
    ) -> GpuResult<CudaBackend> {
        let count = CudaBackend::device_count()?;
        if device_ordinal >= count {
            return Err(GpuError::Unavailable(
                "cuda".into(),
                format!("GPU {device_ordinal} asked for, but the driver sees {count} GPU(s)"),
            ));
        }
        let mut device: sys::CUdevice = 0;
        // SAFETY: the ordinal was checked against the device count; `device` is an out-pointer.
        check("cuDeviceGet", unsafe {
            sys::cuDeviceGet(&mut device, device_ordinal as i32)
        })?;
        let mut name = [0 as std::ffi::c_char; 256];
        // SAFETY: `name` holds 256 bytes and the driver writes at most `len` of them, NUL included.
        check("cuDeviceGetName", unsafe {
            sys::cuDeviceGetName(name.as_mut_ptr(), name.len() as i32, device)
        })?;
        // SAFETY: the driver NUL-terminated the name inside the buffer.
        let device_name = unsafe { std::ffi::CStr::from_ptr(name.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: `device` is valid; `ctx` is an out-pointer; released once in `Drop`.
        check("cuDevicePrimaryCtxRetain", unsafe {
            sys::cuDevicePrimaryCtxRetain(&mut ctx, device)
        })?;
        let instance = driver::next_instance_id();
        let mut backend = CudaBackend {
            instance,
            ordinal: device_ordinal,
            device,
            device_name,
            ctx,
            default_stream: std::ptr::null_mut(),
            max_dynamic_smem: 48 << 10,
            handles: Mutex::new(Handles {
                next_stream: 1,
                next_event: 1,
                next_graph: 1,
                ..Default::default()
            }),
            kernels: RwLock::new(KernelTable::default()),
            staging: Mutex::new(Staging::default()),
            blaslt: Mutex::new(None),
            faults: FaultWord::unallocated(),
            options,
            group: None,
        };
        // From here `Drop` releases the context (and destroys the stream once made).
        bind(instance, ctx)?;
        backend.default_stream = new_stream()?;
        backend.faults = FaultWord::new()?;
        let mut smem = 0i32;
        // SAFETY: `device` is valid; `smem` is an out-pointer.
        check("cuDeviceGetAttribute", unsafe {
            sys::cuDeviceGetAttribute(
                &mut smem,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                device,
            )
        })?;
        backend.max_dynamic_smem = smem;
        tracing::debug!(ordinal = device_ordinal, name = %backend.device_name, "CUDA backend ready");
        Ok(backend)
    }

    /// The backends of one tensor-parallel group, rank `r` on GPU `devices[r]` at index `r`
    /// (each with `options`), sharing NCCL communicators made from one `ncclUniqueId`. Each is
    /// driven by its own thread: a collective's kernel waits on the device for every rank's.
    /// One device gives a group of one rank, whose collectives run through NCCL too.
    ///
    /// Refused with `GpuError::Unavailable` when the driver sees fewer GPUs than `devices`
    /// names or NCCL cannot be loaded (the error names the library and how to make it
    /// findable), and with `GpuError::Collective` when `devices` is empty or names a GPU twice
    /// or NCCL fails to make the communicators.
    pub fn tensor_parallel_group(
        devices: &[usize],
        options: CudaBackendOptions,
    ) -> GpuResult<Vec<CudaBackend>> {
        let refuse = |problem: String| {
            Err(GpuError::Collective {
                op: "communicator_init",
                problem,
            })
        };
        if devices.is_empty() {
            return refuse("a tensor-parallel group of no GPUs".into());
        }
        if let Some((i, d)) = (devices.iter().enumerate()).find(|(i, d)| devices[..*i].contains(d))
        {
            return refuse(format!(
                "GPU {d} is named twice (rank {i} and an earlier one): one rank a device"
            ));
        }
        let count = CudaBackend::device_count()?;
        if let Some(&d) = devices.iter().find(|&&d| d >= count) {
            return Err(GpuError::Unavailable(
                "cuda".into(),
                format!(
                    "a tensor-parallel group of {} ranks on GPUs {devices:?} needs GPU {d}, but \
                     the driver sees {count} GPU(s)",
                    devices.len()
                ),
            ));
        }
        let mut backends = (devices.iter())
            .map(|&d| CudaBackend::with_options(d, options.clone()))
            .collect::<GpuResult<Vec<_>>>()?;
        let group = Arc::new(NcclGroup::new(backends.len(), |r| backends[r].bind())?);
        for (rank, b) in backends.iter_mut().enumerate() {
            b.group = Some((rank, group.clone()));
        }
        Ok(backends)
    }

    /// The GPUs the driver sees, after loading and initialising it. `GpuError::Unavailable`
    /// when the driver library cannot be loaded.
    pub fn device_count() -> GpuResult<usize> {
        // SAFETY: only tries to open the driver library; no driver call is made.
        if !unsafe { sys::is_culib_present() } {
            return Err(GpuError::Unavailable(
                "cuda".into(),
                "the CUDA driver library (libcuda.so) could not be loaded; is the NVIDIA driver installed and on LD_LIBRARY_PATH?".into(),
            ));
        }
        // SAFETY: cuInit may be called any number of times, from any thread.
        check("cuInit", unsafe { sys::cuInit(0) })?;
        let mut count = 0i32;
        // SAFETY: `count` is a valid out-pointer.
        check("cuDeviceGetCount", unsafe {
            sys::cuDeviceGetCount(&mut count)
        })?;
        Ok(count.max(0) as usize)
    }

    /// The GPU's ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The GPU's name as the driver reports it.
    pub fn device_name(&self) -> &str {
        &self.device_name
    }

    /// The modules loaded so far and whether each came from its cubin or its PTX.
    pub fn loaded_modules(&self) -> Vec<(String, ModuleSource)> {
        self.kernels.read().sources()
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        if self.bind().is_err() {
            return;
        }
        // Errors are ignored from here on: there is nobody left to report them to.
        // SAFETY: the context is current; waits for all queued work before anything is freed.
        let _ = unsafe { sys::cuCtxSynchronize() };
        let h = std::mem::take(self.handles.get_mut());
        // SAFETY (whole block): every handle below was created by this backend, is listed once,
        // and is destroyed once; the device is idle (synchronised above).
        unsafe {
            for (_, (g, exec)) in h.graphs {
                let _ = sys::cuGraphExecDestroy(exec);
                let _ = sys::cuGraphDestroy(g);
            }
            for (_, e) in h.events {
                let _ = sys::cuEventDestroy_v2(e);
            }
            for (_, s) in h.streams {
                let _ = sys::cuStreamDestroy_v2(s);
            }
            if !self.default_stream.is_null() {
                let _ = sys::cuStreamDestroy_v2(self.default_stream);
            }
            for (p, _) in h.allocations {
                let _ = sys::cuMemFree_v2(p);
            }
        }
        self.staging.get_mut().release();
        if let Some(Some(lt)) = self.blaslt.get_mut() {
            lt.release();
        }
        self.kernels.get_mut().unload_all();
        self.faults.release();
        // The last backend of a group destroys its communicators, with this context still
        // retained and every graph gone.
        drop(self.group.take());
        // SAFETY: retained once in `new`, released once here; nothing of the context is used
        // after this.
        let _ = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.device) };
    }
}
