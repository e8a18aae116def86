//! The launchers of the collectives of tensor parallelism (`GpuBackend::collective`), an
//! `impl Ops` block beside the kernel launchers: the all-reduce after each row-parallel
//! projection (f32 sums, rounded to bf16 by `round_bf16` where the activation is bf16) and the
//! all-gather of the vocabulary-parallel LM head's logits. A collective is not a kernel of the
//! manifest: the backend runs it (NCCL on CUDA, the communicator's barrier on the CPU), and a
//! captured step replays it like a launch.
//!
//! Invariant: every rank of a group launches the same collectives in the same order, so a
//! launcher's checks depend only on shapes, which every rank shares.

use metrale_gpu_runtime::{Collective, DType, GpuError, GpuResult, StreamHandle, TpRank};

use crate::ops::{Matrix, Ops};

fn bad(op: &'static str, operand: &'static str, problem: String) -> GpuError {
    GpuError::BadOperand {
        kernel: op.into(),
        operand,
        problem,
    }
}

impl Ops {
    /// The rank the backend drives in its tensor-parallel group.
    pub fn tp_rank(&self) -> TpRank {
        self.gpu.tp_rank()
    }

    /// `out = Σ_rank partial` over the group, summed in f32 and written as `out`'s dtype on
    /// every rank: the output of a row-parallel projection. `partial` is f32; `out` is f32
    /// (`partial` itself for a sum in place) or bf16. A bf16 `out` is the collective summing
    /// `partial` in place, then `round_bf16` into `out`, so the sum is rounded once and
    /// `partial` holds the f32 sums afterwards. The collective is always f32 into f32 (what
    /// NCCL's all-reduce sums on CUDA), so every backend runs these same launches.
    pub fn all_reduce_sum(&self, s: StreamHandle, out: Matrix, partial: Matrix) -> GpuResult<()> {
        const OP: &str = "collective::all_reduce_sum";
        if partial.dtype != DType::F32 {
            return Err(bad(
                OP,
                "partial",
                format!("{} (f32 only)", partial.dtype.name()),
            ));
        }
        if !matches!(out.dtype, DType::F32 | DType::Bf16) {
            return Err(bad(
                OP,
                "out",
                format!("{} (f32 or bf16)", out.dtype.name()),
            ));
        }
        if out.shape() != partial.shape() {
            return Err(bad(
                OP,
                "out",
                format!(
                    "{:?}, the partial sums are {:?}",
                    out.shape(),
                    partial.shape()
                ),
            ));
        }
        if out.ptr == partial.ptr && out.dtype != partial.dtype {
            return Err(bad(OP, "out", "in place with another dtype".into()));
        }
        let sum = if out.dtype == DType::F32 {
            out
        } else {
            partial
        };
        let op = Collective::AllReduceSum {
            out: sum.ptr,
            out_dtype: DType::F32,
            input: partial.ptr,
            input_dtype: DType::F32,
            elems: out.rows as usize * out.cols as usize,
        };
        self.gpu.collective(&op, s)?;
        if out.dtype == DType::Bf16 {
            self.round_bf16(s, out, partial)?;
        }
        Ok(())
    }

    /// f32 `out[rows, N * cols]` on every rank: rank `r`'s f32 `local[rows, cols]` in columns
    /// `r * cols ..` of each row (the vocabulary-parallel LM head's logits, each rank a slice
    /// of the vocabulary).
    pub fn all_gather_cols(&self, s: StreamHandle, out: Matrix, local: Matrix) -> GpuResult<()> {
        const OP: &str = "collective::all_gather_cols";
        let n = self.tp_rank().size as u32;
        for (name, m) in [("out", &out), ("local", &local)] {
            if m.dtype != DType::F32 {
                return Err(bad(OP, name, format!("{} (f32 only)", m.dtype.name())));
            }
        }
        if out.rows != local.rows || out.cols != local.cols * n {
            return Err(bad(
                OP,
                "out",
                format!(
                    "{:?}, the gather of {n} ranks of {:?} is [{}, {}]",
                    out.shape(),
                    local.shape(),
                    local.rows,
                    local.cols * n
                ),
            ));
        }
        let op = Collective::AllGatherCols {
            out: out.ptr,
            input: local.ptr,
            rows: local.rows as usize,
            cols: local.cols as usize,
        };
        self.gpu.collective(&op, s)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use half::bf16;
    use metrale_gpu_runtime::{CpuBackend, GpuBackend, GpuBackendExt};
    use metrale_testkit::Rng;

    use super::*;

    /// A bf16 all-reduce over 2 CPU ranks: every rank's `out` is the f32 sum of the partials
    /// rounded once (not the sum of rounded partials), and `partial` holds the f32 sum.
    #[test]
    fn a_bf16_all_reduce_rounds_the_f32_sum_once_and_leaves_it_in_partial() {
        let (rows, cols) = (3u32, 37u32);
        let n = (rows * cols) as usize;
        let mut rng = Rng::new(5);
        let partials: Vec<Vec<f32>> = (0..2).map(|_| rng.f32s(n, -2.0, 2.0)).collect();
        let sums: Vec<f32> = (0..n).map(|i| partials[0][i] + partials[1][i]).collect();
        let group: Vec<Arc<dyn GpuBackend>> =
            (CpuBackend::tensor_parallel_group(2, Default::default()).into_iter())
                .map(|b| Arc::new(b) as _)
                .collect();
        let results: Vec<(Vec<bf16>, Vec<f32>)> = std::thread::scope(|sc| {
            let handles: Vec<_> = (group.iter().zip(&partials))
                .map(|(gpu, mine)| {
                    sc.spawn(move || {
                        let ops = Ops::new(gpu.clone()).unwrap();
                        let s = gpu.default_stream();
                        let partial = gpu.alloc_upload(mine, s).unwrap();
                        let out = gpu.alloc(n * 2).unwrap();
                        let (o, p) = (
                            Matrix::bf16(out, rows, cols),
                            Matrix::f32(partial, rows, cols),
                        );
                        ops.all_reduce_sum(s, o, p).unwrap();
                        // A bf16 partial is refused before anything runs.
                        let e = ops.all_reduce_sum(s, o, Matrix::bf16(out, rows, cols));
                        assert!(e.unwrap_err().to_string().contains("f32 only"));
                        (
                            gpu.download::<bf16>(out, n, s).unwrap(),
                            gpu.download::<f32>(partial, n, s).unwrap(),
                        )
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let rounded: Vec<bf16> = sums.iter().map(|&v| bf16::from_f32(v)).collect();
        for (out, partial) in &results {
            assert!(out == &rounded, "out is not the sum rounded once");
            assert!(partial == &sums, "partial does not hold the f32 sums");
        }
        // Rounding each partial first gives other bits somewhere: the check above can fail.
        let twice: Vec<bf16> = (0..n)
            .map(|i| {
                let r = |v: f32| bf16::from_f32(v).to_f32();
                bf16::from_f32(r(partials[0][i]) + r(partials[1][i]))
            })
            .collect();
        assert!(twice != rounded);
    }
}
