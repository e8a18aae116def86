//! Loading one tensor-parallel rank's shard of each layer (`shard.rs` says which part of each
//! weight a rank holds): every weight read through a `TensorSlice` of the memory-mapped
//! checkpoint, so a rank reads and holds on the host only its own part. Fused projections are
//! sliced part by part (q, k, v; gate, up; the GDN projection's q, k, v, z, b, a), never as one
//! matrix, so each rank's fused weight has the layout the layers expect at its local sizes.

use std::ops::Range;

use metrale_config::{ModelConfig, ModelFamily};
use metrale_model_layers::layers::{
    Attention, GatedDeltaNet, InProjSource, Mlp, MoeMlp, MoeShape, SharedExpert,
};
use metrale_model_layers::weight_map::{
    DenseWeight, ExpertNames, GdnProjectionNames, LayerNames, TensorSlice,
};

use super::Loader;
use super::layers::{gdn_spec, moe_settings, unsupported};
use super::shard::RankShard;
use crate::error::ModelError;

/// `range` of units of `width` elements each, as an element range.
fn scaled(range: &Range<usize>, width: usize) -> Range<usize> {
    range.start * width..range.end * width
}

/// `range` moved by `by`.
fn shifted(range: Range<usize>, by: usize) -> Range<usize> {
    range.start + by..range.end + by
}

/// Rows `rows` of tensor `name` of shape `shape`, a part of a fused weight.
fn rows<'a>(
    name: &'a str,
    shape: &'a [usize],
    rows: Vec<Range<usize>>,
) -> (&'a str, &'a [usize], TensorSlice) {
    (name, shape, TensorSlice::rows(shape, rows))
}

/// A column-parallel projection's rows: `parts` (each tensor's row ranges) concatenated,
/// `[sum of rows, k]`.
fn column_parallel(
    loader: &Loader<'_>,
    parts: &[(&str, &[usize], TensorSlice)],
    k: usize,
) -> Result<DenseWeight, ModelError> {
    let n = parts.iter().map(|(_, _, s)| s.num_rows()).sum();
    Ok(loader.upload_bf16_slices(parts, vec![n, k])?)
}

/// A row-parallel projection `[n, k]`: columns `cols` of every row.
fn row_parallel(
    loader: &Loader<'_>,
    name: &str,
    (n, k): (usize, usize),
    cols: Range<usize>,
) -> Result<DenseWeight, ModelError> {
    let width = cols.len();
    let slice = TensorSlice::cols(&[n, k], cols);
    Ok(loader.upload_bf16_slices(&[(name, &[n, k], slice)], vec![n, width])?)
}

/// A replicated vector or matrix, read whole.
fn whole(loader: &Loader<'_>, name: &str, shape: &[usize]) -> Result<DenseWeight, ModelError> {
    Ok(loader.upload_bf16(name, shape)?)
}

/// Rank `sh`'s shard of a full-attention layer.
pub fn attention(
    loader: &Loader<'_>,
    c: &ModelConfig,
    n: &LayerNames,
    sh: RankShard,
) -> Result<Attention, ModelError> {
    let a = &c.attention;
    let (h, hq, hkv, d) = (
        c.hidden_size,
        a.num_attention_heads,
        a.num_key_value_heads,
        a.head_dim,
    );
    // A gated query head is `[q_h | gate_h]`: its rows follow each other.
    let q_width = if a.attn_output_gate { 2 * d } else { d };
    let (qh, kvh) = (sh.split(hq), sh.grouped(hkv));
    let (q, k, v) = (n.q_proj(), n.k_proj(), n.v_proj());
    let (q_shape, kv_shape) = ([hq * q_width, h], [hkv * d, h]);
    let qkv = column_parallel(
        loader,
        &[
            rows(&q, &q_shape, vec![scaled(&qh, q_width)]),
            rows(&k, &kv_shape, vec![scaled(&kvh, d)]),
            rows(&v, &kv_shape, vec![scaled(&kvh, d)]),
        ],
        h,
    )?;
    let (q_norm, k_norm) = if c.family == ModelFamily::Llama {
        (None, None)
    } else {
        (
            Some(whole(loader, &n.q_norm(), &[d])?),
            Some(whole(loader, &n.k_norm(), &[d])?),
        )
    };
    Ok(Attention {
        qkv,
        q_norm,
        k_norm,
        o_proj: row_parallel(loader, &n.o_proj(), (h, hq * d), scaled(&qh, d))?,
    })
}

/// Rank `sh`'s shard of a dense SwiGLU MLP.
pub fn mlp(
    loader: &Loader<'_>,
    c: &ModelConfig,
    n: &LayerNames,
    sh: RankShard,
) -> Result<Mlp, ModelError> {
    let (h, f) = (c.hidden_size, c.intermediate_size);
    let mine = sh.split(f);
    let (gate, up) = (n.mlp_gate_proj(), n.mlp_up_proj());
    let shape = [f, h];
    Ok(Mlp {
        gate_up: column_parallel(
            loader,
            &[
                rows(&gate, &shape, vec![mine.clone()]),
                rows(&up, &shape, vec![mine.clone()]),
            ],
            h,
        )?,
        down: row_parallel(loader, &n.mlp_down_proj(), (h, f), mine.clone())?,
        ffn: mine.len() as u32,
    })
}

/// Rank `sh`'s shard of a Gated DeltaNet mixer: its value heads, the key heads they read, and
/// the conv channels, gates and state of those heads.
pub fn gdn(
    loader: &Loader<'_>,
    c: &ModelConfig,
    n: &LayerNames,
    sh: RankShard,
) -> Result<GatedDeltaNet, ModelError> {
    let (global, names) = gdn_spec(c, n)?;
    let hd = global.heads;
    let (h, kernel) = (c.hidden_size, global.conv_kernel as usize);
    let (dk, dv, vh_total) = (
        hd.k_head_dim as usize,
        hd.v_head_dim as usize,
        hd.num_v_heads as usize,
    );
    let (key_dim, value_dim) = (hd.key_dim() as usize, hd.value_dim() as usize);
    let conv_dim = 2 * key_dim + value_dim;
    let (kh, vh) = (sh.grouped(hd.num_k_heads as usize), sh.split(vh_total));
    // The rank's rows of the engine's projection layout `[q | k | v | z | b | a]`, part by part.
    let q = scaled(&kh, dk);
    let k = shifted(q.clone(), key_dim);
    let v = shifted(scaled(&vh, dv), 2 * key_dim);
    let z = shifted(scaled(&vh, dv), conv_dim);
    let b = shifted(vh.clone(), conv_dim + value_dim);
    let a = shifted(vh.clone(), conv_dim + value_dim + vh_total);
    let local_rows = 2 * q.len() + v.len() + z.len() + b.len() + a.len();
    let in_proj = match &names.projections {
        GdnProjectionNames::Split {
            in_proj_qkv,
            in_proj_z,
            in_proj_b,
            in_proj_a,
        } => {
            let (qkv_shape, z_shape, ba_shape) = ([conv_dim, h], [value_dim, h], [vh_total, h]);
            let back = |r: &Range<usize>, by: usize| r.start - by..r.end - by;
            column_parallel(
                loader,
                &[
                    rows(
                        in_proj_qkv,
                        &qkv_shape,
                        vec![q.clone(), k.clone(), v.clone()],
                    ),
                    rows(in_proj_z, &z_shape, vec![back(&z, conv_dim)]),
                    rows(in_proj_b, &ba_shape, vec![back(&b, conv_dim + value_dim)]),
                    rows(
                        in_proj_a,
                        &ba_shape,
                        vec![back(&a, conv_dim + value_dim + vh_total)],
                    ),
                ],
                h,
            )?
        }
        GdnProjectionNames::Fused {
            in_proj_qkvz,
            in_proj_ba,
        } => {
            // Qwen3-Next groups its projection per key head; `qwen3_next_in_proj_rows` maps
            // each row of the engine's layout to its source row, and the rank reads those of
            // its own rows, runs of consecutive source rows at a time.
            let sources = global.qwen3_next_in_proj_rows();
            let (mut qkvz_rows, mut ba_rows) = (Vec::new(), Vec::new());
            for part in [&q, &k, &v, &z, &b, &a] {
                for row in part.clone() {
                    match sources.get(row) {
                        Some(InProjSource::Qkvz(i)) => push_row(&mut qkvz_rows, *i),
                        Some(InProjSource::Ba(i)) => push_row(&mut ba_rows, *i),
                        None => return Err(unsupported("a GDN projection row past its layout")),
                    }
                }
            }
            // The rows are in engine order within each source; the engine layout keeps every
            // qkvz row ahead of every ba row, so the two reads concatenate to it.
            let (qkvz_shape, ba_shape) = ([2 * key_dim + 2 * value_dim, h], [2 * vh_total, h]);
            column_parallel(
                loader,
                &[
                    rows(in_proj_qkvz, &qkvz_shape, qkvz_rows),
                    rows(in_proj_ba, &ba_shape, ba_rows),
                ],
                h,
            )?
        }
    };
    if in_proj.shape[0] != local_rows {
        return Err(unsupported(
            "a GDN projection whose shard does not fit its layout",
        ));
    }
    let conv_shape = [conv_dim, 1, kernel];
    let conv_rows = TensorSlice::rows(&conv_shape, vec![q.clone(), k.clone(), v.clone()]);
    let local_conv = conv_rows.num_rows();
    let vector = |name: &str| {
        let slice = TensorSlice::rows(&[vh_total], vec![vh.clone()]);
        loader.upload_f32_slice(name, &[vh_total], &slice, vec![vh.len()])
    };
    let mut shape = global;
    shape.heads.num_k_heads = kh.len() as u32;
    shape.heads.num_v_heads = vh.len() as u32;
    // Shards are bf16 (FP8 models are not sharded), so the input projection is one fused GEMM.
    Ok(GatedDeltaNet {
        in_proj,
        in_proj_ba: None,
        conv1d: loader.upload_bf16_slices(
            &[(names.conv1d.as_str(), &conv_shape, conv_rows)],
            vec![local_conv, 1, kernel],
        )?,
        a_log: vector(&names.a_log)?,
        dt_bias: vector(&names.dt_bias)?,
        norm: whole(loader, &names.norm, &[dv])?,
        out_proj: row_parallel(loader, &names.out_proj, (h, value_dim), scaled(&vh, dv))?,
        shape,
    })
}

/// Append row `i` to `ranges`, extending the last range when it ends at `i`.
fn push_row(ranges: &mut Vec<Range<usize>>, i: usize) {
    match ranges.last_mut() {
        Some(r) if r.end == i => r.end += 1,
        _ => ranges.push(i..i + 1),
    }
}

/// Rank `sh`'s shard of a sparse-MoE FFN: every expert and the shared expert at its slice of
/// their width (tensor-parallel experts), the router and the shared gate whole.
pub fn moe(
    loader: &Loader<'_>,
    c: &ModelConfig,
    n: &LayerNames,
    sh: RankShard,
) -> Result<MoeMlp, ModelError> {
    let (global, cfg) = moe_settings(c)?;
    let names = n.moe();
    let (h, e, f) = (c.hidden_size, cfg.num_experts, cfg.moe_intermediate_size);
    let mine = sh.split(f);
    let fl = mine.len();
    let (experts_gate_up, experts_down) = match &names.experts {
        ExpertNames::PerExpert(list) => {
            let (fh, hf) = ([f, h], [h, f]);
            let mut gu = Vec::with_capacity(2 * e);
            let mut down = Vec::with_capacity(e);
            for x in list {
                gu.push(rows(&x.gate_proj, &fh, vec![mine.clone()]));
                gu.push(rows(&x.up_proj, &fh, vec![mine.clone()]));
                down.push((
                    x.down_proj.as_str(),
                    &hf[..],
                    TensorSlice::cols(&hf, mine.clone()),
                ));
            }
            (
                loader.upload_bf16_slices(&gu, vec![e, 2 * fl, h])?,
                loader.upload_bf16_slices(&down, vec![e, h, fl])?,
            )
        }
        ExpertNames::Fused {
            gate_up_proj,
            down_proj,
        } => {
            let gu_shape = [e, 2 * f, h];
            let gu_rows = (0..e)
                .flat_map(|x| {
                    [
                        shifted(mine.clone(), x * 2 * f),
                        shifted(mine.clone(), x * 2 * f + f),
                    ]
                })
                .collect();
            let down_shape = [e, h, f];
            (
                loader.upload_bf16_slices(
                    &[rows(gate_up_proj, &gu_shape, gu_rows)],
                    vec![e, 2 * fl, h],
                )?,
                loader.upload_bf16_slices(
                    &[(
                        down_proj.as_str(),
                        &down_shape,
                        TensorSlice::cols(&down_shape, mine.clone()),
                    )],
                    vec![e, h, fl],
                )?,
            )
        }
    };
    let fs = cfg.shared_expert_intermediate_size;
    let shared = if fs > 0 && loader.source.contains(&names.shared_expert.gate_proj) {
        let s = &names.shared_expert;
        let shared_mine = sh.split(fs);
        let shape = [fs, h];
        Some(SharedExpert {
            gate_up: column_parallel(
                loader,
                &[
                    rows(&s.gate_proj, &shape, vec![shared_mine.clone()]),
                    rows(&s.up_proj, &shape, vec![shared_mine.clone()]),
                ],
                h,
            )?,
            down: row_parallel(loader, &s.down_proj, (h, fs), shared_mine.clone())?,
            gate: if loader.source.contains(&names.shared_expert_gate) {
                Some(whole(loader, &names.shared_expert_gate, &[1, h])?)
            } else {
                None
            },
            ffn: shared_mine.len() as u32,
        })
    } else {
        None
    };
    Ok(MoeMlp {
        router: whole(loader, &names.router, &[e, h])?,
        experts_gate_up,
        experts_down,
        shared,
        shape: MoeShape {
            expert_ffn: fl as u32,
            ..global
        },
    })
}
