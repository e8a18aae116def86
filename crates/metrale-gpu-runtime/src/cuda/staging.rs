//! `Staging`: a ring of page-locked host memory through which small host-to-device copies go, so
//! `copy_h2d` can queue them and return without waiting for the stream (a decode step uploads a
//! handful of small arrays; a synchronize after each left the GPU idle between them).
//!
//! Invariants:
//! - A byte range of the ring is handed out again only after the copy that last read it has
//!   completed (its event, recorded right after the copy, has fired): `reserve` waits for every
//!   older copy that overlaps the new range.
//! - The ring and its events are owned here and freed once, in `release`, with the context
//!   current and the device idle.

use std::collections::VecDeque;
use std::ffi::c_void;

use cudarc::driver::sys;

use super::driver::check;
use crate::error::GpuResult;

/// Bytes of the ring.
pub(super) const STAGING_BYTES: usize = 8 << 20;

/// Largest copy that goes through the ring; larger ones (weights) copy synchronously.
pub(super) const STAGING_MAX_COPY: usize = 1 << 20;

/// One queued copy: the ring range it reads and the event that fires once it has run.
#[derive(Debug)]
struct InFlight {
    start: usize,
    end: usize,
    done: sys::CUevent,
}

/// See the module header.
#[derive(Debug)]
pub(super) struct Staging {
    /// `STAGING_BYTES` of page-locked memory (`cuMemHostAlloc`), or null before first use.
    host: *mut u8,
    /// Where the next range starts.
    head: usize,
    /// Copies that may still be reading the ring, oldest first.
    in_flight: VecDeque<InFlight>,
    /// Events ready for reuse.
    spare: Vec<sys::CUevent>,
}

// SAFETY: `host` is a process-wide allocation only touched under the backend's lock; events are
// driver handles usable from any thread with the context current.
unsafe impl Send for Staging {}

impl Default for Staging {
    fn default() -> Self {
        Staging {
            host: std::ptr::null_mut(),
            head: 0,
            in_flight: VecDeque::new(),
            spare: Vec::new(),
        }
    }
}

impl Staging {
    /// Queue a copy of `src` (at most `STAGING_MAX_COPY` bytes) to `dst` on `stream` through the
    /// ring. The backend's context must be current.
    pub(super) fn copy(
        &mut self,
        dst: sys::CUdeviceptr,
        src: &[u8],
        stream: sys::CUstream,
    ) -> GpuResult<()> {
        debug_assert!(src.len() <= STAGING_MAX_COPY);
        if self.host.is_null() {
            let mut p: *mut c_void = std::ptr::null_mut();
            // SAFETY: the context is current; `p` is a valid out-pointer; freed once in `release`.
            check("cuMemHostAlloc (staging ring)", unsafe {
                sys::cuMemHostAlloc(&mut p, STAGING_BYTES, 0)
            })?;
            self.host = p as *mut u8;
        }
        let len = src.len();
        // 16-byte aligned ranges, wrapping to the start when the end has no room.
        let start = if self.head + len <= STAGING_BYTES {
            self.head
        } else {
            0
        };
        let end = start + len;
        self.retire(start, end)?;
        // SAFETY: `start + len <= STAGING_BYTES`, the ring is `STAGING_BYTES` long, and no queued
        // copy reads this range any more (`retire`); `src` does not overlap pinned memory we own.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.host.add(start), len) };
        // SAFETY: the host range stays untouched until the event below has fired (`retire`);
        // the driver checks `dst` and `stream`.
        check("cuMemcpyHtoDAsync (staged)", unsafe {
            sys::cuMemcpyHtoDAsync_v2(dst, self.host.add(start) as *const c_void, len, stream)
        })?;
        let done = match self.spare.pop() {
            Some(e) => e,
            None => {
                let mut e: sys::CUevent = std::ptr::null_mut();
                // SAFETY: the context is current; `e` is an out-pointer; destroyed in `release`.
                check("cuEventCreate (staging)", unsafe {
                    sys::cuEventCreate(&mut e, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
                })?;
                e
            }
        };
        // SAFETY: both handles are live objects of the current context.
        check("cuEventRecord (staging)", unsafe {
            sys::cuEventRecord(done, stream)
        })?;
        self.in_flight.push_back(InFlight { start, end, done });
        self.head = end.next_multiple_of(16).min(STAGING_BYTES);
        Ok(())
    }

    /// Wait for (and forget) every queued copy reading `[start, end)`, and forget those already
    /// done.
    fn retire(&mut self, start: usize, end: usize) -> GpuResult<()> {
        while let Some(front) = self.in_flight.front() {
            let overlaps = front.start < end && start < front.end;
            if overlaps {
                // SAFETY: a live event of the current context.
                check("cuEventSynchronize (staging)", unsafe {
                    sys::cuEventSynchronize(front.done)
                })?;
            } else {
                // SAFETY: as above.
                let state = unsafe { sys::cuEventQuery(front.done) };
                if state != sys::CUresult::CUDA_SUCCESS {
                    // Not done yet; younger copies are queued behind it on their streams. Any
                    // overlapping younger copy is waited for below.
                    break;
                }
            }
            if let Some(f) = self.in_flight.pop_front() {
                self.spare.push(f.done);
            }
        }
        for f in self.in_flight.iter() {
            if f.start < end && start < f.end {
                // SAFETY: a live event of the current context.
                check("cuEventSynchronize (staging)", unsafe {
                    sys::cuEventSynchronize(f.done)
                })?;
            }
        }
        Ok(())
    }

    /// Free the ring and the events. The context must be current and the device idle.
    pub(super) fn release(&mut self) {
        // SAFETY (whole block): every handle was created here and is destroyed once; the device
        // is idle, so no copy still reads the ring.
        unsafe {
            for f in self.in_flight.drain(..) {
                let _ = sys::cuEventDestroy_v2(f.done);
            }
            for e in self.spare.drain(..) {
                let _ = sys::cuEventDestroy_v2(e);
            }
            if !self.host.is_null() {
                let _ = sys::cuMemFreeHost(self.host as *mut c_void);
                self.host = std::ptr::null_mut();
            }
        }
    }
}
