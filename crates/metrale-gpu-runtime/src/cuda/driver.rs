//! Thin helpers over the CUDA driver API (through cudarc's `sys` layer, loaded dynamically):
//! turning a `CUresult` into a `GpuError`, and binding the backend's context to the calling
//! thread.
//!
//! Invariants:
//! - Every driver call of the backend goes through [`check`], so a failure always names the
//!   operation and the driver's own message.
//! - [`bind`] is called before any driver call that needs a current context; it is cheap when the
//!   context is already current on this thread.

use std::cell::Cell;

use cudarc::driver::sys;

use crate::error::{GpuError, GpuResult};

/// The driver's name and description of an error code, e.g. `CUDA_ERROR_INVALID_VALUE (invalid
/// argument)`.
pub(super) fn describe(code: sys::CUresult) -> String {
    let err = cudarc::driver::DriverError(code);
    let name = err
        .error_name()
        .map(|c| c.to_string_lossy().into_owned())
        .unwrap_or_else(|_| format!("{code:?}"));
    let text = err
        .error_string()
        .map(|c| c.to_string_lossy().into_owned())
        .unwrap_or_default();
    if text.is_empty() {
        name
    } else {
        format!("{name} ({text})")
    }
}

/// `Ok` for `CUDA_SUCCESS`, else a `GpuError::Driver` naming `op`.
pub(super) fn check(op: &str, code: sys::CUresult) -> GpuResult<()> {
    if code == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(GpuError::Driver {
            op: op.to_string(),
            message: describe(code),
        })
    }
}

thread_local! {
    /// The backend instance (see [`next_instance_id`]) whose context this thread last made
    /// current through [`bind`]; 0 for none.
    static BOUND: Cell<u64> = const { Cell::new(0) };
}

/// A process-unique id for a backend instance, never 0. The binding cache is keyed on it rather
/// than on the context's address, which the driver may reuse after a context is destroyed.
pub(super) fn next_instance_id() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// Make `ctx`, the context of backend instance `instance`, current on the calling thread (the
/// driver keeps one current context per thread).
pub(super) fn bind(instance: u64, ctx: sys::CUcontext) -> GpuResult<()> {
    if BOUND.with(|b| b.get()) == instance {
        return Ok(());
    }
    // SAFETY: `ctx` is the primary context the backend retained in `new` and releases only in
    // `Drop`, so it is live for as long as the backend can be called.
    check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(ctx) })?;
    BOUND.with(|b| b.set(instance));
    Ok(())
}

/// Forget which context this thread has current: a library call (NCCL's) may have made another
/// one current, so the next [`bind`] sets the backend's own again.
pub(super) fn forget_binding() {
    BOUND.with(|b| b.set(0));
}
