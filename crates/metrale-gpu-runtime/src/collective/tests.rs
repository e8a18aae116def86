//! The CPU twin of the collectives: ranks as threads, each with its own backend.

use half::bf16;

use super::*;
use crate::backend::{GpuBackend, GpuBackendExt};
use crate::cpu::{CpuBackend, CpuBackendOptions};
use crate::types::StreamHandle;

const S: StreamHandle = StreamHandle::DEFAULT;

fn group(n: usize) -> Vec<CpuBackend> {
    CpuBackend::tensor_parallel_group(n, CpuBackendOptions::default())
}

/// Rank `r`'s addends: magnitudes far apart, so the order of an f32 sum changes its bits.
fn addends(r: usize, elems: usize) -> Vec<f32> {
    (0..elems)
        .map(|i| {
            let big = if (i + r).is_multiple_of(3) {
                3.0e7
            } else {
                1.0
            };
            big * (1.0 + 0.37 * r as f32 + 0.011 * i as f32)
                * if r.is_multiple_of(2) { 1.0 } else { -0.73 }
        })
        .collect()
}

/// Run `f(rank, backend)` on every rank at once, each on its own thread; their results in rank
/// order.
fn on_ranks<T: Send>(ranks: &[CpuBackend], f: impl Fn(usize, &CpuBackend) -> T + Sync) -> Vec<T> {
    std::thread::scope(|sc| {
        let handles: Vec<_> = (ranks.iter().enumerate())
            .map(|(r, b)| {
                let f = &f;
                sc.spawn(move || f(r, b))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect()
    })
}

#[test]
fn an_all_reduce_sums_in_rank_order_and_every_rank_gets_the_same_bits() {
    for n in [2, 4] {
        let elems = 37;
        let ranks = group(n);
        let got = on_ranks(&ranks, |r, b| {
            let x = b.alloc_upload(&addends(r, elems), S).unwrap();
            let op = Collective::AllReduceSum {
                out: x,
                out_dtype: DType::F32,
                input: x,
                input_dtype: DType::F32,
                elems,
            };
            b.collective(&op, S).unwrap();
            b.download::<f32>(x, elems, S).unwrap()
        });
        let mut in_order = vec![0.0f32; elems];
        let mut reversed = vec![0.0f32; elems];
        for r in 0..n {
            for (s, v) in in_order.iter_mut().zip(addends(r, elems)) {
                *s += v;
            }
            for (s, v) in reversed.iter_mut().zip(addends(n - 1 - r, elems)) {
                *s += v;
            }
        }
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for (r, g) in got.iter().enumerate() {
            assert_eq!(bits(g), bits(&in_order), "{n} ranks: rank {r}");
        }
        // The addends are chosen so the order of more than two matters: the check above can
        // fail. (Two addends sum the same either way.)
        if n > 2 {
            assert_ne!(bits(&in_order), bits(&reversed), "{n} ranks");
        }
    }
}

#[test]
fn an_all_reduce_of_bf16_addends_sums_in_f32_and_rounds_once() {
    let (n, elems) = (4, 16);
    let ranks = group(n);
    let host = |r: usize| -> Vec<bf16> {
        (0..elems)
            .map(|i| bf16::from_f32(1.0 + (i as f32) / 64.0 + r as f32 / 512.0))
            .collect()
    };
    let got = on_ranks(&ranks, |r, b| {
        let x = b.alloc_upload(&host(r), S).unwrap();
        let out = b.alloc(elems * 2).unwrap();
        let op = Collective::AllReduceSum {
            out,
            out_dtype: DType::Bf16,
            input: x,
            input_dtype: DType::Bf16,
            elems,
        };
        b.collective(&op, S).unwrap();
        b.download::<bf16>(out, elems, S).unwrap()
    });
    let want: Vec<bf16> = (0..elems)
        .map(|i| bf16::from_f32((0..n).map(|r| host(r)[i].to_f32()).sum::<f32>()))
        .collect();
    for g in &got {
        assert_eq!(g, &want);
    }
}

#[test]
fn an_all_gather_puts_each_ranks_columns_in_place_in_every_row() {
    let (n, rows, cols) = (4, 3, 5);
    let ranks = group(n);
    let value = |r: usize, row: usize, c: usize| (100 * r + 10 * row + c) as f32;
    let got = on_ranks(&ranks, |r, b| {
        let local: Vec<f32> = (0..rows * cols)
            .map(|i| value(r, i / cols, i % cols))
            .collect();
        let input = b.alloc_upload(&local, S).unwrap();
        let out = b.alloc(rows * n * cols * 4).unwrap();
        let op = Collective::AllGatherCols {
            out,
            input,
            rows,
            cols,
        };
        b.collective(&op, S).unwrap();
        b.download::<f32>(out, rows * n * cols, S).unwrap()
    });
    let want: Vec<f32> = (0..rows * n * cols)
        .map(|i| {
            let (row, col) = (i / (n * cols), i % (n * cols));
            value(col / cols, row, col % cols)
        })
        .collect();
    for g in &got {
        assert_eq!(g, &want);
    }
}

#[test]
fn a_captured_collective_runs_at_replay_with_the_values_then_in_memory() {
    let (n, elems) = (2, 8);
    let ranks = group(n);
    let got = on_ranks(&ranks, |r, b| {
        let s = b.create_stream().unwrap();
        let x = b.alloc_upload(&vec![0.0f32; elems], s).unwrap();
        let op = Collective::AllReduceSum {
            out: x,
            out_dtype: DType::F32,
            input: x,
            input_dtype: DType::F32,
            elems,
        };
        b.begin_capture(s).unwrap();
        b.collective(&op, s).unwrap();
        let graph = b.end_capture(s).unwrap();
        let mut out = Vec::new();
        for step in 1..=2u32 {
            let v = vec![(step * 10 + r as u32) as f32; elems];
            b.upload(x, &v, s).unwrap();
            b.launch_graph(graph, s).unwrap();
            out.push(b.download::<f32>(x, elems, s).unwrap());
        }
        out
    });
    for g in &got {
        assert_eq!(g[0], vec![21.0; elems]);
        assert_eq!(g[1], vec![41.0; elems]);
    }
}

#[test]
fn ranks_that_disagree_fail_on_every_rank() {
    let ranks = group(2);
    let errors = on_ranks(&ranks, |r, b| {
        let elems = 4 + r;
        let x = b.alloc_upload(&vec![1.0f32; elems], S).unwrap();
        let op = Collective::AllReduceSum {
            out: x,
            out_dtype: DType::F32,
            input: x,
            input_dtype: DType::F32,
            elems,
        };
        b.collective(&op, S).unwrap_err().to_string()
    });
    for e in errors {
        assert!(e.contains("disagree"), "{e}");
    }
}

#[test]
fn an_abort_releases_a_rank_waiting_for_one_that_failed() {
    let ranks = group(2);
    let results = on_ranks(&ranks, |r, b| {
        if r == 1 {
            // This rank fails its step before its collective and aborts the group.
            std::thread::sleep(std::time::Duration::from_millis(20));
            b.abort_collectives();
            return None;
        }
        let x = b.alloc_upload(&[1.0f32; 4], S).unwrap();
        let op = Collective::AllReduceSum {
            out: x,
            out_dtype: DType::F32,
            input: x,
            input_dtype: DType::F32,
            elems: 4,
        };
        Some(b.collective(&op, S).unwrap_err().to_string())
    });
    let e = results[0].clone().unwrap();
    assert!(e.contains("aborted"), "{e}");
}

#[test]
fn a_backend_alone_refuses_collectives() {
    let b = CpuBackend::default();
    assert_eq!(b.tp_rank(), TpRank::SINGLE);
    let x = b.alloc_upload(&[1.0f32; 4], S).unwrap();
    let op = Collective::AllReduceSum {
        out: x,
        out_dtype: DType::F32,
        input: x,
        input_dtype: DType::U32,
        elems: 4,
    };
    let e = b.collective(&op, S).unwrap_err().to_string();
    assert!(e.contains("u32"), "{e}");
    let op = Collective::AllReduceSum {
        out: x,
        out_dtype: DType::F32,
        input: x,
        input_dtype: DType::F32,
        elems: 4,
    };
    let e = b.collective(&op, S).unwrap_err().to_string();
    assert!(e.contains("not in a tensor-parallel group"), "{e}");
}
