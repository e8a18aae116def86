//! The CUDA backend's collectives: NCCL (through cudarc's `nccl` bindings, loaded at run time
//! like the driver), one communicator per device of a tensor-parallel group, all made in one
//! process from one `ncclUniqueId` (`ncclCommInitRank` per rank inside one
//! `ncclGroupStart`/`ncclGroupEnd`), each rank's collectives queued on its backend's stream, so
//! a stream capture records them in the step's graph like launches.
//!
//! - `AllReduceSum`: `ncclAllReduce` of f32 into f32 (`ops::all_reduce_sum` rounds a bf16
//!   activation with its own launch). NCCL adds in its ring or tree order, not rank order; the
//!   finished sum is sent unchanged to every rank, so every rank holds the same bits.
//! - `AllGatherCols`: one `ncclAllGather` of `cols` elements per row inside one group call, row
//!   `i` received at `out + i * size * cols`: NCCL places rank `r`'s chunk at `r * cols` of the
//!   receive buffer, so the rows come out interleaved as the LM head's logits need them, with no
//!   scratch buffer and no permutation launch.
//!
//! Invariants:
//! - A collective is queued under the group's read lock; `abort` takes the write lock, so no
//!   communicator is aborted (and freed) while a rank queues work on it, and every collective
//!   after an abort fails at once as `GpuError::CollectiveAborted`. (Queuing returns without
//!   waiting for the other ranks, except while NCCL connects the ranks at a communicator's first
//!   collectives; an abort then waits for that call.) Ranks waiting on the device, in a
//!   synchronize or a copy behind a collective, hold no lock, and the abort releases them.
//! - The communicators are destroyed once, when the last backend of the group is dropped (after
//!   each backend destroyed its graphs, which may hold NCCL resources), or freed by `abort`.
//! - NCCL may make another device current on the calling thread (it sets the communicator's
//!   device); every call that can do so forgets the thread's binding, so the backend's next
//!   driver call makes its own context current again.

use std::ffi::{CStr, c_void};

use cudarc::driver::sys as cu;
use cudarc::nccl::sys;
use parking_lot::RwLock;

use super::driver::forget_binding;
use crate::collective::Collective;
use crate::error::{GpuError, GpuResult};
use crate::types::DType;

/// The names cudarc's loader tries for NCCL, for the error that says it found none.
const LIBRARY_HINT: &str = "libnccl.so (or libnccl.so.1, .9 to .13) on the dynamic loader's path; NCCL \
     packages install libnccl.so.2, so link libnccl.so to it in a directory on LD_LIBRARY_PATH \
     (the nvidia-nccl-cu13 Python wheel keeps it in nvidia/nccl/lib)";

/// The communicators of one group, shared by its backends (rank `r` uses `comms[r]`).
#[derive(Debug)]
pub(super) struct NcclGroup {
    comms: Vec<sys::ncclComm_t>,
    /// Whether the group was aborted; see the module invariants.
    aborted: RwLock<bool>,
}

// SAFETY: NCCL communicators may be used from any thread; each rank's is driven by one thread at
// a time (its backend's caller), and abort and destroy are serialised by `aborted`'s lock and
// by `Drop`.
unsafe impl Send for NcclGroup {}
// SAFETY: as for `Send`: shared access queues work under the read lock or takes the write lock.
unsafe impl Sync for NcclGroup {}

/// NCCL's name and description of a result code, with the communicator's last error when there
/// is one.
fn describe(code: sys::ncclResult_t, comm: Option<sys::ncclComm_t>) -> String {
    // SAFETY: ncclGetErrorString returns a static NUL-terminated string for any code.
    let text = unsafe { CStr::from_ptr(sys::ncclGetErrorString(code)) }.to_string_lossy();
    let last = comm
        // SAFETY: `c` is a live communicator; the string NCCL returns is NUL-terminated and
        // lives until the next NCCL call on this thread, and is copied at once.
        .map(|c| unsafe { CStr::from_ptr(sys::ncclGetLastError(c)) }.to_string_lossy())
        .filter(|s| !s.is_empty())
        .map(|s| format!(": {s}"))
        .unwrap_or_default();
    format!("{code:?} ({text}){last}")
}

/// `Ok` for `ncclSuccess`, else `GpuError::Collective` naming `op`, the NCCL call and the rank.
fn check(
    op: &'static str,
    call: &str,
    rank: (usize, usize),
    code: sys::ncclResult_t,
    comm: Option<sys::ncclComm_t>,
) -> GpuResult<()> {
    if code == sys::ncclResult_t::ncclSuccess {
        return Ok(());
    }
    Err(GpuError::Collective {
        op,
        problem: format!(
            "rank {} of {}: {call} failed: {}",
            rank.0,
            rank.1,
            describe(code, comm)
        ),
    })
}

impl NcclGroup {
    /// One communicator per rank of `size`; `bind(r)` makes rank `r`'s device current on this
    /// thread. Refused with `GpuError::Unavailable` naming the library when NCCL cannot be
    /// loaded.
    pub(super) fn new(size: usize, bind: impl Fn(usize) -> GpuResult<()>) -> GpuResult<NcclGroup> {
        const OP: &str = "communicator_init";
        // SAFETY: only tries to open the library; no NCCL call is made.
        if !unsafe { sys::is_culib_present() } {
            return Err(GpuError::Unavailable(
                "nccl".into(),
                format!(
                    "tensor parallelism on CUDA needs NCCL, which could not be loaded: looked for \
                     {LIBRARY_HINT}"
                ),
            ));
        }
        let ranks = i32::try_from(size).map_err(|_| GpuError::Collective {
            op: OP,
            problem: format!("{size} ranks"),
        })?;
        let mut id = sys::ncclUniqueId { internal: [0; 128] };
        // SAFETY: `id` is an out-parameter of the right type.
        let code = unsafe { sys::ncclGetUniqueId(&mut id) };
        check(OP, "ncclGetUniqueId", (0, size), code, None)?;
        let mut comms: Vec<sys::ncclComm_t> = vec![std::ptr::null_mut(); size];
        // SAFETY: opens a group; closed below on every path.
        let code = unsafe { sys::ncclGroupStart() };
        check(OP, "ncclGroupStart", (0, size), code, None)?;
        let mut first_error = None;
        for (r, comm) in comms.iter_mut().enumerate() {
            if let Err(e) = bind(r) {
                first_error = Some(e);
                break;
            }
            // SAFETY: `comm` is an out-parameter; the id is the group's; `r < ranks`. Inside the
            // group the call records the current device and returns; the ranks join at
            // ncclGroupEnd.
            let code = unsafe { sys::ncclCommInitRank(comm, ranks, id, r as i32) };
            if let Err(e) = check(OP, "ncclCommInitRank", (r, size), code, None) {
                first_error = Some(e);
                break;
            }
        }
        // SAFETY: closes the group opened above.
        let code = unsafe { sys::ncclGroupEnd() };
        forget_binding();
        let ended = check(OP, "ncclGroupEnd", (0, size), code, None);
        let group = NcclGroup {
            comms,
            aborted: RwLock::new(false),
        };
        if let Some(e) = first_error.or(ended.err()) {
            group.abort();
            return Err(e);
        }
        Ok(group)
    }

    /// Ranks in the group.
    pub(super) fn size(&self) -> usize {
        self.comms.len()
    }

    /// Queue `op` for rank `rank` on `stream` (the rank's device current on this thread). The
    /// backend checked the collective's dtypes against the group (`Collective::check`).
    pub(super) fn run(&self, rank: usize, op: &Collective, stream: cu::CUstream) -> GpuResult<()> {
        let name = op.name();
        let aborted = self.aborted.read();
        if *aborted {
            return Err(GpuError::CollectiveAborted { op: name });
        }
        let (comm, size) = (self.comms[rank], self.comms.len());
        let s: sys::cudaStream_t = stream.cast();
        match *op {
            Collective::AllReduceSum {
                out,
                out_dtype,
                input,
                input_dtype,
                elems,
            } => {
                if (input_dtype, out_dtype) != (DType::F32, DType::F32) {
                    return Err(GpuError::Collective {
                        op: name,
                        problem: format!(
                            "{} into {}: NCCL sums f32 into f32 here (`ops::all_reduce_sum` \
                             rounds a bf16 output with `round_bf16`)",
                            input_dtype.name(),
                            out_dtype.name()
                        ),
                    });
                }
                if elems == 0 {
                    return Ok(());
                }
                // SAFETY: both buffers are device memory of `elems` f32 the caller's operands
                // describe (in place when equal, which NCCL allows); `comm` is live (not aborted,
                // under the read lock); `s` is a live stream of the communicator's device.
                let code = unsafe {
                    sys::ncclAllReduce(
                        input.0 as *const c_void,
                        out.0 as *mut c_void,
                        elems,
                        sys::ncclDataType_t::ncclFloat32,
                        sys::ncclRedOp_t::ncclSum,
                        comm,
                        s,
                    )
                };
                check(name, "ncclAllReduce", (rank, size), code, Some(comm))
            }
            Collective::AllGatherCols {
                out,
                input,
                rows,
                cols,
            } => {
                if rows == 0 || cols == 0 {
                    return Ok(());
                }
                // SAFETY: opens a group; closed below on every path.
                let code = unsafe { sys::ncclGroupStart() };
                check(name, "ncclGroupStart", (rank, size), code, Some(comm))?;
                let mut queued = Ok(());
                for row in 0..rows {
                    let send = input.0 + (row * cols * 4) as u64;
                    let recv = out.0 + (row * size * cols * 4) as u64;
                    // SAFETY: `input` holds `rows * cols` f32 and `out` `rows * size * cols`, so
                    // row `row`'s `cols` elements and its `size * cols` receive window lie inside
                    // them; `comm` and `s` as for the all-reduce.
                    let code = unsafe {
                        sys::ncclAllGather(
                            send as *const c_void,
                            recv as *mut c_void,
                            cols,
                            sys::ncclDataType_t::ncclFloat32,
                            comm,
                            s,
                        )
                    };
                    queued = check(name, "ncclAllGather", (rank, size), code, Some(comm));
                    if queued.is_err() {
                        break;
                    }
                }
                // SAFETY: closes the group opened above.
                let code = unsafe { sys::ncclGroupEnd() };
                queued.and(check(name, "ncclGroupEnd", (rank, size), code, Some(comm)))
            }
        }
    }

    /// Abort every communicator of the group (once): NCCL kernels waiting for a rank that left
    /// return, and every later collective fails at once.
    pub(super) fn abort(&self) {
        let mut aborted = self.aborted.write();
        if *aborted {
            return;
        }
        *aborted = true;
        for &c in self.comms.iter().filter(|c| !c.is_null()) {
            // SAFETY: `c` is a communicator made by ncclCommInitRank, aborted once (the flag is
            // set under the write lock); no rank queues work on it now (the read lock is not
            // held). Aborting frees it.
            let _ = unsafe { sys::ncclCommAbort(c) };
        }
        forget_binding();
    }
}

impl Drop for NcclGroup {
    fn drop(&mut self) {
        if *self.aborted.get_mut() {
            return;
        }
        for &c in self.comms.iter().filter(|c| !c.is_null()) {
            // SAFETY: `c` is live (never aborted) and destroyed once; every backend of the group
            // has been dropped, each after waiting for its device's work and destroying its
            // graphs.
            let _ = unsafe { sys::ncclCommDestroy(c) };
        }
        forget_binding();
    }
}
