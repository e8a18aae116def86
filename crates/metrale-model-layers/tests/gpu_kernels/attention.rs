//! `paged_attention` and `paged_attention_prefill` against their CPU twins: shuffled blocks,
//! grouped-query and gated heads, scalar and vector paths, long contexts; the prefill kernel's
//! row groups bitwise the single-row kernel on each backend; batch invariance and NaN rows.
//! `small` runs `attention_case` (attention_case.rs) at the sanitizer's sizes.

use metrale_cache::{KvDtype, KvScales};
use metrale_gpu_runtime::fp8::kv_quantize;
use metrale_gpu_runtime::{LaunchConfig, Residency};
use metrale_model_layers::ops::{ATTENTION_SPLITS, PagedAttention};

use super::attention_case::{AttnCase, attention_case, attention_case_in};
use super::harness::{Pair, Rng, S};

/// Short contexts through every attention kernel (the sanitizer set): decode rows and a
/// prefill run across units, the vector path (grouped queries, gated and not, head_dim 128 and
/// 256) and the scalar one; `attention_case` runs the cluster, block, prefill and staged prefill
/// kernels on each, and both split prefill kernels.
pub(super) fn small(p: &Pair) {
    let mut rng = Rng::new(1003);
    let case = |hq, hkv, d, gated| AttnCase {
        hq,
        hkv,
        d,
        gated,
        seq_lens: vec![37, 70, 1],
        rows: vec![(1, 0), (1, 15), (1, 16), (1, 17), (1, 69), (0, 36), (2, 0)],
    };
    attention_case(
        p,
        &mut rng,
        &case(4, 2, 128, false),
        "small hq=4 hkv=2 d=128",
    );
    attention_case(
        p,
        &mut rng,
        &case(4, 1, 256, true),
        "small hq=4 hkv=1 d=256 gated",
    );
    attention_case(
        p,
        &mut rng,
        &case(6, 2, 100, true),
        "small hq=6 hkv=2 d=100 (scalar)",
    );
    let fp8 = Some(KvScales { k: 0.02, v: 0.3 });
    let c = case(4, 2, 128, false);
    attention_case_in(p, &mut rng, &c, 16, fp8, "small fp8 hq=4 hkv=2 d=128");
    let c = case(6, 2, 100, true);
    attention_case_in(
        p,
        &mut rng,
        &c,
        8,
        fp8,
        "small fp8 hq=6 hkv=2 d=100 (scalar) blocks of 8",
    );
}

/// FP8 pools (e4m3 bytes, k and v scales): every kernel reads them as its CPU twin does, the
/// cluster, block and prefill kernels bitwise alike (`attention_case`), over the vector path
/// (head_dim 128 and gated 256, Qwen3-8B's and Qwen3.5's heads), the byte path (head_dim 100,
/// not 16-byte rows), head_dim 64 and 32, blocks of 16, 8 (units span blocks) and 48, and
/// scales that saturate some keys. Each block size gives bitwise the same CUDA rows.
#[test]
fn paged_attention_reads_fp8_pools_as_the_twin_at_every_head_dim_and_block_size() {
    let p = Pair::new();
    let scales = [KvScales { k: 0.004, v: 0.5 }, KvScales { k: 0.05, v: 0.01 }];
    let cases = [
        (32, 8, 128, false),
        (16, 4, 256, true),
        (6, 2, 100, true),
        (8, 8, 64, false),
        (4, 1, 32, false),
    ];
    for (n, &(hq, hkv, d, gated)) in cases.iter().enumerate() {
        let c = AttnCase {
            hq,
            hkv,
            d,
            gated,
            seq_lens: vec![700, 33, 1],
            rows: (300..340)
                .map(|p| (0, p))
                .chain([(0, 699), (1, 32), (1, 15), (1, 16), (2, 0)])
                .collect(),
        };
        let fp8 = Some(scales[n % 2]);
        let mut want: Option<Vec<u16>> = None;
        for block_size in [16u32, 8, 48] {
            let label = format!("fp8 hq={hq} hkv={hkv} d={d} block_size={block_size}");
            let got = attention_case_in(
                &p,
                &mut Rng::new(60 + n as u64),
                &c,
                block_size,
                fp8,
                &label,
            );
            match &want {
                None => want = Some(got),
                Some(w) => assert!(got == *w, "{label}: differs bitwise from block_size 16"),
            }
        }
    }
}

/// The persistent attention launches size themselves by the driver's count of resident clusters:
/// on CUDA the backend answers (the test backend forwards the query; without it the launchers
/// would fall back to the H200's constants), no shared memory fits at least as many clusters as
/// the launches' shared memory, a larger head dimension (more shared memory a block) fits no
/// more, and the CPU backend, which has no such limit, gets the H200's counts.
#[test]
fn attention_launches_know_how_many_clusters_fit() {
    let p = Pair::new();
    let (cuda_ops, cpu_ops) = (&p.gpu_ops, &p.cpu_ops);
    let fits = |o: &metrale_model_layers::Ops, hq, hkv, d| {
        o.attention_resident_clusters(hq, hkv, d)
            .expect("resident clusters")
    };
    let (c128, c256) = (fits(cuda_ops, 32, 8, 128), fits(cuda_ops, 16, 4, 256));
    println!("resident paged_attention clusters on CUDA: head_dim 128 {c128}, 256 {c256}");
    assert!(c256 >= 1 && c128 >= c256, "{c128} at 128, {c256} at 256");
    let kernel = p
        .gpu
        .kernel("attention", "paged_attention")
        .expect("kernel");
    let bare = LaunchConfig::grid2(ATTENTION_SPLITS, 1, 128);
    let most = p
        .gpu
        .max_resident(kernel, &bare, Residency::Clusters)
        .expect("the CUDA backend answers the query")
        .expect("query");
    assert!(
        most >= c128,
        "{most} clusters without shared memory, {c128} with"
    );
    assert_eq!(
        (fits(cpu_ops, 32, 8, 128), fits(cpu_ops, 16, 4, 256)),
        (30, 15)
    );
}

#[test]
fn paged_attention_matches_over_shuffled_blocks_with_gqa_and_gates() {
    let p = Pair::new();
    let mut rng = Rng::new(6);
    let mixed = |hq, hkv, d, gated| AttnCase {
        hq,
        hkv,
        d,
        gated,
        seq_lens: vec![37, 300, 1],
        // Prefill rows of sequence 1, decode rows of 0 and 2, a row in the middle of 1.
        rows: vec![
            (1, 0),
            (1, 1),
            (1, 15),
            (1, 16),
            (1, 299),
            (0, 36),
            (2, 0),
            (1, 150),
        ],
    };
    attention_case(&p, &mut rng, &mixed(8, 2, 128, false), "hq=8 hkv=2 d=128");
    attention_case(
        &p,
        &mut rng,
        &mixed(8, 2, 128, true),
        "hq=8 hkv=2 d=128 gated",
    );
    attention_case(
        &p,
        &mut rng,
        &mixed(4, 4, 64, false),
        "hq=4 hkv=4 d=64 (MHA)",
    );
    attention_case(
        &p,
        &mut rng,
        &mixed(6, 2, 100, true),
        "hq=6 hkv=2 d=100 gated (scalar path)",
    );
    attention_case(&p, &mut rng, &mixed(4, 1, 256, false), "hq=4 hkv=1 d=256");
    let long = AttnCase {
        hq: 4,
        hkv: 2,
        d: 128,
        gated: false,
        seq_lens: vec![2100],
        rows: vec![(0, 2099), (0, 1000), (0, 127), (0, 128)],
    };
    attention_case(&p, &mut rng, &long, "long context 2100 (17 tiles)");
    // Vector-path groups of 3 and 8 query heads per key/value head (clusters of 3 and 4 heads).
    attention_case(
        &p,
        &mut rng,
        &mixed(6, 2, 128, false),
        "hq=6 hkv=2 d=128 (group 3)",
    );
    attention_case(
        &p,
        &mut rng,
        &mixed(16, 2, 256, true),
        "hq=16 hkv=2 d=256 gated (group 8)",
    );
    // The decode shape of Qwen3-8B: 32 / 8 heads, every row at position 1024 (a context of
    // 1025 over 8 splits of 129), beside rows whose contexts leave splits empty.
    let decode = AttnCase {
        hq: 32,
        hkv: 8,
        d: 128,
        gated: false,
        seq_lens: vec![1025, 1025, 5, 9],
        rows: vec![(0, 1024), (1, 1024), (2, 4), (3, 8), (0, 7)],
    };
    attention_case(&p, &mut rng, &decode, "hq=32 hkv=8 d=128 decode ctx 1025");
    // The gated attention of Qwen3.5-9B: 16 / 4 heads of 256; 3000 tokens give each warp more
    // units than its ring has stages.
    let gated_long = AttnCase {
        hq: 16,
        hkv: 4,
        d: 256,
        gated: true,
        seq_lens: vec![3000, 1025],
        rows: vec![(0, 2999), (1, 1024), (0, 5), (1, 16)],
    };
    attention_case(
        &p,
        &mut rng,
        &gated_long,
        "hq=16 hkv=4 d=256 gated ctx 3000",
    );
    attention_case(
        &p,
        &mut rng,
        &mixed(4, 2, 32, false),
        "hq=4 hkv=2 d=32 (padded tile)",
    );
}

/// A decode step with more items than resident blocks, so each block of `paged_attention_flat`
/// loops over several items (its ring and query slots running from one item into the next) and
/// each cluster of `paged_attention` over many: random contexts, some leaving splits and warps
/// without units, on Qwen3-8B's and Qwen3.5-9B's heads. `attention_case` checks both kernels
/// bitwise against each other and the CPU twin.
#[test]
fn paged_attention_blocks_loop_over_many_items() {
    let p = Pair::new();
    let mut rng = Rng::new(61);
    for (hq, hkv, d, gated, rows) in [(32, 8, 128, false, 72), (16, 4, 256, true, 72)] {
        let seq_lens: Vec<u32> = (0..rows).map(|_| 1 + rng.below(700)).collect();
        let rows: Vec<(u32, u32)> = seq_lens
            .iter()
            .enumerate()
            .map(|(s, &len)| (s as u32, len - 1))
            .collect();
        let case = AttnCase {
            hq,
            hkv,
            d,
            gated,
            seq_lens,
            rows,
        };
        let label = format!("hq={hq} hkv={hkv} d={d} {} decode rows", case.rows.len());
        attention_case(&p, &mut rng, &case, &label);
    }
}

/// Prefill chunks through `paged_attention_prefill`'s row groups (each case also checks the
/// CPU twin and the single-row kernel on the same rows): runs of consecutive positions across
/// unit boundaries, one sequence after a cached prefix (from 30), another from 0, beside a
/// decode row; Qwen3-8B's heads (4 per key/value head: 16 rows a group), Qwen3.5-9B's gated
/// 256-wide ones (8 rows), MHA (16 rows of one head) and the scalar path.
#[test]
fn paged_attention_prefill_row_groups_match_the_single_row_kernel() {
    let p = Pair::new();
    let mut rng = Rng::new(26);
    let chunk = |hq, hkv, d, gated| AttnCase {
        hq,
        hkv,
        d,
        gated,
        seq_lens: vec![140, 70, 600],
        rows: (30..140)
            .map(|p| (0, p))
            .chain((0..70).map(|p| (1, p)))
            .chain([(2, 599)])
            .collect(),
    };
    attention_case(
        &p,
        &mut rng,
        &chunk(32, 8, 128, false),
        "prefill hq=32 hkv=8 d=128",
    );
    attention_case(
        &p,
        &mut rng,
        &chunk(16, 4, 256, true),
        "prefill hq=16 hkv=4 d=256 gated",
    );
    attention_case(
        &p,
        &mut rng,
        &chunk(8, 8, 64, false),
        "prefill hq=8 hkv=8 d=64 (MHA)",
    );
    attention_case(
        &p,
        &mut rng,
        &chunk(6, 2, 100, true),
        "prefill hq=6 hkv=2 d=100 gated (scalar)",
    );
}

/// A late chunk of a long prompt through `paged_attention_prefill`: 13 groups of 16 rows whose
/// 57..69 units give every chain several units, streamed through the block's ring across items,
/// at head_dim 128 and (gated) 256.
#[test]
fn paged_attention_prefill_late_rows_of_a_long_prompt_match() {
    let p = Pair::new();
    let mut rng = Rng::new(27);
    let late = |d, gated| AttnCase {
        hq: 32,
        hkv: 8,
        d,
        gated,
        seq_lens: vec![1100],
        rows: (900..1100).map(|p| (0, p)).collect(),
    };
    attention_case(
        &p,
        &mut rng,
        &late(128, false),
        "prefill hq=32 hkv=8 d=128 rows 900..1100",
    );
    attention_case(
        &p,
        &mut rng,
        &late(256, true),
        "prefill hq=32 hkv=8 d=256 gated rows 900..1100",
    );
}

/// The cache's block size changes where keys and values live, never a row's result: the same
/// rows over blocks of 8 and 24 tokens (units span blocks: a slot per token) and of 16, 32 and
/// 48 (a unit lies in one block: one slot run per unit) give bitwise the same CUDA outputs, and
/// each matches the CPU twin; decode rows and a prefill chunk, head_dim 128 and gated 256.
#[test]
fn paged_attention_is_bitwise_the_same_over_every_block_size() {
    let p = Pair::new();
    let cases = [
        AttnCase {
            hq: 32,
            hkv: 8,
            d: 128,
            gated: false,
            seq_lens: vec![1025, 300, 9],
            rows: (250..300)
                .map(|p| (1, p))
                .chain([(0, 1024), (2, 8), (0, 15), (0, 16)])
                .collect(),
        },
        AttnCase {
            hq: 16,
            hkv: 4,
            d: 256,
            gated: true,
            seq_lens: vec![700, 40],
            rows: vec![(0, 699), (1, 39), (0, 47), (0, 48), (1, 0)],
        },
    ];
    for (n, c) in cases.iter().enumerate() {
        let mut want: Option<Vec<u16>> = None;
        for block_size in [16u32, 8, 24, 32, 48] {
            let label = format!("d={} block_size={block_size}", c.d);
            let got = attention_case_in(
                &p,
                &mut Rng::new(40 + n as u64),
                c,
                block_size,
                None,
                &label,
            );
            match &want {
                None => want = Some(got),
                Some(w) => assert!(
                    got == *w,
                    "paged_attention {label}: differs bitwise from block_size 16"
                ),
            }
        }
    }
}

/// CUDA alone, over bf16 and FP8 pools: a row's output is bitwise the same launched alone or
/// beside other rows (good and bad), and rows whose inputs are out of range (a position past
/// `max_blocks`, a block past the pool) come out all NaN without touching the others.
#[test]
fn paged_attention_rows_are_batch_invariant_and_bad_rows_are_nan() {
    for kv_dtype in [KvDtype::Bf16, KvDtype::Fp8] {
        rows_batch_invariant_and_bad_rows_nan(kv_dtype);
    }
}

fn rows_batch_invariant_and_bad_rows_nan(kv_dtype: KvDtype) {
    let p = Pair::new();
    let mut rng = Rng::new(16);
    let (hq, hkv, d, block_size) = (8u32, 2u32, 128u32, 16u32);
    let max_blocks = 40u32;
    let num_blocks = 2 * max_blocks;
    let num_slots = num_blocks * block_size;
    let width = (hkv * d) as usize;
    let kv_scales = KvScales { k: 0.01, v: 0.02 };
    let mut pool = |scale: f32| {
        let values = rng.bf16s(num_slots as usize * width, -2.0, 2.0);
        if kv_dtype == KvDtype::Fp8 {
            let bytes: Vec<u8> = values.iter().map(|&v| kv_quantize(v, scale)).collect();
            p.upload(&bytes)
        } else {
            p.upload(&values)
        }
    };
    let k_cache = pool(kv_scales.k);
    let v_cache = pool(kv_scales.v);
    // Sequence 0 owns the odd blocks in reverse; sequence 1 names a block past the pool.
    let mut tables: Vec<u32> = (0..max_blocks).map(|b| num_blocks - 1 - 2 * b).collect();
    tables.extend((0..max_blocks).map(|b| if b == 3 { num_blocks + 7 } else { 2 * b }));
    let tables = p.upload(&tables);
    let row_stride = hq * d + 2 * width as u32;
    // (sequence, position) of each row: two good rows, a position past max_blocks, a bad block.
    let all = [
        (0u32, 613u32),
        (0, 77),
        (0, max_blocks * block_size + 5),
        (1, 100),
    ];
    let qkv_all = rng.bf16s(all.len() * row_stride as usize, -2.0, 2.0);
    let run = |rows: &[usize]| -> Vec<u16> {
        let mut qkv = Vec::new();
        for &r in rows {
            qkv.extend_from_slice(&qkv_all[r * row_stride as usize..(r + 1) * row_stride as usize]);
        }
        let qkv = p.upload(&qkv);
        let row_seq = p.upload(&rows.iter().map(|&r| all[r].0).collect::<Vec<_>>());
        let positions = p.upload(&rows.iter().map(|&r| all[r].1).collect::<Vec<_>>());
        let out = p.poisoned(rows.len() * (hq * d) as usize * 2);
        p.run_gpu(|o, at| {
            o.paged_attention(
                S,
                &PagedAttention {
                    out: at(&out),
                    qkv: at(&qkv),
                    k_cache: at(&k_cache),
                    v_cache: at(&v_cache),
                    block_tables: at(&tables),
                    row_seq: at(&row_seq),
                    positions: at(&positions),
                    rows: rows.len() as u32,
                    row_stride,
                    q_head_stride: d,
                    num_q_heads: hq,
                    num_kv_heads: hkv,
                    head_dim: d,
                    block_size,
                    max_blocks,
                    num_seqs: 2,
                    num_slots,
                    scale: 1.0 / (d as f32).sqrt(),
                    gated: false,
                    kv_dtype,
                    kv_scales,
                },
            )
        });
        p.download_gpu::<u16>(&out)
    };
    let n = (hq * d) as usize;
    let batched = run(&[2, 0, 3, 1]);
    // Written NaN, not the 0xFFFF poison left where nothing was written.
    let is_nan = |b: &u16| *b != 0xFFFF && (b & 0x7F80) == 0x7F80 && (b & 0x7F) != 0;
    for (at, row) in [(0usize, 2usize), (2, 3)] {
        assert!(
            batched[at * n..(at + 1) * n].iter().all(is_nan),
            "{kv_dtype:?}: row {row} (out of range) is all NaN"
        );
    }
    for (at, row) in [(1usize, 0usize), (3, 1)] {
        let alone = run(&[row]);
        assert!(
            alone.iter().all(|b| !is_nan(b)),
            "{kv_dtype:?}: row {row} alone is finite"
        );
        assert!(
            batched[at * n..(at + 1) * n] == alone[..],
            "{kv_dtype:?}: row {row}: batched beside bad rows differs bitwise from alone"
        );
    }
    println!(
        "kernel-check {:<18} {:<44} batch-invariant, bad rows NaN ok",
        "paged_attention",
        format!("{kv_dtype:?} rows alone vs beside bad rows")
    );
}
