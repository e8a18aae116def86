//! The CUDA backend's collectives through NCCL on a group of one rank (GPU 0), through the same
//! launchers the layers call: the all-reduce of one addend is that addend (out of place and in
//! place), its bf16 output is `round_bf16` of it, bit for bit the CPU group of one's, and the
//! gather of one rank is its input; the same launches captured in a graph and replayed with new
//! inputs give the new inputs' results. Also the refusals: an aborted group, a backend alone,
//! a GPU named twice and one the driver does not see.

use std::sync::Arc;

use half::bf16;
use metrale_gpu_runtime::cuda::{CudaBackend, CudaBackendOptions};
use metrale_gpu_runtime::{
    CpuBackend, DevicePtr, GpuBackend, GpuBackendExt, GpuError, GpuResult, TpRank,
};
use metrale_model_layers::Ops;
use metrale_model_layers::ops::Matrix;

use super::harness::{self, Rng, S};

/// Rank 0 of an NCCL group of one rank on GPU 0.
fn nccl_rank() -> Arc<dyn GpuBackend> {
    let options = CudaBackendOptions::default().check_kernel_errors(true);
    let mut group = CudaBackend::tensor_parallel_group(&[0], options)
        .expect("an NCCL group of one rank on GPU 0 (run.sh puts NCCL's library on the path)");
    Arc::new(group.remove(0))
}

/// One side's buffers: the f32 partial sums, the f32 sum, the bf16 output, the gathered rows.
struct Side {
    partial: DevicePtr,
    sum: DevicePtr,
    out: DevicePtr,
    gathered: DevicePtr,
}

const ROWS: u32 = 3;
const COLS: u32 = 1003;
const N: usize = (ROWS * COLS) as usize;

impl Side {
    fn new(gpu: &dyn GpuBackend) -> Side {
        let buf = |bytes: usize| gpu.alloc(bytes).expect("alloc");
        Side {
            partial: buf(N * 4),
            sum: buf(N * 4),
            out: buf(N * 2),
            gathered: buf(N * 4),
        }
    }

    /// `partial` set to `x`, every output poisoned with 0xFF (NaN).
    fn reset(&self, gpu: &dyn GpuBackend, x: &[f32]) {
        gpu.upload(self.partial, x, S).expect("upload");
        for (p, bytes) in [(self.sum, N * 4), (self.out, N * 2), (self.gathered, N * 4)] {
            gpu.memset(p, 0xFF, bytes, S).expect("poison");
        }
    }

    /// The f32 sum out of place, the gather of the sum, then the bf16 sum (which sums
    /// `partial` in place before rounding it).
    fn launch(&self, ops: &Ops) -> GpuResult<()> {
        let f32s = |p| Matrix::f32(p, ROWS, COLS);
        ops.all_reduce_sum(S, f32s(self.sum), f32s(self.partial))?;
        ops.all_gather_cols(S, f32s(self.gathered), f32s(self.sum))?;
        ops.all_reduce_sum(S, Matrix::bf16(self.out, ROWS, COLS), f32s(self.partial))
    }

    /// (sum, bf16 out, gathered, partial afterwards) as bits.
    fn bits(&self, gpu: &dyn GpuBackend) -> [Vec<u32>; 4] {
        let f = |p| -> Vec<u32> {
            let v: Vec<f32> = gpu.download(p, N, S).expect("download");
            v.iter().map(|x| x.to_bits()).collect()
        };
        let out: Vec<bf16> = gpu.download(self.out, N, S).expect("download");
        [
            f(self.sum),
            out.iter().map(|x| x.to_bits() as u32).collect(),
            f(self.gathered),
            f(self.partial),
        ]
    }
}

/// What a group of one rank must give for input `x`.
fn expected(x: &[f32]) -> [Vec<u32>; 4] {
    let f: Vec<u32> = x.iter().map(|v| v.to_bits()).collect();
    let b = x
        .iter()
        .map(|&v| bf16::from_f32(v).to_bits() as u32)
        .collect();
    [f.clone(), b, f.clone(), f]
}

/// Random inputs of several magnitudes, signs and exact bf16 ties.
fn inputs(rng: &mut Rng) -> Vec<f32> {
    let mut x: Vec<f32> = (0..N)
        .map(|i| rng.uniform(-4.0, 4.0) * [1e-3, 1.0, 300.0][i % 3])
        .collect();
    x[0] = f32::from_bits(0x3F80_8000);
    x[1] = f32::from_bits(0x3F81_8000);
    x
}

#[test]
fn an_nccl_group_of_one_rank_gives_its_input_back_eager_and_captured() {
    let gpu = nccl_rank();
    assert_eq!(gpu.tp_rank(), TpRank { rank: 0, size: 1 });
    let mut cpu_group = CpuBackend::tensor_parallel_group(1, Default::default());
    let cpu: Arc<dyn GpuBackend> = Arc::new(cpu_group.remove(0));
    let (gpu_ops, cpu_ops) = (
        Ops::new(gpu.clone()).expect("kernels resolve on CUDA"),
        Ops::new(cpu.clone()).expect("CPU kernels resolve"),
    );
    let (g, c) = (Side::new(gpu.as_ref()), Side::new(cpu.as_ref()));
    let rng = &mut Rng::new(23);
    let x = inputs(rng);
    g.reset(gpu.as_ref(), &x);
    c.reset(cpu.as_ref(), &x);
    g.launch(&gpu_ops).expect("NCCL collectives queue");
    gpu.synchronize(S).expect("NCCL collectives run");
    c.launch(&cpu_ops).expect("CPU collectives");
    let got = g.bits(gpu.as_ref());
    let want = expected(&x);
    let names = ["f32 sum", "bf16 sum", "gathered", "partial after"];
    for i in 0..4 {
        assert!(got[i] == want[i], "eager {}: not the input's", names[i]);
    }
    assert!(got == c.bits(cpu.as_ref()), "the CPU group of one differs");
    println!("kernel-check nccl_group_of_one eager ok");

    // Captured: the graph reads the new input at the same addresses when replayed.
    gpu.begin_capture(S).expect("begin capture");
    let captured = g.launch(&gpu_ops);
    let graph = gpu.end_capture(S).expect("end capture");
    captured.expect("NCCL collectives are captured");
    for round in 0..2 {
        let x = inputs(rng);
        g.reset(gpu.as_ref(), &x);
        gpu.launch_graph(graph, S).expect("replay");
        gpu.synchronize(S).expect("the replay runs");
        let got = g.bits(gpu.as_ref());
        let want = expected(&x);
        for i in 0..4 {
            assert!(
                got[i] == want[i],
                "replay {round} {}: not the input's",
                names[i]
            );
        }
    }
    gpu.destroy_graph(graph).expect("destroy graph");
    println!("kernel-check nccl_group_of_one captured ok");
}

#[test]
fn an_aborted_group_a_backend_alone_and_groups_the_machine_cannot_make_are_refused() {
    let gpu = nccl_rank();
    let ops = Ops::new(gpu.clone()).expect("kernels resolve on CUDA");
    let buf = gpu.alloc(N * 4).expect("alloc");
    let m = Matrix::f32(buf, ROWS, COLS);
    ops.all_reduce_sum(S, m, m).expect("a live group sums");
    gpu.synchronize(S).expect("sync");
    gpu.abort_collectives();
    let e = ops.all_reduce_sum(S, m, m).unwrap_err();
    assert!(
        matches!(
            e,
            GpuError::CollectiveAborted {
                op: "all_reduce_sum"
            }
        ),
        "{e}"
    );

    let alone = Ops::new(harness::cuda()).expect("kernels resolve on CUDA");
    let e = alone.all_reduce_sum(S, m, m).unwrap_err().to_string();
    assert!(e.contains("not in a tensor-parallel group"), "{e}");

    let options = CudaBackendOptions::default;
    let e = CudaBackend::tensor_parallel_group(&[0, 0], options()).unwrap_err();
    assert!(e.to_string().contains("GPU 0 is named twice"), "{e}");
    let n = CudaBackend::device_count().expect("the driver");
    let e = CudaBackend::tensor_parallel_group(&[0, n], options()).unwrap_err();
    assert!(
        matches!(e, GpuError::Unavailable(..)) && e.to_string().contains(&format!("needs GPU {n}")),
        "{e}"
    );
    let e = CudaBackend::tensor_parallel_group(&[], options()).unwrap_err();
    assert!(e.to_string().contains("no GPUs"), "{e}");
}
