//! The device fault word: one `u32` of device memory the backend owns, whose address every
//! loaded module holds in its `mt_fault_word` (kernels/abi.cuh). A kernel that refuses its
//! launch writes its fault code there (the first since the last read wins); the backend reads
//! it back as `GpuError::KernelFault`.
//!
//! Invariants:
//! - The word is allocated before any module is loaded and freed after every module is
//!   unloaded, so no module holds a dangling address.
//! - The backend reads it only after waiting for the work that may write it.

use std::ffi::{CString, c_void};

use cudarc::driver::sys;
use metrale_kernel_abi::{FAULT_WORD_SYMBOL, decode_fault};

use super::driver::check;
use crate::error::{GpuError, GpuResult};

/// The fault word's device address.
#[derive(Debug)]
pub(super) struct FaultWord {
    ptr: sys::CUdeviceptr,
}

impl FaultWord {
    /// No word yet: modules loaded meanwhile get a null pointer and report nothing.
    pub fn unallocated() -> FaultWord {
        FaultWord { ptr: 0 }
    }

    /// Allocate the word, zeroed. The backend's context must be current.
    pub fn new() -> GpuResult<FaultWord> {
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: the context is current; `ptr` is an out-pointer; 4 bytes are asked for.
        check("cuMemAlloc (fault word)", unsafe {
            sys::cuMemAlloc_v2(&mut ptr, 4)
        })?;
        let word = FaultWord { ptr };
        word.write(0)?;
        Ok(word)
    }

    fn write(&self, value: u32) -> GpuResult<()> {
        // SAFETY: `self.ptr` is a live 4-byte allocation; the source is a local `u32` that
        // outlives the call, which returns once the copy is done (pageable host memory).
        check("cuMemcpyHtoD (fault word)", unsafe {
            sys::cuMemcpyHtoD_v2(self.ptr, &value as *const u32 as *const c_void, 4)
        })
    }

    /// Point `module`'s `mt_fault_word` at the word (a module without one is left alone).
    pub fn attach(&self, module: sys::CUmodule, label: &str) -> GpuResult<()> {
        let name = CString::new(FAULT_WORD_SYMBOL).map_err(|_| GpuError::Driver {
            op: "fault word".into(),
            message: "the symbol name holds a NUL byte".into(),
        })?;
        let (mut global, mut bytes): (sys::CUdeviceptr, usize) = (0, 0);
        // SAFETY: `module` is a loaded module; `name` is NUL-terminated; both out-pointers are
        // valid.
        let code =
            unsafe { sys::cuModuleGetGlobal_v2(&mut global, &mut bytes, module, name.as_ptr()) };
        if code == sys::CUresult::CUDA_ERROR_NOT_FOUND {
            return Ok(());
        }
        check(
            &format!("cuModuleGetGlobal({label}::{FAULT_WORD_SYMBOL})"),
            code,
        )?;
        if bytes != 8 {
            return Err(GpuError::Driver {
                op: format!("{label}::{FAULT_WORD_SYMBOL}"),
                message: format!("the pointer is {bytes} bytes, not 8"),
            });
        }
        let address: u64 = self.ptr;
        // SAFETY: `global` is the module's 8-byte variable; the source is a local `u64` that
        // outlives the call, which returns once the copy is done.
        check("cuMemcpyHtoD (fault word address)", unsafe {
            sys::cuMemcpyHtoD_v2(global, &address as *const u64 as *const c_void, 8)
        })
    }

    /// The word's code, cleared if it was set. The caller has waited for the kernels it asks
    /// about.
    pub fn take(&self) -> GpuResult<u32> {
        let mut code = 0u32;
        // SAFETY: `self.ptr` is a live 4-byte allocation; `code` outlives the call, which
        // returns once the copy is done.
        check("cuMemcpyDtoH (fault word)", unsafe {
            sys::cuMemcpyDtoH_v2(&mut code as *mut u32 as *mut c_void, self.ptr, 4)
        })?;
        if code != 0 {
            self.write(0)?;
        }
        Ok(code)
    }

    /// Free the word (at drop, after every module is unloaded).
    pub fn release(&mut self) {
        if self.ptr != 0 {
            // SAFETY: allocated in `new`, freed once (the address is cleared).
            let _ = unsafe { sys::cuMemFree_v2(self.ptr) };
            self.ptr = 0;
        }
    }
}

/// `Err(KernelFault)` for a non-zero fault code, naming the manifest's kernel and reason.
pub(super) fn fault_result(code: u32) -> GpuResult<()> {
    if code == 0 {
        return Ok(());
    }
    Err(match decode_fault(code) {
        Some((kernel, reason)) => GpuError::KernelFault {
            kernel: kernel.label(),
            reason,
        },
        None => GpuError::Driver {
            op: "reading the kernel fault word".into(),
            message: format!("code {code:#x} names no kernel of this build's manifest"),
        },
    })
}
