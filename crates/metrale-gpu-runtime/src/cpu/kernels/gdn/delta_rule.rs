//! The gated delta rule over each sequence's rows, updating its recurrent state in place: the
//! token-by-token recurrence (decode, and the reference) and the chunked WY form (prefill), as
//! transformers' `torch_recurrent_gated_delta_rule` and `torch_chunk_gated_delta_rule`; and the
//! verify form of speculative decoding, the recurrence keeping the state after every row.
//!
//! Per value head `j` with state `S: [Dk, Dv]`, a token `(q̂, k̂, v, β, g)` does
//! `S ← e^g·S; S ← S + k̂·(β(v − Sᵀk̂))ᵀ; o = Sᵀq̂`.
//!
//! Invariants:
//! - Chunks are aligned to absolute positions: a chunk holds the sequence's rows whose positions
//!   fall in one `[m·chunk_size, (m+1)·chunk_size)`. A prefill split at a multiple of the chunk
//!   size therefore computes bitwise what the unsplit prefill does.
//! - A chunk of one row runs the recurrent step itself, so a decode row gives bitwise the same
//!   result through either kernel, and a sequence's result never depends on which kernel the
//!   step's other sequences needed.

use half::bf16;
use metrale_kernel_abi::{GatedDeltaChunkedParams, GatedDeltaParams, GatedDeltaVerifyParams};

use super::{Heads, NO_SLOT, Seqs, check_stride, read_row_slots};
use crate::cpu::KernelCtx;
use crate::cpu::kernels::util::f;
use crate::error::GpuResult;
use crate::types::DevicePtr;

/// The step's per-row inputs of the rule.
struct Inputs<'a> {
    h: Heads,
    qk: &'a [f32],
    conv: &'a [bf16],
    gates: &'a [f32],
}

impl Inputs<'_> {
    fn q(&self, r: usize, j: usize) -> &[f32] {
        let at = r * 2 * self.h.key_dim() + self.h.key_head(j) * self.h.dk;
        &self.qk[at..at + self.h.dk]
    }
    fn k(&self, r: usize, j: usize) -> &[f32] {
        let at = r * 2 * self.h.key_dim() + self.h.key_dim() + self.h.key_head(j) * self.h.dk;
        &self.qk[at..at + self.h.dk]
    }
    /// Value head `j` of row `r`, widened into `v`.
    fn v(&self, r: usize, j: usize, v: &mut [f32]) {
        let at = r * self.h.conv_dim() + 2 * self.h.key_dim() + j * self.h.dv;
        for (o, &e) in v.iter_mut().zip(&self.conv[at..at + self.h.dv]) {
            *o = f(e);
        }
    }
    fn beta(&self, r: usize, j: usize) -> f32 {
        self.gates[r * 2 * self.h.hv + j]
    }
    fn g(&self, r: usize, j: usize) -> f32 {
        self.gates[r * 2 * self.h.hv + self.h.hv + j]
    }
}

/// The arguments both kernels share, read from the launch.
struct Launch<'a> {
    rows: usize,
    stride: usize,
    out: &'a mut [f32],
    state: &'a mut [f32],
    inputs: Inputs<'a>,
    seqs: Seqs<'a>,
}

/// The operands and scalars the three rule kernels share.
#[derive(Debug, Clone, Copy)]
struct RuleArgs {
    out: DevicePtr,
    state: DevicePtr,
    qk: DevicePtr,
    conv: DevicePtr,
    gates: DevicePtr,
    seqs: (DevicePtr, DevicePtr),
    rows: usize,
    num_seqs: usize,
    num_slots: usize,
    stride: usize,
    heads: (u32, u32, u32, u32),
}

macro_rules! rule_args {
    ($p:expr) => {
        RuleArgs {
            out: $p.out,
            state: $p.state,
            qk: $p.qk,
            conv: $p.conv,
            gates: $p.gates,
            seqs: ($p.seq_start, $p.seq_slot),
            rows: $p.rows as usize,
            num_seqs: $p.num_seqs as usize,
            num_slots: $p.num_slots as usize,
            stride: $p.slot_stride as usize,
            heads: ($p.hk, $p.dk, $p.hv, $p.dv),
        }
    };
}

/// The heads, checked against the slot stride.
fn rule_heads(ctx: &KernelCtx<'_>, a: &RuleArgs) -> GpuResult<Heads> {
    let h = Heads::new(ctx, a.heads)?;
    check_stride(ctx, a.stride, h.hv * h.dk * h.dv)?;
    Ok(h)
}

/// The step's inputs of the rule.
fn rule_inputs<'a>(ctx: &'a KernelCtx<'a>, a: &RuleArgs, h: Heads) -> GpuResult<Inputs<'a>> {
    Ok(Inputs {
        h,
        qk: ctx.slice::<f32>("qk", a.qk, a.rows * 2 * h.key_dim())?,
        conv: ctx.slice::<bf16>("conv", a.conv, a.rows * h.conv_dim())?,
        gates: ctx.slice::<f32>("gates", a.gates, a.rows * 2 * h.hv)?,
    })
}

/// The slices of a launch that updates each sequence's state in place.
fn read_launch<'a>(ctx: &'a KernelCtx<'a>, a: RuleArgs) -> GpuResult<Launch<'a>> {
    let h = rule_heads(ctx, &a)?;
    Ok(Launch {
        rows: a.rows,
        stride: a.stride,
        out: ctx.slice_mut::<f32>("out", a.out, a.rows * h.value_dim())?,
        state: ctx.slice_mut::<f32>("state", a.state, a.num_slots * a.stride)?,
        inputs: rule_inputs(ctx, &a, h)?,
        seqs: Seqs::read(ctx, a.seqs, a.rows, a.num_seqs, a.num_slots, true)?,
    })
}

impl Launch<'_> {
    /// Run `body(head_state, j, rows)` for every sequence and value head, on the slot's state
    /// (or a zero state for a padding sequence, discarded after).
    fn for_each_head(
        &mut self,
        mut body: impl FnMut(&mut [f32], &mut [f32], &Inputs<'_>, usize, std::ops::Range<usize>),
    ) {
        let h = self.inputs.h;
        let per_head = h.dk * h.dv;
        let mut scratch = vec![0.0f32; per_head];
        for s in 0..self.seqs.len() {
            let range = self.seqs.rows(s);
            let slot = self.seqs.slot(s);
            for j in 0..h.hv {
                let st: &mut [f32] = match slot {
                    Some(sl) => {
                        let at = sl * self.stride + j * per_head;
                        &mut self.state[at..at + per_head]
                    }
                    None => {
                        scratch.fill(0.0);
                        &mut scratch
                    }
                };
                body(st, self.out, &self.inputs, j, range.clone());
            }
        }
    }
}

/// Scratch of one head's token step.
struct Token {
    v: Vec<f32>,
    delta: Vec<f32>,
}

/// One token of the rule on one head's state `s: [Dk, Dv]`; writes `o: [Dv]`. Every sum runs
/// over `c` (the key dim) in ascending order, in f32.
fn recurrent_step(
    s: &mut [f32],
    inp: &Inputs<'_>,
    r: usize,
    j: usize,
    t: &mut Token,
    o: &mut [f32],
) {
    let (dk, dv) = (inp.h.dk, inp.h.dv);
    let (q, k) = (inp.q(r, j), inp.k(r, j));
    inp.v(r, j, &mut t.v);
    let (beta, decay) = (inp.beta(r, j), inp.g(r, j).exp());
    for e in s.iter_mut() {
        *e *= decay;
    }
    for d in 0..dv {
        let mut kv = 0.0f32;
        for c in 0..dk {
            kv += s[c * dv + d] * k[c];
        }
        t.delta[d] = (t.v[d] - kv) * beta;
    }
    for c in 0..dk {
        for d in 0..dv {
            s[c * dv + d] += k[c] * t.delta[d];
        }
    }
    for d in 0..dv {
        let mut acc = 0.0f32;
        for c in 0..dk {
            acc += s[c * dv + d] * q[c];
        }
        o[d] = acc;
    }
}

/// `gated_delta_recurrent` ([`GatedDeltaParams`]).
///
/// Each sequence's rows in order, one token step each (see the module header); `v` is read from
/// the conv output at `2*key_dim + j*Dv`, q̂ and k̂ from `qk`, β and g from `gates`. Work unit:
/// one (sequence, value head).
pub fn gated_delta_recurrent(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    let p: GatedDeltaParams = ctx.params()?;
    let mut l = read_launch(ctx, rule_args!(p))?;
    let h = l.inputs.h;
    let mut tok = Token {
        v: vec![0.0; h.dv],
        delta: vec![0.0; h.dv],
    };
    let vd = h.value_dim();
    l.for_each_head(|st, out, inp, j, rows| {
        for r in rows {
            let o = &mut out[r * vd + j * h.dv..r * vd + (j + 1) * h.dv];
            recurrent_step(st, inp, r, j, &mut tok, o);
        }
    });
    Ok(())
}

/// `gated_delta_verify` ([`GatedDeltaVerifyParams`]).
///
/// The verify step of speculative decoding: each sequence's rows run token by token from the
/// state in `seq_slot` (zeros for padding), every row computed bitwise as
/// `gated_delta_recurrent` computes it, and after row `r` the state is written to `row_slot[r]`
/// (nothing for `NO_SLOT`). The sequence's own slot is only read, unless a row names it: a work
/// unit reads its input state before it writes any row's (see `read_row_slots` for what else is
/// refused). Work unit: one (sequence, value head).
pub fn gated_delta_verify(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    let p: GatedDeltaVerifyParams = ctx.params()?;
    let a = rule_args!(p);
    let (rows, num_slots, stride) = (a.rows, a.num_slots, a.stride);
    let h = rule_heads(ctx, &a)?;
    let out = ctx.slice_mut::<f32>("out", a.out, rows * h.value_dim())?;
    let state = ctx.slice_mut::<f32>("state", a.state, num_slots * stride)?;
    let inputs = rule_inputs(ctx, &a, h)?;
    let seqs = Seqs::read(ctx, a.seqs, rows, a.num_seqs, num_slots, false)?;
    let row_slot = read_row_slots(ctx, p.row_slot, rows, &seqs, num_slots)?;
    let (per_head, vd) = (h.dk * h.dv, h.value_dim());
    let mut head = vec![0.0f32; per_head];
    let mut tok = Token {
        v: vec![0.0; h.dv],
        delta: vec![0.0; h.dv],
    };
    for s in 0..seqs.len() {
        for j in 0..h.hv {
            match seqs.slot(s) {
                Some(sl) => {
                    let at = sl * stride + j * per_head;
                    head.copy_from_slice(&state[at..at + per_head]);
                }
                None => head.fill(0.0),
            }
            for r in seqs.rows(s) {
                let o = &mut out[r * vd + j * h.dv..r * vd + (j + 1) * h.dv];
                recurrent_step(&mut head, &inputs, r, j, &mut tok, o);
                if row_slot[r] != NO_SLOT {
                    let at = row_slot[r] as usize * stride + j * per_head;
                    state[at..at + per_head].copy_from_slice(&head);
                }
            }
        }
    }
    Ok(())
}

/// `Σ a_i b_i` in f32, `i` ascending.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = 0.0f32;
    for (x, y) in a.iter().zip(b) {
        acc += x * y;
    }
    acc
}

/// Scratch of one chunk: cumulative decay, the two triangular solves and the new values.
struct Chunk {
    cum: Vec<f32>,
    u: Vec<f32>,
    w: Vec<f32>,
    kb: Vec<f32>,
    vnew: Vec<f32>,
    tok: Token,
}

/// One chunk of `rows` (at least two) on one head's state, in the WY form of transformers'
/// `torch_chunk_gated_delta_rule`, with `G_i = Σ_{m≤i} g_m` (in order) and `A[i][j] = (β_i k̂_i ·
/// k̂_j) e^{G_i − G_j}` for `j < i`:
/// 1. `u_i = β_i v_i − Σ_{j<i} A[i][j] u_j`, `w_i = β_i e^{G_i} k̂_i − Σ_{j<i} A[i][j] w_j`
///    (forward substitution, `j` ascending);
/// 2. `v'_i = u_i − Sᵀ w_i`;
/// 3. `o_i = Sᵀ(e^{G_i} q̂_i) + Σ_{j≤i} (q̂_i · k̂_j) e^{G_i − G_j} v'_j` (`j` ascending);
/// 4. `S ← e^{G_last} S + Σ_j (e^{G_last − G_j} k̂_j) v'_jᵀ` (`j` ascending).
fn chunk_step(
    s: &mut [f32],
    inp: &Inputs<'_>,
    rows: std::ops::Range<usize>,
    j: usize,
    c: &mut Chunk,
    out: &mut [f32],
) {
    let (dk, dv, vd) = (inp.h.dk, inp.h.dv, inp.h.value_dim());
    let n = rows.len();
    let base = rows.start;
    let mut acc_g = 0.0f32;
    for i in 0..n {
        acc_g += inp.g(base + i, j);
        c.cum[i] = acc_g;
    }
    for i in 0..n {
        let r = base + i;
        let (k, beta, eg) = (inp.k(r, j), inp.beta(r, j), c.cum[i].exp());
        inp.v(r, j, &mut c.tok.v);
        for (x, &kx) in k.iter().enumerate() {
            c.kb[i * dk + x] = kx * beta;
            c.w[i * dk + x] = kx * beta * eg;
        }
        for d in 0..dv {
            c.u[i * dv + d] = c.tok.v[d] * beta;
        }
        for m in 0..i {
            let a =
                dot(&c.kb[i * dk..(i + 1) * dk], inp.k(base + m, j)) * (c.cum[i] - c.cum[m]).exp();
            for d in 0..dv {
                c.u[i * dv + d] -= a * c.u[m * dv + d];
            }
            for x in 0..dk {
                c.w[i * dk + x] -= a * c.w[m * dk + x];
            }
        }
    }
    for i in 0..n {
        for d in 0..dv {
            let mut sw = 0.0f32;
            for x in 0..dk {
                sw += c.w[i * dk + x] * s[x * dv + d];
            }
            c.vnew[i * dv + d] = c.u[i * dv + d] - sw;
        }
    }
    for i in 0..n {
        let r = base + i;
        let q = inp.q(r, j);
        let eg = c.cum[i].exp();
        let o = &mut out[r * vd + j * dv..r * vd + (j + 1) * dv];
        for d in 0..dv {
            let mut acc = 0.0f32;
            for x in 0..dk {
                acc += q[x] * eg * s[x * dv + d];
            }
            o[d] = acc;
        }
        for m in 0..=i {
            let a = dot(q, inp.k(base + m, j)) * (c.cum[i] - c.cum[m]).exp();
            for (od, &vn) in o.iter_mut().zip(&c.vnew[m * dv..(m + 1) * dv]) {
                *od += a * vn;
            }
        }
    }
    let last = c.cum[n - 1];
    let chunk_decay = last.exp();
    for e in s.iter_mut() {
        *e *= chunk_decay;
    }
    for m in 0..n {
        let km = inp.k(base + m, j);
        let dm = (last - c.cum[m]).exp();
        for x in 0..dk {
            let kx = km[x] * dm;
            for d in 0..dv {
                s[x * dv + d] += kx * c.vnew[m * dv + d];
            }
        }
    }
}

/// `gated_delta_chunked` ([`GatedDeltaChunkedParams`]).
///
/// The same function as `gated_delta_recurrent`, computed chunk by chunk (see `chunk_step`);
/// chunks are aligned to positions that are multiples of `chunk_size` (64 for these families)
/// and a one-row chunk runs the recurrent step. Positions of a sequence's rows must be
/// consecutive. Work unit: one (sequence, value head), walking its chunks in order.
pub fn gated_delta_chunked(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    let p: GatedDeltaChunkedParams = ctx.params()?;
    let chunk = p.chunk_size as usize;
    if chunk == 0 {
        return Err(ctx.fail("chunk_size must be positive"));
    }
    let mut l = read_launch(ctx, rule_args!(p))?;
    let positions = ctx.slice::<u32>("positions", p.positions, l.rows)?;
    for s in 0..l.seqs.len() {
        let range = l.seqs.rows(s);
        for r in range.clone().skip(1) {
            if positions[r] != positions[r - 1].wrapping_add(1) {
                return Err(ctx.fail(format!(
                    "sequence {s}: row {r} has position {} after {}",
                    positions[r],
                    positions[r - 1]
                )));
            }
        }
    }
    let h = l.inputs.h;
    let mut c = Chunk {
        cum: vec![0.0; chunk],
        u: vec![0.0; chunk * h.dv],
        w: vec![0.0; chunk * h.dk],
        kb: vec![0.0; chunk * h.dk],
        vnew: vec![0.0; chunk * h.dv],
        tok: Token {
            v: vec![0.0; h.dv],
            delta: vec![0.0; h.dv],
        },
    };
    let vd = h.value_dim();
    l.for_each_head(|st, out, inp, j, rows| {
        let mut r = rows.start;
        while r < rows.end {
            let room = chunk - positions[r] as usize % chunk;
            let n = room.min(rows.end - r);
            if n == 1 {
                let o = &mut out[r * vd + j * h.dv..r * vd + (j + 1) * h.dv];
                recurrent_step(st, inp, r, j, &mut c.tok, o);
            } else {
                chunk_step(st, inp, r..r + n, j, &mut c, out);
            }
            r += n;
        }
    });
    Ok(())
}
