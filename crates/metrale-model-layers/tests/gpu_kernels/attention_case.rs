//! The attention tests' problem: sequences in shuffled KV blocks and rows at chosen positions,
//! run through every attention kernel (cluster, block, prefill, staged prefill) on CUDA and the
//! CPU twin and checked against each other.

use half::bf16;
use metrale_cache::{KvDtype, KvScales};
use metrale_gpu_runtime::fp8::kv_quantize;
use metrale_model_layers::ops::{
    DecodeAttention, Ops, PagedAttention, RowGroups, attention_blocks_fit, attention_row_groups,
    attention_step_plan,
};
use metrale_model_layers::ops_gemm::linear_staging_bytes;

use super::harness::{self, At, Pair, Rng, S, Tolerance, compare, widen};
use super::staged::{image_rows, permuted_pair};

/// One paged-attention problem: sequences with their contexts in shuffled blocks, and rows
/// (queries) at chosen positions of chosen sequences.
pub(crate) struct AttnCase {
    pub(crate) hq: u32,
    pub(crate) hkv: u32,
    pub(crate) d: u32,
    pub(crate) gated: bool,
    /// Context length of each sequence.
    pub(crate) seq_lens: Vec<u32>,
    /// `(sequence, position)` of each row.
    pub(crate) rows: Vec<(u32, u32)>,
}

pub(crate) fn attention_case(p: &Pair, rng: &mut Rng, c: &AttnCase, label: &str) {
    attention_case_in(p, rng, c, 16, None, label);
}

/// `attention_case` with the KV cache in blocks of `block_size` tokens, bf16 or (with `fp8`'s
/// scales) e4m3 bytes of each key and value over its scale; returns the CUDA output. The
/// tokens' keys and values and the queries are drawn before the blocks are shuffled, so the
/// same seed gives the same problem at every block size.
pub(crate) fn attention_case_in(
    p: &Pair,
    rng: &mut Rng,
    c: &AttnCase,
    block_size: u32,
    fp8: Option<KvScales>,
    label: &str,
) -> Vec<u16> {
    let width = (c.hkv * c.d) as usize;
    let tokens: Vec<Vec<bf16>> = c
        .seq_lens
        .iter()
        .map(|&len| rng.bf16s(2 * len as usize * width, -2.0, 2.0))
        .collect();
    let q_stride = if c.gated { 2 * c.d } else { c.d };
    let row_stride = c.hq * q_stride + 2 * width as u32;
    let qkv = p.upload(&rng.bf16s(c.rows.len() * row_stride as usize, -2.0, 2.0));
    let max_blocks = c
        .seq_lens
        .iter()
        .map(|l| l.div_ceil(block_size))
        .max()
        .unwrap_or(1)
        + 1;
    let used_blocks: u32 = c.seq_lens.iter().map(|l| l.div_ceil(block_size)).sum();
    let num_blocks = used_blocks + 5; // spare blocks nobody owns, poisoned
    let num_slots = num_blocks * block_size;
    let order = rng.permutation(num_blocks);
    let mut tables = vec![u32::MAX; c.seq_lens.len() * max_blocks as usize];
    let mut next = 0usize;
    let mut k_cache = vec![bf16::from_bits(0xFFFF); num_slots as usize * width];
    let mut v_cache = k_cache.clone();
    for (s, &len) in c.seq_lens.iter().enumerate() {
        for b in 0..len.div_ceil(block_size) {
            let block = order[next];
            next += 1;
            tables[s * max_blocks as usize + b as usize] = block;
            for t in b * block_size..((b + 1) * block_size).min(len) {
                let slot = (block * block_size + t % block_size) as usize;
                let kv = &tokens[s][2 * t as usize * width..];
                k_cache[slot * width..(slot + 1) * width].copy_from_slice(&kv[..width]);
                v_cache[slot * width..(slot + 1) * width].copy_from_slice(&kv[width..2 * width]);
            }
        }
    }
    let rows = c.rows.len() as u32;
    let (kc, vc) = match fp8 {
        // Unowned slots hold 0xFF (the NaN code) as the bf16 pools hold NaN.
        Some(sc) => {
            let bytes = |pool: &[bf16], scale: f32| -> Vec<u8> {
                let q = |e: &bf16| {
                    if e.to_bits() == 0xFFFF {
                        0xFF
                    } else {
                        kv_quantize(*e, scale)
                    }
                };
                pool.iter().map(q).collect()
            };
            (
                p.upload(&bytes(&k_cache, sc.k)),
                p.upload(&bytes(&v_cache, sc.v)),
            )
        }
        None => (p.upload(&k_cache), p.upload(&v_cache)),
    };
    let tables = p.upload(&tables);
    let row_seq = p.upload(&c.rows.iter().map(|r| r.0).collect::<Vec<_>>());
    let positions = p.upload(&c.rows.iter().map(|r| r.1).collect::<Vec<_>>());
    let out = p.poisoned((rows * c.hq * c.d) as usize * 2);
    let params = |at: harness::At<'_>| PagedAttention {
        out: at(&out),
        qkv: at(&qkv),
        k_cache: at(&kc),
        v_cache: at(&vc),
        block_tables: at(&tables),
        row_seq: at(&row_seq),
        positions: at(&positions),
        rows,
        row_stride,
        q_head_stride: q_stride,
        num_q_heads: c.hq,
        num_kv_heads: c.hkv,
        head_dim: c.d,
        block_size,
        max_blocks,
        num_seqs: c.seq_lens.len() as u32,
        num_slots,
        scale: 1.0 / (c.d as f32).sqrt(),
        gated: c.gated,
        kv_dtype: if fp8.is_some() {
            KvDtype::Fp8
        } else {
            KvDtype::Bf16
        },
        kv_scales: fp8.unwrap_or_default(),
    };
    p.run(|o, at| o.paged_attention(S, &params(at)));
    p.check_bf16("paged_attention", label, &out, Tolerance::BF16);
    let first = p.download_gpu::<u16>(&out);
    p.run_gpu(|o, at| o.paged_attention(S, &params(at)));
    assert!(
        first == p.download_gpu::<u16>(&out),
        "paged_attention {label}: a second run differs"
    );

    // Both decode kernels (where the block kernel fits the heads), whichever the launcher
    // picked: bitwise the same rows on each backend.
    let (gpu_want, cpu_want) = p.download::<u16>(&out);
    let mut kinds = vec![DecodeAttention::Clusters];
    if attention_blocks_fit(c.hq, c.hkv, c.d) {
        kinds.push(DecodeAttention::Blocks);
    }
    for kind in kinds {
        let out_k = p.poisoned((rows * c.hq * c.d) as usize * 2);
        p.run(|o, at| {
            let params = PagedAttention {
                out: at(&out_k),
                ..params(at)
            };
            o.paged_attention_as(S, &params, kind)
        });
        let (gpu_got, cpu_got) = p.download::<u16>(&out_k);
        assert!(
            gpu_got == gpu_want && cpu_got == cpu_want,
            "paged_attention {label}: the {kind:?} kernel differs bitwise (CUDA {}, CPU {})",
            gpu_got == gpu_want,
            cpu_got == cpu_want
        );
    }

    // The prefill kernels on the same rows, in their row groups: none, the later half and all
    // of them through the split kernels, each bitwise the single-row kernel on each backend
    // (poisoned output first).
    let groups = attention_row_groups(c.rows.iter().copied(), c.hq, c.hkv, c.d);
    let n_groups = (groups.len() / 2) as u32;
    let groups = p.upload(&groups);
    let row_groups = |at: At<'_>, split| RowGroups {
        at: at(&groups),
        count: n_groups,
        split,
    };
    let splits = [0, n_groups / 2, n_groups];
    // Each launch's rows (all alike once checked); the staged kernels' images are held to the
    // last.
    let [.., out2] = splits.map(|split| {
        let out = p.poisoned((rows * c.hq * c.d) as usize * 2);
        p.run(|o, at| {
            let params = PagedAttention {
                out: at(&out),
                ..params(at)
            };
            o.paged_attention_prefill(S, &params, row_groups(at, split), None)
        });
        let (gpu_got, cpu_got) = p.download::<u16>(&out);
        assert!(
            gpu_got == gpu_want,
            "paged_attention_prefill {label}: {n_groups} row groups ({split} split) differ bitwise \
             from paged_attention on CUDA"
        );
        assert!(
            cpu_got == cpu_want,
            "paged_attention_prefill {label}: the CPU twin ({split} of {n_groups} row groups split) \
             differs from paged_attention's"
        );
        out
    });
    println!(
        "kernel-check {:<18} {:<44} bitwise paged_attention ({n_groups} row groups of {rows} rows)",
        "paged_attention_prefill", label
    );

    // The staged kernel: its images are the prefill kernel's rows permuted, on both backends.
    let width = c.hq * c.d;
    if width.is_multiple_of(64) {
        let (gpu_perm, cpu_perm) = permuted_pair(p, &out2, rows, width);
        for split in splits {
            let images = p.poisoned(linear_staging_bytes(rows, width));
            p.run(|o, at| {
                o.paged_attention_prefill(S, &params(at), row_groups(at, split), Some(at(&images)))
            });
            let (gpu_img, cpu_img) = p.download::<u16>(&images);
            assert!(
                image_rows(&gpu_img, rows, width) == image_rows(&gpu_perm, rows, width),
                "paged_attention_prefill_staged {label} ({split} groups split): the images differ \
                 from the prefill rows permuted"
            );
            assert!(
                image_rows(&cpu_img, rows, width) == image_rows(&cpu_perm, rows, width),
                "paged_attention_prefill_staged {label} ({split} groups split): the CPU twin's \
                 images differ from its rows permuted"
            );
        }
    }

    // The prompt kernel (head_dim 128, bf16 pools) on its own row groups (up to a tile of
    // positions) and on the prefill kernels' (a 16-token unit): its own arithmetic, so CUDA
    // within bf16 of the twin and of the decode kernel's rows, and bitwise the same rows
    // whichever groups hold them (the twin's rows do not depend on the groups, so it runs
    // once).
    if Ops::prompt_attention_fits(c.d, fp8.is_some() as u32) {
        let plan = attention_step_plan(&c.rows, &vec![true; c.rows.len()], (c.hq, c.hkv, c.d), 1);
        let prompt_groups = p.upload(&plan.groups);
        let mut outs = Vec::new();
        for (at_groups, count) in [(&prompt_groups, plan.prompt), (&groups, n_groups)] {
            let out_p = p.poisoned((rows * c.hq * c.d) as usize * 2);
            let launch = |o: &Ops, at: At<'_>| {
                let params = PagedAttention {
                    out: at(&out_p),
                    ..params(at)
                };
                o.paged_attention_prompt(S, &params, at(at_groups), count)
            };
            if outs.is_empty() {
                p.run(launch);
                p.check_bf16("paged_attention_prompt", label, &out_p, Tolerance::BF16);
            } else {
                p.run_gpu(launch);
            }
            outs.push(p.download_gpu::<u16>(&out_p));
        }
        assert!(
            outs[0] == outs[1],
            "paged_attention_prompt {label}: {} prompt row groups and {n_groups} unit groups give \
             different rows",
            plan.prompt
        );
        let decode: Vec<bf16> = gpu_want.iter().map(|&b| bf16::from_bits(b)).collect();
        let prompt: Vec<bf16> = outs[0].iter().map(|&b| bf16::from_bits(b)).collect();
        compare(
            "paged_attention_prompt",
            &format!("{label}, against paged_attention"),
            &widen(&prompt),
            &widen(&decode),
            Tolerance::BF16,
        );
        println!(
            "kernel-check {:<18} {:<44} bitwise over {} prompt and {n_groups} unit row groups",
            "paged_attention_prompt", label, plan.prompt
        );
    }
    gpu_want
}
