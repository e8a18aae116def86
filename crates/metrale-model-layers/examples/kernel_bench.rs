//! `kernel_bench`: the speed of `linear` at decode and prefill shapes beside its ceilings, and
//! of `paged_attention` at decode batches beside the bytes of KV cache it must read. Both
//! ceilings come from the same run: the device-to-device copy bandwidth and the vendor BLAS's
//! bf16 GEMM rate (cuBLASLt, 8192³). Timed with device events after a warm-up, median of several
//! runs, weights and KV caches rotated so L2 cannot serve repeats. A measurement, not a check:
//! `run.sh` of the GPU bundle runs it and collects its `bench` lines. `mixed` (only when asked)
//! times `paged_attention_prefill` on a mixed step's rows: 64 decode rows beside a chunk of a
//! long prompt, walked, as `attention_prefill_plan` launches them, and all split. `prompt` (only
//! when asked) times a whole prompt's attention through `paged_attention_prefill` (as planned)
//! and through `paged_attention_prompt`, in TFLOP/s of causal work.
//!
//! `cargo run --release --features cuda -p metrale-model-layers --example kernel_bench
//! [linear|attention|mixed|prompt [CONTEXTS]]` (linear and attention without an argument;
//! CONTEXTS, comma-separated token counts, the attention rows' contexts, 1025 by default, or the
//! long prompt's for `mixed`, 16384 by default, or the prompts' for `prompt`, 2048 and 16384 by
//! default).

use std::sync::Arc;

use metrale_gpu_runtime::{
    CudaBackend, DType, DevicePtr, GpuBackend, GpuBackendExt, StreamHandle, VendorGemm,
};
use metrale_model_layers::Ops;
use metrale_model_layers::ops::{Matrix, PagedAttention};
use metrale_model_layers::ops_gemm::{LinearStaging, linear_staging_bytes};
use metrale_testkit::Rng;

/// The stream every launch uses.
const S: StreamHandle = StreamHandle::DEFAULT;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let which = std::env::args().nth(1);
    let contexts = match std::env::args().nth(2) {
        Some(list) => list
            .split(',')
            .map(|c| match c.trim().parse::<u32>() {
                Ok(n) if n > 0 => Ok(n),
                _ => Err(format!("context `{c}`: a token count of at least 1")),
            })
            .collect::<Result<Vec<u32>, String>>()?,
        None if which.as_deref() == Some("mixed") => vec![16384],
        None if which.as_deref() == Some("prompt") => vec![2048, 16384],
        None => vec![1025],
    };
    let gpu: Arc<dyn GpuBackend> = Arc::new(CudaBackend::new(0)?);
    let ops = Ops::new(gpu.clone())?;
    let g = gpu.as_ref();
    let copy_gbs = copy_bandwidth(g);
    if which.as_deref().is_none_or(|w| w == "linear") {
        let tflops = vendor_tflops(g);
        measure_linear(&ops, g, copy_gbs, tflops);
    }
    if which.as_deref().is_none_or(|w| w == "attention") {
        for &context in &contexts {
            measure_attention(&ops, g, copy_gbs, context);
        }
    }
    if which.as_deref() == Some("mixed") {
        for &context in &contexts {
            measure_mixed(&ops, g, copy_gbs, context);
        }
    }
    if which.as_deref() == Some("prompt") {
        for &context in &contexts {
            measure_prompt(&ops, g, context);
        }
    }
    Ok(())
}

/// One layer's paged attention on the device for `rows` ((sequence, position) each) of heads
/// `(hq, hkv, d, gated)`: pools of `num_slots` slots of uniform random keys and values (bf16,
/// blocks of `block`), random queries, the block `tables` (`max_blocks` a sequence), and the
/// output; with every buffer to free.
fn attention_problem(
    (ops, g, rng): (&Ops, &dyn GpuBackend, &mut Rng),
    (hq, hkv, d, gated): (u32, u32, u32, bool),
    rows: &[(u32, u32)],
    (tables, block, max_blocks, num_slots): (&[u32], u32, u32, u32),
) -> (PagedAttention, Vec<DevicePtr>) {
    let elems = num_slots as usize * (hkv * d) as usize;
    let (k, v) = (
        g.alloc(2 * elems).expect("alloc"),
        g.alloc(2 * elems).expect("alloc"),
    );
    ops.fill_uniform_bf16(S, k, elems as u64, 1, 0.0, 2.0)
        .expect("fill");
    ops.fill_uniform_bf16(S, v, elems as u64, 2, 0.0, 2.0)
        .expect("fill");
    let n_rows = rows.len() as u32;
    let (q_stride, row_stride) = qkv_strides(hq, hkv, d, gated);
    let qkv = g
        .alloc_upload(&rng.bf16s((n_rows * row_stride) as usize, -2.0, 2.0), S)
        .expect("qkv");
    let block_tables = g.alloc_upload(tables, S).expect("tables");
    let row_seq = g
        .alloc_upload(&rows.iter().map(|r| r.0).collect::<Vec<u32>>(), S)
        .expect("row_seq");
    let positions = g
        .alloc_upload(&rows.iter().map(|r| r.1).collect::<Vec<u32>>(), S)
        .expect("positions");
    let out = g.alloc((n_rows * hq * d) as usize * 2).expect("out");
    let params = PagedAttention {
        out,
        qkv,
        k_cache: k,
        v_cache: v,
        block_tables,
        row_seq,
        positions,
        rows: n_rows,
        row_stride,
        q_head_stride: q_stride,
        num_q_heads: hq,
        num_kv_heads: hkv,
        head_dim: d,
        block_size: block,
        max_blocks,
        num_seqs: tables.len() as u32 / max_blocks,
        num_slots,
        scale: 1.0 / (d as f32).sqrt(),
        gated,
        kv_dtype: metrale_cache::KvDtype::Bf16,
        kv_scales: metrale_cache::KvScales::default(),
    };
    (
        params,
        vec![k, v, qkv, block_tables, row_seq, positions, out],
    )
}

/// One layer's attention over a whole prompt of `context` tokens (one sequence, every row, its
/// blocks of 16 in shuffled order, bf16 pools, Qwen3-8B's heads): `paged_attention_prefill` over
/// the row groups `attention_prefill_plan` gives and `paged_attention_prompt` over the prompt
/// groups `attention_step_plan` gives, each in TFLOP/s of causal work (4 head_dim FLOPs a query
/// head and key it attends to).
fn measure_prompt(ops: &Ops, g: &dyn GpuBackend, context: u32) {
    use metrale_model_layers::ops::{RowGroups, attention_prefill_plan, attention_step_plan};
    let mut rng = Rng::new(19);
    const BLOCK: u32 = 16;
    let (shape, hq, hkv, d, gated) = ATTENTION_SHAPES[0];
    let blocks = context.div_ceil(BLOCK);
    let tables = rng.permutation(blocks);
    let rows: Vec<(u32, u32)> = (0..context).map(|p| (0, p)).collect();
    let (params, bufs) = attention_problem(
        (ops, g, &mut rng),
        (hq, hkv, d, gated),
        &rows,
        (&tables, BLOCK, blocks, blocks * BLOCK),
    );
    let resident = ops.attention_prefill_blocks(d).expect("resident blocks");
    let (planned, split) = attention_prefill_plan(&rows, hq, hkv, d, resident);
    let count = (planned.len() / 2) as u32;
    let flops = 4.0 * f64::from(d * hq) * f64::from(context) * f64::from(context + 1) / 2.0;
    let at = g.alloc_upload(&planned, S).expect("groups");
    let prefill_ms = time_ms(g, 5, |_| {
        let groups = RowGroups { at, count, split };
        ops.paged_attention_prefill(S, &params, groups, None)
            .expect("attention")
    });
    let plan = attention_step_plan(&rows, &vec![true; rows.len()], (hq, hkv, d), resident);
    let n = plan.prompt;
    let wat = g.alloc_upload(&plan.groups, S).expect("groups");
    let prompt_ms = time_ms(g, 5, |_| {
        ops.paged_attention_prompt(S, &params, wat, n)
            .expect("attention")
    });
    let rate = |ms: f64| flops / (ms * 1e-3) / 1e12;
    println!(
        "bench paged_attention_prompt {shape:<10} {context} tokens: paged_attention_prefill \
         {:9.1} us ({:6.1} TFLOP/s), paged_attention_prompt {:9.1} us ({:6.1} TFLOP/s)",
        prefill_ms * 1e3,
        rate(prefill_ms),
        prompt_ms * 1e3,
        rate(prompt_ms)
    );
    for p in bufs.into_iter().chain([at, wat]) {
        g.free(p).expect("free");
    }
}

/// `paged_attention_prefill` of one layer on a mixed step's rows: 64 decode rows (each its own
/// sequence at context 400) and `chunk` rows of a prompt ending at `context`, in blocks of 16,
/// bf16 pools; its row groups walked (every item in one block), as `attention_prefill_plan`
/// orders and splits them, and all through the split kernels. The floor is the KV bytes once
/// (each sequence's keys and values) over the copy bandwidth.
fn measure_mixed(ops: &Ops, g: &dyn GpuBackend, copy_gbs: f64, context: u32) {
    use metrale_model_layers::ops::{RowGroups, attention_prefill_plan, attention_row_groups};
    let mut rng = Rng::new(17);
    const BLOCK: u32 = 16;
    const DECODE: u32 = 64;
    const DECODE_CTX: u32 = 400;
    for (shape, hq, hkv, d, gated) in ATTENTION_SHAPES {
        for chunk in [16u32, 64, 448].into_iter().filter(|&c| c <= context) {
            // Sequences 0..64 decode; sequence 64 is the prompt. Blocks are laid out one
            // sequence after another.
            let decode_blocks = DECODE_CTX.div_ceil(BLOCK);
            let max_blocks = context.div_ceil(BLOCK).max(decode_blocks);
            let mut tables = vec![0u32; ((DECODE + 1) * max_blocks) as usize];
            let mut next = 0u32;
            for s in 0..=DECODE {
                let n = if s < DECODE {
                    decode_blocks
                } else {
                    context.div_ceil(BLOCK)
                };
                for j in 0..n {
                    tables[(s * max_blocks + j) as usize] = next;
                    next += 1;
                }
            }
            let num_slots = next * BLOCK;
            let rows: Vec<(u32, u32)> = (0..DECODE)
                .map(|s| (s, DECODE_CTX - 1))
                .chain((context - chunk..context).map(|p| (DECODE, p)))
                .collect();
            let (params, bufs) = attention_problem(
                (ops, g, &mut rng),
                (hq, hkv, d, gated),
                &rows,
                (&tables, BLOCK, max_blocks, num_slots),
            );
            let blocks = ops.attention_prefill_blocks(d).expect("resident blocks");
            let walked = attention_row_groups(rows.iter().copied(), hq, hkv, d);
            let count = (walked.len() / 2) as u32;
            let (planned, split) = attention_prefill_plan(&rows, hq, hkv, d, blocks);
            let bytes = f64::from(DECODE * DECODE_CTX + context) * f64::from(hkv * d) * 4.0;
            let floor_us = bytes / (copy_gbs * 1e3);
            let mut line = format!(
                "bench paged_attention_prefill {shape:<10} 64 decode rows at {DECODE_CTX} + {chunk} rows at {context}:"
            );
            for (label, groups, split) in [
                ("walked", &walked, 0),
                ("planned", &planned, split),
                ("all split", &walked, count),
            ] {
                let at = g.alloc_upload(groups, S).expect("groups");
                let us = time_graph_us(g, |_| {
                    let groups = RowGroups { at, count, split };
                    ops.paged_attention_prefill(S, &params, groups, None)
                        .expect("attention")
                });
                line += &format!(" {label} ({split} of {count} groups split) {us:8.1} us,");
                g.free(at).expect("free");
            }
            println!("{line} floor {floor_us:6.1} us");
            for p in bufs {
                g.free(p).expect("free");
            }
        }
    }
}

/// The attention heads measured: (shape, query heads, key/value heads, head_dim, gated).
const ATTENTION_SHAPES: [(&str, u32, u32, u32, bool); 2] = [
    ("qwen3-8b", 32, 8, 128, false),
    ("qwen3.5-9b", 16, 4, 256, true),
];

/// A qkv row's query-head stride (a gate after each query head when `gated`) and its width
/// (queries, keys, values).
fn qkv_strides(hq: u32, hkv: u32, d: u32, gated: bool) -> (u32, u32) {
    let q_stride = if gated { 2 * d } else { d };
    (q_stride, hq * q_stride + 2 * hkv * d)
}

/// Median milliseconds of `reps` timed calls of `f(i)`, after 3 warm-up calls.
fn time_ms(gpu: &dyn GpuBackend, reps: usize, mut f: impl FnMut(usize)) -> f64 {
    let (a, b) = (
        gpu.create_event().expect("event"),
        gpu.create_event().expect("event"),
    );
    for i in 0..3 {
        f(i);
    }
    let mut times: Vec<f64> = (0..reps)
        .map(|i| {
            gpu.record_event(a, S).expect("record");
            f(i);
            gpu.record_event(b, S).expect("record");
            f64::from(gpu.event_elapsed_ms(a, b).expect("elapsed"))
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[reps / 2]
}

/// Device-to-device copy bandwidth over 1 GiB, GB/s (read + write): the bandwidth ceiling.
fn copy_bandwidth(g: &dyn GpuBackend) -> f64 {
    let copy_bytes = 1usize << 30;
    let (src, dst) = (
        g.alloc(copy_bytes).expect("alloc"),
        g.alloc(copy_bytes).expect("alloc"),
    );
    g.memset(src, 0x3C, copy_bytes, S).expect("memset");
    let ms = time_ms(g, 10, |_| {
        g.copy_d2d(dst, src, copy_bytes, S).expect("copy")
    });
    let copy_gbs = 2.0 * copy_bytes as f64 / ms / 1e6;
    println!(
        "bench copy d2d 1 GiB: {ms:.3} ms, {copy_gbs:.0} GB/s (read + write) = the bandwidth ceiling"
    );
    g.free(src).expect("free");
    g.free(dst).expect("free");
    copy_gbs
}

/// The vendor BLAS's bf16 GEMM rate at 8192³, TFLOP/s: the compute ceiling (`None` where the
/// backend has no vendor GEMM).
fn vendor_tflops(g: &dyn GpuBackend) -> Option<f64> {
    let d = 8192u32;
    let bytes = (d as usize).pow(2) * 2;
    let bufs: Vec<DevicePtr> = (0..3).map(|_| g.alloc(bytes).expect("alloc")).collect();
    for &b in &bufs {
        g.memset(b, 0x3C, bytes, S).expect("memset");
    }
    let gemm = VendorGemm {
        out: bufs[0],
        x: bufs[1],
        w: bufs[2],
        m: d,
        n: d,
        k: d,
        inputs: DType::Bf16,
    };
    let tflops = g.vendor_gemm(&gemm, S).map(|first| {
        first.expect("vendor gemm");
        let ms = time_ms(g, 10, |_| {
            g.vendor_gemm(&gemm, S)
                .expect("the vendor gemm ran before")
                .expect("vendor gemm")
        });
        2.0 * f64::from(d).powi(3) / ms / 1e9
    });
    for b in bufs {
        g.free(b).expect("free");
    }
    if let Some(t) = tflops {
        println!("bench vendor gemm bf16 8192^3: {t:.0} TFLOP/s = the compute ceiling");
    }
    tflops
}

/// `linear` at decode and prefill shapes: time, bandwidth and rate beside the ceilings.
fn measure_linear(ops: &Ops, g: &dyn GpuBackend, copy_gbs: f64, tflops: Option<f64>) {
    // Prefill-sized rows run `linear_tma`, as in a model (a staging buffer for the largest).
    let images = linear_staging_bytes(4096, 12288);
    let staging = g.alloc(LinearStaging::bytes(images, 64)).expect("staging");
    ops.set_linear_staging(Some(LinearStaging::at(staging, images, 64)));

    let mut rng = Rng::new(12);
    for (m, n, k) in [
        (1u32, 12288u32, 4096u32),
        (1, 4096, 12288),
        (1, 6144, 4096),
        (1, 151_936, 4096),
        (8, 12288, 4096),
        (32, 12288, 4096),
        (64, 12288, 4096),
        (128, 12288, 4096),
        (2048, 4096, 4096),
        (4096, 12288, 4096),
    ] {
        let w_bytes = n as usize * k as usize * 2;
        let copies = (256usize << 20).div_ceil(w_bytes).clamp(1, 8);
        let weights: Vec<DevicePtr> = (0..copies)
            .map(|c| {
                let w = g.alloc(w_bytes).expect("alloc");
                ops.fill_uniform_bf16(S, w, (n * k) as u64, c as u64, 0.0, 0.03)
                    .expect("fill");
                w
            })
            .collect();
        let x = g
            .alloc_upload(&rng.bf16s((m * k) as usize, -1.0, 1.0), S)
            .expect("x");
        let out = g.alloc(m as usize * n as usize * 2).expect("out");
        let ms = time_ms(g, 20, |i| {
            let w = Matrix::bf16(weights[i % copies], n, k);
            ops.linear(S, Matrix::bf16(out, m, n), Matrix::bf16(x, m, k), w)
                .expect("linear")
        });
        let bytes = (w_bytes + (m * k) as usize * 2 + (m * n) as usize * 2) as f64;
        let gbs = bytes / ms / 1e6;
        let flops = 2.0 * f64::from(m) * f64::from(n) * f64::from(k);
        let rate = flops / ms / 1e9;
        let floor_ms = (bytes / (copy_gbs * 1e6)).max(tflops.map_or(0.0, |t| flops / (t * 1e9)));
        let of_compute =
            tflops.map_or(String::from("-"), |t| format!("{:5.1} %", 100.0 * rate / t));
        println!(
            "bench linear m={m:<5} n={n:<6} k={k:<5}: {:8.1} us  {gbs:6.0} GB/s ({:5.1} % of copy)  {rate:6.1} TFLOP/s ({of_compute} of vendor)  roofline {:6.1} us ({:5.1} %)",
            ms * 1e3,
            100.0 * gbs / copy_gbs,
            floor_ms * 1e3,
            100.0 * floor_ms / ms
        );
        for w in weights {
            g.free(w).expect("free");
        }
        g.free(x).expect("free");
        g.free(out).expect("free");
    }
    ops.set_linear_staging(None);
    g.free(staging).expect("free");
}

/// Median µs of one launch of `f(i)` (i = 0, 1, ...), from a captured graph of 20 of them
/// replayed after a warm-up (so each figure includes the in-graph launch gap, as in a step).
fn time_graph_us(gpu: &dyn GpuBackend, f: impl Fn(usize)) -> f64 {
    const REPS: usize = 20;
    gpu.begin_capture(S).expect("capture");
    (0..REPS).for_each(&f);
    let graph = gpu.end_capture(S).expect("capture");
    let ms = time_ms(gpu, 10, |_| gpu.launch_graph(graph, S).expect("replay"));
    gpu.destroy_graph(graph).expect("destroy graph");
    ms * 1e3 / REPS as f64
}

/// `paged_attention` of one layer at decode batches: every row the new token (at `context` - 1)
/// of its own sequence, in blocks of 16, from bf16 and from FP8 pools; the floor is the KV bytes
/// the rows must read (keys and values of every context token, once) over the copy bandwidth.
/// Beside the ladder's batches, the batches whose items fill whole rounds of the resident
/// clusters (each cluster loops over items): the step from a whole number of rounds to one
/// partial round more. Batches whose bf16 pools would pass 2 GiB a copy are left out.
fn measure_attention(ops: &Ops, g: &dyn GpuBackend, copy_gbs: f64, context: u32) {
    let mut rng = Rng::new(13);
    const BLOCK: u32 = 16;
    const MAX_POOL_BYTES: u64 = 2 << 30;
    let position = context - 1;
    let max_blocks = (position + 1).div_ceil(BLOCK);
    for (shape, hq, hkv, d, gated) in ATTENTION_SHAPES {
        let resident = ops
            .attention_resident_clusters(hq, hkv, d)
            .expect("resident clusters");
        // Items (row, group of heads sharing a key/value head) a row: one per key/value head
        // for these shapes (groups of 4 heads).
        let per_row = hkv;
        let mut batches = vec![1u32, 8, 32, 64, 128];
        batches.extend(
            [4, 8, 16]
                .map(|k| k * resident)
                .into_iter()
                .filter(|items| items.is_multiple_of(per_row))
                .map(|items| items / per_row),
        );
        batches.sort_unstable();
        batches.dedup();
        batches.retain(|&b| {
            2 * u64::from(b) * u64::from(max_blocks * BLOCK) * u64::from(hkv * d) <= MAX_POOL_BYTES
        });
        for batch in batches {
            let items = batch * per_row;
            let rounds = items.div_ceil(resident);
            let num_slots = batch * max_blocks * BLOCK;
            let elems = num_slots as u64 * u64::from(hkv * d);
            // Enough copies of the pools that a graph of launches cannot hit L2 (50 MB).
            let copies = (320u64 << 20).div_ceil(4 * elems).clamp(1, 64) as usize;
            let pools: Vec<(DevicePtr, DevicePtr)> = (0..copies)
                .map(|c| {
                    let k = g.alloc(2 * elems as usize).expect("alloc");
                    let v = g.alloc(2 * elems as usize).expect("alloc");
                    ops.fill_uniform_bf16(S, k, elems, 2 * c as u64, 0.0, 2.0)
                        .expect("fill");
                    ops.fill_uniform_bf16(S, v, elems, 2 * c as u64 + 1, 0.0, 2.0)
                        .expect("fill");
                    (k, v)
                })
                .collect();
            let (q_stride, row_stride) = qkv_strides(hq, hkv, d, gated);
            let qkv = g
                .alloc_upload(&rng.bf16s((batch * row_stride) as usize, -2.0, 2.0), S)
                .expect("qkv");
            let tables: Vec<u32> = (0..batch * max_blocks).collect();
            let block_tables = g.alloc_upload(&tables, S).expect("tables");
            let row_seq = g
                .alloc_upload(&(0..batch).collect::<Vec<u32>>(), S)
                .expect("row_seq");
            let positions = g
                .alloc_upload(&vec![position; batch as usize], S)
                .expect("positions");
            let out = g.alloc((batch * hq * d) as usize * 2).expect("out");
            // bf16 pools, then the same pools' first halves read as FP8 (e4m3) ones: half the
            // bytes a token.
            for fp8 in [false, true] {
                let params = |i: usize| PagedAttention {
                    out,
                    qkv,
                    k_cache: pools[i % copies].0,
                    v_cache: pools[i % copies].1,
                    block_tables,
                    row_seq,
                    positions,
                    rows: batch,
                    row_stride,
                    q_head_stride: q_stride,
                    num_q_heads: hq,
                    num_kv_heads: hkv,
                    head_dim: d,
                    block_size: BLOCK,
                    max_blocks,
                    num_seqs: batch,
                    num_slots,
                    scale: 1.0 / (d as f32).sqrt(),
                    gated,
                    kv_dtype: if fp8 {
                        metrale_cache::KvDtype::Fp8
                    } else {
                        metrale_cache::KvDtype::Bf16
                    },
                    kv_scales: metrale_cache::KvScales { k: 0.5, v: 0.25 },
                };
                let us = time_graph_us(g, |i| {
                    ops.paged_attention(S, &params(i)).expect("attention")
                });
                let elem = if fp8 { 1.0 } else { 2.0 };
                let bytes =
                    f64::from(batch) * f64::from(position + 1) * f64::from(hkv * d) * 2.0 * elem;
                let floor_us = bytes / (copy_gbs * 1e3);
                println!(
                    "bench paged_attention{} {shape:<10} batch {batch:>3} ctx {}: {us:8.1} us  KV {:7.1} MB  floor {floor_us:7.1} us  {:5.2}x floor  {:5.0} GB/s  {items} items, {rounds} rounds of {resident} clusters",
                    if fp8 { " fp8" } else { "" },
                    position + 1,
                    bytes / 1e6,
                    us / floor_us,
                    bytes / (us * 1e3)
                );
            }
            for (k, v) in pools {
                g.free(k).expect("free");
                g.free(v).expect("free");
            }
            for p in [qkv, block_tables, row_seq, positions, out] {
                g.free(p).expect("free");
            }
        }
    }
}
