//! cuBLASLt's bf16 and e4m3 GEMMs, loaded dynamically, for one purpose: the benchmark's
//! GEMM-rate ceilings (what the vendor library reaches on this device). The engine never
//! computes with it: its algorithm, and so its rounding, changes with the shape, which would
//! break batch invariance.
//!
//! Invariants:
//! - The handle, the workspace and every plan's descriptors are created here once and destroyed
//!   once, in `release`, with the backend's context current and the device idle.

use std::collections::HashMap;
use std::ffi::c_void;

use cudarc::cublaslt::sys as lt;
use cudarc::driver::sys;

use super::driver::check;
use crate::backend::VendorGemm;
use crate::error::{GpuError, GpuResult};
use crate::types::DType;

/// Workspace bytes offered to cuBLASLt.
const WORKSPACE_BYTES: usize = 32 << 20;

/// `CUBLAS_OP_T` (cuBLAS's `cublasOperation_t`).
const OP_T: i32 = 1;

fn lt_check(op: &str, status: lt::cublasStatus_t) -> GpuResult<()> {
    if status == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(GpuError::Driver {
            op: op.to_string(),
            message: format!("cuBLASLt returned {status:?}"),
        })
    }
}

/// The descriptors and chosen algorithm of one shape.
#[derive(Debug)]
struct Plan {
    desc: lt::cublasLtMatmulDesc_t,
    layouts: [lt::cublasLtMatrixLayout_t; 3],
    algo: lt::cublasLtMatmulAlgo_t,
}

/// A cuBLASLt handle, its workspace and the plans made so far.
#[derive(Debug)]
pub(super) struct Blaslt {
    handle: lt::cublasLtHandle_t,
    workspace: sys::CUdeviceptr,
    plans: HashMap<(u32, u32, u32, DType), Plan>,
}

// SAFETY: the handles are process-wide library objects, used only under the backend's lock with
// its context current.
unsafe impl Send for Blaslt {}

impl Blaslt {
    /// Load the library and create a handle and workspace; `None` when libcublasLt is absent.
    /// The context must be current.
    pub(super) fn new() -> GpuResult<Option<Blaslt>> {
        // SAFETY: only tries to open the library.
        if !unsafe { lt::is_culib_present() } {
            return Ok(None);
        }
        let mut handle: lt::cublasLtHandle_t = std::ptr::null_mut();
        // SAFETY: `handle` is an out-pointer; destroyed in `release`.
        lt_check("cublasLtCreate", unsafe { lt::cublasLtCreate(&mut handle) })?;
        let mut workspace: sys::CUdeviceptr = 0;
        // SAFETY: the context is current; `workspace` is an out-pointer; freed in `release`.
        if let Err(e) = check("cuMemAlloc (cuBLASLt workspace)", unsafe {
            sys::cuMemAlloc_v2(&mut workspace, WORKSPACE_BYTES)
        }) {
            // SAFETY: created above, destroyed once.
            let _ = unsafe { lt::cublasLtDestroy(handle) };
            return Err(e);
        }
        Ok(Some(Blaslt {
            handle,
            workspace,
            plans: HashMap::new(),
        }))
    }

    /// Queue `g` on `stream`.
    pub(super) fn gemm(&mut self, g: &VendorGemm, stream: sys::CUstream) -> GpuResult<()> {
        let key = (g.m, g.n, g.k, g.inputs);
        if !self.plans.contains_key(&key) {
            let plan = self.plan(g)?;
            self.plans.insert(key, plan);
        }
        let plan = &self.plans[&key];
        let (alpha, beta) = (1.0f32, 0.0f32);
        // Row-major out[m, n] = x[m, k] · w[n, k]ᵀ is column-major outᵀ[n, m] = op_T(w)[n, k] ·
        // xᵀ[k, m]: A = w (k x n, transposed), B = x (k x m), C = D = out (n x m).
        // SAFETY: the plan's descriptors describe exactly these buffers' shapes (the caller
        // guarantees their sizes); alpha and beta outlive the call; the workspace is ours.
        lt_check("cublasLtMatmul", unsafe {
            lt::cublasLtMatmul(
                self.handle,
                plan.desc,
                &alpha as *const f32 as *const c_void,
                g.w.0 as *const c_void,
                plan.layouts[0],
                g.x.0 as *const c_void,
                plan.layouts[1],
                &beta as *const f32 as *const c_void,
                g.out.0 as *const c_void,
                plan.layouts[2],
                g.out.0 as *mut c_void,
                plan.layouts[2],
                &plan.algo,
                self.workspace as *mut c_void,
                WORKSPACE_BYTES,
                stream as lt::cudaStream_t,
            )
        })
    }

    fn plan(&self, g: &VendorGemm) -> GpuResult<Plan> {
        let mut desc: lt::cublasLtMatmulDesc_t = std::ptr::null_mut();
        // SAFETY: out-pointer; the descriptor is destroyed with the plan.
        lt_check("cublasLtMatmulDescCreate", unsafe {
            lt::cublasLtMatmulDescCreate(
                &mut desc,
                lt::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                lt::cudaDataType_t::CUDA_R_32F,
            )
        })?;
        let mut plan = Plan {
            desc,
            layouts: [std::ptr::null_mut(); 3],
            // SAFETY: all-zero is a valid bit pattern of this plain C struct.
            algo: unsafe { std::mem::zeroed() },
        };
        match self.fill_plan(&mut plan, g) {
            Ok(()) => Ok(plan),
            Err(e) => {
                destroy_plan(&plan);
                Err(e)
            }
        }
    }

    fn fill_plan(&self, plan: &mut Plan, g: &VendorGemm) -> GpuResult<()> {
        let (m, n, k) = (u64::from(g.m), u64::from(g.n), u64::from(g.k));
        // e4m3 inputs need A transposed and B not ("TN", both k-major, as ours are), a bf16 C
        // and D here, and take the fast accumulation: the rate the library's FP8 reaches.
        let inputs = match g.inputs {
            DType::Bf16 => lt::cudaDataType_t::CUDA_R_16BF,
            DType::F8E4M3 => {
                let fast: i8 = 1;
                // SAFETY: `plan.desc` is live; the buffer is an i8 of the size passed.
                lt_check("cublasLtMatmulDescSetAttribute(FAST_ACCUM)", unsafe {
                    lt::cublasLtMatmulDescSetAttribute(
                        plan.desc,
                        lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_FAST_ACCUM,
                        &fast as *const i8 as *const c_void,
                        std::mem::size_of::<i8>(),
                    )
                })?;
                lt::cudaDataType_t::CUDA_R_8F_E4M3
            }
            other => {
                return Err(GpuError::Driver {
                    op: "cublasLtMatmul".into(),
                    message: format!("no vendor GEMM of {} inputs", other.name()),
                });
            }
        };
        // SAFETY: `plan.desc` is live; the buffer is an i32 of the size passed.
        lt_check("cublasLtMatmulDescSetAttribute(TRANSA)", unsafe {
            lt::cublasLtMatmulDescSetAttribute(
                plan.desc,
                lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                &OP_T as *const i32 as *const c_void,
                std::mem::size_of::<i32>(),
            )
        })?;
        let shapes = [
            (inputs, k, n),
            (inputs, k, m),
            (lt::cudaDataType_t::CUDA_R_16BF, n, m),
        ];
        for (slot, (ty, rows, cols)) in plan.layouts.iter_mut().zip(shapes) {
            // SAFETY: out-pointer; destroyed with the plan.
            lt_check("cublasLtMatrixLayoutCreate", unsafe {
                lt::cublasLtMatrixLayoutCreate(slot, ty, rows, cols, rows as i64)
            })?;
        }
        let mut pref: lt::cublasLtMatmulPreference_t = std::ptr::null_mut();
        // SAFETY: out-pointer; destroyed below.
        lt_check("cublasLtMatmulPreferenceCreate", unsafe {
            lt::cublasLtMatmulPreferenceCreate(&mut pref)
        })?;
        let ws = WORKSPACE_BYTES as u64;
        // SAFETY: `pref` is live; the buffer is a u64 of the size passed.
        let set = lt_check("cublasLtMatmulPreferenceSetAttribute", unsafe {
            lt::cublasLtMatmulPreferenceSetAttribute(
                pref,
                lt::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &ws as *const u64 as *const c_void,
                std::mem::size_of::<u64>(),
            )
        });
        // SAFETY: all-zero is a valid bit pattern of this plain C struct.
        let mut result: lt::cublasLtMatmulHeuristicResult_t = unsafe { std::mem::zeroed() };
        let mut returned = 0i32;
        let heuristic = set.and_then(|()| {
            // SAFETY: every descriptor is live; `result` holds one entry and `returned` is an
            // out-pointer.
            lt_check("cublasLtMatmulAlgoGetHeuristic", unsafe {
                lt::cublasLtMatmulAlgoGetHeuristic(
                    self.handle,
                    plan.desc,
                    plan.layouts[0],
                    plan.layouts[1],
                    plan.layouts[2],
                    plan.layouts[2],
                    pref,
                    1,
                    &mut result,
                    &mut returned,
                )
            })
        });
        // SAFETY: created above, destroyed once.
        let _ = unsafe { lt::cublasLtMatmulPreferenceDestroy(pref) };
        heuristic?;
        if returned < 1 {
            return Err(GpuError::Driver {
                op: "cublasLtMatmulAlgoGetHeuristic".into(),
                message: format!(
                    "no algorithm for a GEMM of {} inputs, m={m} n={n} k={k}",
                    g.inputs.name()
                ),
            });
        }
        plan.algo = result.algo;
        Ok(())
    }

    /// Destroy the plans and the handle and free the workspace. The context must be current and
    /// the device idle.
    pub(super) fn release(&mut self) {
        for (_, plan) in self.plans.drain() {
            destroy_plan(&plan);
        }
        // SAFETY: created in `new`, destroyed once; the device is idle.
        unsafe {
            let _ = lt::cublasLtDestroy(self.handle);
            let _ = sys::cuMemFree_v2(self.workspace);
        }
    }
}

fn destroy_plan(plan: &Plan) {
    // SAFETY: the descriptors were created by `Blaslt::plan` (null ones were never made) and are
    // destroyed once (the plan is dropped right after).
    unsafe {
        for l in plan.layouts {
            if !l.is_null() {
                let _ = lt::cublasLtMatrixLayoutDestroy(l);
            }
        }
        let _ = lt::cublasLtMatmulDescDestroy(plan.desc);
    }
}
