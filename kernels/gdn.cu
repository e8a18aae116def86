// The Gated DeltaNet token mixer of the Qwen3.5 / Qwen3-Next families. CPU twins (the reference,
// with the argument lists, layouts and semantics): metrale-gpu-runtime/src/cpu/kernels/gdn.rs
// and gdn/delta_rule.rs.
//
// Head scalars, as every kernel here takes them: Hk (num_k_heads), Dk, Hv, Dv; key_dim = Hk*Dk,
// value_dim = Hv*Dv, conv_dim = 2*key_dim + value_dim, proj_width = conv_dim + value_dim + 2*Hv.
// The input projection's rows: q|k|v|z of row r at r * proj_stride (conv channels first, z at
// conv_dim), its b then a at ba_offset + r * ba_stride. One fused GEMM writes [rows, proj_width]
// (proj_stride = ba_stride = proj_width, ba_offset = conv_dim + value_dim); an FP8 layer's two
// GEMMs write [rows, conv_dim + value_dim] and then [rows, 2*Hv] (proj_stride = conv_dim +
// value_dim, ba_offset = rows * proj_stride, ba_stride = 2*Hv).
// A sequence whose slot is u32::MAX (padding) reads zero states and writes none; a slot past
// num_slots writes NaN outputs, leaves every state alone and reports an INDEX fault
// (`mt_fault`), as does a row slot past num_slots; a shape a kernel does not take reports a
// SHAPE fault. The CPU twins refuse the same launches.
//
// Launch geometry (ops_hybrid.rs builds it from shapes only):
// - causal_conv1d: grid (rows, ceil(conv_dim / T)), T threads, one thread per (row, channel).
// - conv_state_update: grid (num_seqs, ceil(conv_dim / T)), one thread per (sequence, channel).
// - gdn_prepare: one block per row, a warp per (q or k) head, threads over the gates.
// - gated_delta_recurrent / gated_delta_chunked: grid (num_seqs, Hv * G), 32 * WB threads,
//   where a head's Dv columns are cut into W = ceil(Dv / 16) warp tiles of 16 columns, WB warps
//   per block and G = ceil(W / WB) blocks per (sequence, value head); gated_delta_chunked also
//   WB * GDN_RING * GDN_TOK_BYTES of dynamic shared memory (the prefill ring).
// - gated_delta_streamed: grid (min(num_seqs * Hv, resident blocks)), 32 * ceil(Dv / 16)
//   threads (a warp per warp tile of a whole value head), GDN_STREAM_BARS + 2 head states of
//   dynamic shared memory (one where two would not fit).
// - gated_rms_norm: grid (rows, Hv), one warp per (row, value head).
// - conv_state_verify: as conv_state_update. gated_delta_verify: as gated_delta_recurrent.
//
// Verify steps (speculative decoding): conv_state_verify and gated_delta_verify take the step's
// row_slot (u32 [rows]) and write the window / recurrent state after each row r to slot
// row_slot[r] (none for u32::MAX), reading the sequence's own slot (seq_slot) and writing it only
// where a row names it; each thread reads all of its input state before it writes any row's, so
// a row may name its own sequence's slot. Every row is computed bitwise as the decode kernels
// compute it. A row slot past num_slots is skipped (and reported, as above).
//
// The delta rule. The columns d of a head's state S[c][d] (c < Dk, d < Dv) evolve independently:
// a token needs only column d of S, k̂, q̂ and v[d]. So a warp owns 16 columns for all Dk rows and
// a whole sequence's rows, with no barrier and no shared memory: lane (rl = lane / 4,
// cq = lane % 4) holds rows rl*RPT .. rl*RPT+RPT-1 and columns 4cq .. 4cq+3 of its tile in
// registers (RPT = 4, 8 or 16, the smallest with 8*RPT >= Dk; 16 for Dk = 128: 64 floats),
// loaded and stored once per launch as 16-byte vectors (each row's 16 columns are 64 contiguous
// bytes). Per token, the sums over c are a per-lane chain over its rows (ascending) and then an
// xor butterfly over the 8 row lanes, which leaves bitwise the same value in all of them. The
// chunked kernel streams the rows' q̂, k̂, v, β, g through a per-warp ring in shared memory,
// GDN_RING - 1 rows ahead (`rule_warp_ring`); the recurrent and verify kernels (and the chunked
// one launched without the ring's shared memory) load each row when they need it. This "fast"
// path needs Dk % 4 == 0, Dv % 4 == 0, Dk <= 128, slot_stride % 4 == 0 and 16-byte aligned state,
// qk and out; otherwise a thread per column keeps its column in a local array (Dk <= 256; above
// that the outputs are NaN) and sums over c in ascending order. Both paths use only explicit fmaf for
// multiply-adds, so no contraction choice of the compiler can make the two kernels differ.
//
// gated_delta_chunked runs the same recurrence row by row (the chunked WY form of the CPU twin is
// mathematically the same function): every row, and in particular a one-row chunk, is computed
// bitwise as gated_delta_recurrent computes it, whatever the chunking; positions and chunk_size
// are accepted but not needed. A tensor-core WY form for long prefills is future work.
//
// Determinism and batch invariance: every output and state element is computed by a fixed
// thread layout from its own sequence's rows and state only, in a fixed order.
#include "common.cuh"

// Largest Dk of the general delta-rule path, and of the fast one.
// Columns of a head per warp of the delta-rule kernels.

MT_DEVICE float f32_nan() { return __int_as_float(0x7FFFFFFF); }

// ---------------------------------------------------------------------------------------------
// Causal conv.

// The conv window of sequence `s`: its slot's state, NULL for a padding sequence (zero window);
// `bad` when the slot is past the pool.
MT_DEVICE const float* conv_window(const float* state, uint32_t slot, uint32_t num_slots,
                                   uint32_t stride, bool& bad) {
    bad = false;
    if (slot == GDN_NO_SLOT) return nullptr;
    if (slot >= num_slots) {
        bad = true;
        return nullptr;
    }
    return state + (size_t)slot * stride;
}

// causal_conv1d(out: bf16 [rows, conv_dim], proj: bf16 (see above), conv_state: f32
// [num_slots * slot_stride], weight: bf16 [conv_dim, K], row_seq: u32 [rows], seq_start: u32
// [num_seqs + 1], seq_slot: u32 [num_seqs], rows, num_seqs, num_slots, slot_stride, Hk, Dk, Hv,
// Dv, kernel_size, proj_stride). out[r][c] = silu(Σ_i weight[c][i] * x(t - (K-1) + i)) in f32, x(u) from the
// step's rows for u >= 0 and from the window (zero for padding) for u < 0.
extern "C" __global__ void causal_conv1d(CAUSAL_CONV1D_PARAMS) {
    pdl_wait();  // a programmatic dependent (ops): the kernel ahead has finished
    pdl_trigger();
    const uint32_t cd = 2 * hk * dk + hv * dv;
    const uint32_t pw = proj_stride;
    const uint32_t r = blockIdx.x;
    const uint32_t c = blockIdx.y * blockDim.x + threadIdx.x;
    if (r >= rows || c >= cd) return;
    bf16* o = out + (size_t)r * cd + c;
    const uint32_t s = row_seq[r];
    const bool shape_bad = kernel_size == 0 || pw < cd;
    if (s >= num_seqs || shape_bad) {
        mt_fault(MT_KERNEL_CAUSAL_CONV1D, shape_bad ? MT_FAULT_SHAPE : MT_FAULT_INDEX);
        *o = bf16_nan();
        return;
    }
    const uint32_t first = seq_start[s];
    if (r < first || r >= seq_start[s + 1]) {
        mt_fault(MT_KERNEL_CAUSAL_CONV1D, MT_FAULT_INDEX);
        *o = bf16_nan();
        return;
    }
    bool bad;
    const float* window = conv_window(conv_state, seq_slot[s], num_slots, slot_stride, bad);
    if (bad) {
        mt_fault(MT_KERNEL_CAUSAL_CONV1D, MT_FAULT_INDEX);
        *o = bf16_nan();
        return;
    }
    const uint32_t t = r - first;
    const uint32_t hist = kernel_size - 1;
    const bf16* wc = weight + (size_t)c * kernel_size;
    float acc = 0.0f;
    for (uint32_t i = 0; i < kernel_size; ++i) {
        const uint32_t back = hist - i;
        float x;
        if (back <= t) {
            x = bf2f(proj[(size_t)(r - back) * pw + c]);
        } else {
            x = window ? window[(size_t)(hist + t - back) * cd + c] : 0.0f;
        }
        acc += bf2f(wc[i]) * x;
    }
    *o = f2bf(siluf_acc(acc));
}

// conv_state_update(conv_state: f32 [num_slots * slot_stride] (in/out), proj: bf16 (see above),
// seq_start: u32 [num_seqs + 1], seq_slot: u32 [num_seqs], rows, num_seqs, num_slots,
// slot_stride, Hk, Dk, Hv, Dv, kernel_size, proj_stride). A real sequence with n rows keeps the
// last K-1 inputs of (old window ++ its rows): new[i] = x(n - (K-1) + i). Each thread owns one
// channel of one window and walks i ascending, so old row i + n is read before it is rewritten.
extern "C" __global__ void conv_state_update(CONV_STATE_UPDATE_PARAMS) {
    pdl_wait();  // a programmatic dependent (ops): the kernel ahead has finished
    pdl_trigger();
    const uint32_t cd = 2 * hk * dk + hv * dv;
    const uint32_t pw = proj_stride;
    const uint32_t s = blockIdx.x;
    const uint32_t c = blockIdx.y * blockDim.x + threadIdx.x;
    if (s >= num_seqs || c >= cd) return;
    if (kernel_size == 0 || pw < cd) {
        mt_fault(MT_KERNEL_CONV_STATE_UPDATE, MT_FAULT_SHAPE);
        return;
    }
    const uint32_t slot = seq_slot[s];
    if (slot == GDN_NO_SLOT) return;
    if (slot >= num_slots) {
        mt_fault(MT_KERNEL_CONV_STATE_UPDATE, MT_FAULT_INDEX);
        return;
    }
    const uint32_t first = min(seq_start[s], rows);
    const uint32_t end = min(seq_start[s + 1], rows);
    if (end <= first) return;
    const uint32_t n = end - first;
    const uint32_t hist = kernel_size - 1;
    float* window = conv_state + (size_t)slot * slot_stride;
    for (uint32_t i = 0; i < hist; ++i) {
        const int64_t u = (int64_t)n + i - hist;
        window[(size_t)i * cd + c] = u >= 0 ? bf2f(proj[(size_t)(first + u) * pw + c])
                                            : window[(size_t)(i + n) * cd + c];
    }
}

// conv_state_verify(conv_state: f32 [num_slots * slot_stride] (in/out), proj: bf16 (see above),
// seq_start: u32 [num_seqs + 1], seq_slot: u32 [num_seqs], row_slot: u32 [rows], rows,
// num_seqs, num_slots, slot_stride, Hk, Dk, Hv, Dv, kernel_size, proj_stride). For row t of a sequence
// with a row slot, that slot's window becomes the last K-1 inputs of (the sequence's window ++
// its rows 0..=t): new[i] = x(t + 1 - (K-1) + i). One thread per (sequence, channel); it reads
// the old window (zeros for padding) into registers before writing any row's. A slot past the
// pool (INDEX) or K - 1 > GDN_MAX_CONV_HIST (SHAPE) writes nothing and reports a fault.
extern "C" __global__ void conv_state_verify(CONV_STATE_VERIFY_PARAMS) {
    pdl_wait();  // a programmatic dependent (ops): the kernel ahead has finished
    pdl_trigger();
    const uint32_t cd = 2 * hk * dk + hv * dv;
    const uint32_t pw = proj_stride;
    const uint32_t s = blockIdx.x;
    const uint32_t c = blockIdx.y * blockDim.x + threadIdx.x;
    if (s >= num_seqs || c >= cd) return;
    if (kernel_size == 0 || kernel_size - 1 > GDN_MAX_CONV_HIST || pw < cd) {
        mt_fault(MT_KERNEL_CONV_STATE_VERIFY, MT_FAULT_SHAPE);
        return;
    }
    bool bad;
    const float* window = conv_window(conv_state, seq_slot[s], num_slots, slot_stride, bad);
    if (bad) {
        mt_fault(MT_KERNEL_CONV_STATE_VERIFY, MT_FAULT_INDEX);
        return;
    }
    const uint32_t first = min(seq_start[s], rows);
    const uint32_t end = min(seq_start[s + 1], rows);
    const uint32_t hist = kernel_size - 1;
    float old[GDN_MAX_CONV_HIST];
    for (uint32_t i = 0; i < hist; ++i) old[i] = window ? window[(size_t)i * cd + c] : 0.0f;
    for (uint32_t r = first; r < end; ++r) {
        const uint32_t dst = row_slot[r];
        if (dst == GDN_NO_SLOT) continue;
        if (dst >= num_slots) {
            mt_fault(MT_KERNEL_CONV_STATE_VERIFY, MT_FAULT_INDEX);
            continue;
        }
        float* out = conv_state + (size_t)dst * slot_stride;
        const int64_t t = (int64_t)(r - first);
        for (uint32_t i = 0; i < hist; ++i) {
            const int64_t u = t + 1 + i - (int64_t)hist;
            out[(size_t)i * cd + c] =
                u >= 0 ? bf2f(proj[(size_t)(first + u) * pw + c]) : old[hist + u];
        }
    }
}

// ---------------------------------------------------------------------------------------------
// q̂, k̂ and the gates.

// softplus(x) = ln(1 + e^x), linear above 20 (torch.nn.functional.softplus).
MT_DEVICE float softplusf(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// gdn_prepare(qk: f32 [rows, 2*key_dim], gates: f32 [rows, 2*Hv], conv: bf16 [rows, conv_dim],
// proj: bf16 (see above), a_log: f32 [Hv], dt_bias: f32 [Hv], rows, Hk, Dk, Hv, Dv, l2_eps,
// q_scale, ba_offset, ba_stride). q̂ = q / sqrt(Σq² + eps) * q_scale, k̂ = k / sqrt(Σk² + eps) per key head;
// β = sigmoid(b), g = -exp(a_log) * softplus(a + dt_bias) per value head. One block per row,
// a warp per head (lanes over Dk, then the butterfly), threads over the gates.
extern "C" __global__ void gdn_prepare(GDN_PREPARE_PARAMS) {
    pdl_wait();  // a programmatic dependent (ops): the kernel ahead has finished
    pdl_trigger();
    const uint32_t r = blockIdx.x;
    if (r >= rows) return;
    if (ba_stride < 2 * hv) {
        if (threadIdx.x == 0) mt_fault(MT_KERNEL_GDN_PREPARE, MT_FAULT_SHAPE);
        return;
    }
    const uint32_t kd = hk * dk, cd = 2 * kd + hv * dv;
    const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const bf16* src = conv + (size_t)r * cd;
    float* dst = qk + (size_t)r * 2 * kd;
    for (uint32_t head = warp; head < 2 * hk; head += warps) {
        const bf16* x = src + (size_t)head * dk;
        float ss = 0.0f;
        for (uint32_t i = lane; i < dk; i += 32) {
            const float e = bf2f(x[i]);
            ss += e * e;
        }
        ss = warp_sum(ss);
        const float inv = 1.0f / sqrtf(ss + l2_eps);
        const float scale = head < hk ? q_scale : 1.0f;
        for (uint32_t i = lane; i < dk; i += 32) dst[(size_t)head * dk + i] = bf2f(x[i]) * inv * scale;
    }
    const bf16* ba = proj + ba_offset + (size_t)r * ba_stride;
    for (uint32_t j = threadIdx.x; j < hv; j += blockDim.x) {
        const float bj = bf2f(ba[j]), aj = bf2f(ba[hv + j]);
        gates[(size_t)r * 2 * hv + j] = sigmoidf_acc(bj);
        gates[(size_t)r * 2 * hv + hv + j] = -expf(a_log[j]) * softplusf(aj + dt_bias[j]);
    }
}

// ---------------------------------------------------------------------------------------------
// The gated delta rule.

#include "gdn_rule.cuh"

// gated_delta_recurrent(out: f32 [rows, value_dim], state: f32 [num_slots * slot_stride]
// (in/out), qk: f32 [rows, 2*key_dim], conv: bf16 [rows, conv_dim], gates: f32 [rows, 2*Hv],
// seq_start: u32 [num_seqs + 1], seq_slot: u32 [num_seqs], rows, num_seqs, num_slots,
// slot_stride, Hk, Dk, Hv, Dv). Each sequence's rows in order, one token step each.
extern "C" __global__ void gated_delta_recurrent(GATED_DELTA_PARAMS) {
    pdl_wait();  // a programmatic dependent (ops): the kernel ahead has finished
    pdl_trigger();
    const Rule a{out,  state,    qk,        conv,        gates, seq_start, seq_slot, nullptr,
                 rows, num_seqs, num_slots, slot_stride, hk,    dk,        hv,       dv,
                 MT_KERNEL_GATED_DELTA_RECURRENT};
    rule_block<false, false>(a);
}

// gated_delta_streamed(the arguments of gated_delta_recurrent): the same rows and states, bitwise,
// from persistent blocks of ceil(Dv / 16) warps that stream each (sequence, value head)'s state
// into shared memory by bulk copies, several items ahead (see rule_streamed). Dynamic shared
// memory: GDN_STREAM_BARS + up to GDN_STREAM_MAX_BUFS head buffers of Dk * Dv * 4 bytes. A
// launch without room for one buffer, or with shapes or addresses off the fast path, runs each
// item as gated_delta_recurrent's blocks would (with this block's warps).
// One-block clusters, so the launcher's occupancy query (cuOccupancyMaxActiveClusters) counts
// resident blocks.
extern "C" __global__ void __cluster_dims__(1, 1, 1) gated_delta_streamed(GATED_DELTA_PARAMS) {
    pdl_wait();  // a programmatic dependent (ops): the kernel ahead has finished
    pdl_trigger();
    const Rule a{out,  state,    qk,        conv,        gates, seq_start, seq_slot, nullptr,
                 rows, num_seqs, num_slots, slot_stride, hk,    dk,        hv,       dv,
                 MT_KERNEL_GATED_DELTA_STREAMED};
    if (a.hk == 0 || a.hv == 0 || a.hv % a.hk != 0) {
        mt_fault(MT_KERNEL_GATED_DELTA_STREAMED, MT_FAULT_SHAPE);
        return;
    }
    extern __shared__ __align__(16) unsigned char gdn_stream[];
    const uint32_t head_bytes = a.dk * a.dv * 4;
    const uint32_t bufs = stream_bufs(dynamic_smem_bytes(), head_bytes);
    const uint32_t tiles = (a.dv + GDN_WARP_COLS - 1) / GDN_WARP_COLS;
    if (bufs > 0 && rule_fast(a) && (blockDim.x >> 5) >= tiles) {
        if (a.dk <= 32)
            rule_streamed<4>(a, gdn_stream, bufs, head_bytes);
        else if (a.dk <= 64)
            rule_streamed<8>(a, gdn_stream, bufs, head_bytes);
        else
            rule_streamed<16>(a, gdn_stream, bufs, head_bytes);
        return;
    }
    const uint32_t groups = (tiles + (blockDim.x >> 5) - 1) / (blockDim.x >> 5);
    for (uint32_t it = blockIdx.x; it < num_seqs * hv; it += gridDim.x) {
        const uint32_t s = it / hv;
        uint32_t first, end;
        seq_rows(a, s, first, end);
        for (uint32_t grp = 0; grp < groups; ++grp) rule_head<false, false>(a, it % hv, grp, seq_slot[s], first, end);
    }
}

// gated_delta_chunked(out, state, qk, conv, gates, seq_start, seq_slot, positions: u32 [rows],
// rows, num_seqs, num_slots, slot_stride, Hk, Dk, Hv, Dv, chunk_size). The same function as
// gated_delta_recurrent; computed here by the same recurrence (see the header), so any chunking
// of the positions gives these bits.
extern "C" __global__ void gated_delta_chunked(GATED_DELTA_CHUNKED_PARAMS) {
    pdl_wait();  // a programmatic dependent (ops): the kernel ahead has finished
    pdl_trigger();
    (void)positions;
    (void)chunk_size;
    const Rule a{out,  state,    qk,        conv,        gates, seq_start, seq_slot, nullptr,
                 rows, num_seqs, num_slots, slot_stride, hk,    dk,        hv,       dv,
                 MT_KERNEL_GATED_DELTA_CHUNKED};
    rule_block<true, false>(a);
}

// gated_delta_verify(out, state, qk, conv, gates, seq_start, seq_slot, row_slot: u32 [rows],
// rows, num_seqs, num_slots, slot_stride, Hk, Dk, Hv, Dv). The rows of each sequence exactly as
// gated_delta_recurrent runs them, from the state in seq_slot; the state after row r is written
// to row_slot[r] (none for u32::MAX) and seq_slot is written only where a row names it.
extern "C" __global__ void gated_delta_verify(GATED_DELTA_VERIFY_PARAMS) {
    pdl_wait();  // a programmatic dependent (ops): the kernel ahead has finished
    pdl_trigger();
    const Rule a{out,  state,    qk,        conv,        gates, seq_start, seq_slot, row_slot,
                 rows, num_seqs, num_slots, slot_stride, hk,    dk,        hv,       dv,
                 MT_KERNEL_GATED_DELTA_VERIFY};
    rule_block<false, true>(a);
}

// ---------------------------------------------------------------------------------------------
// Gated RMSNorm.

// gated_rms_norm(out: bf16 [rows, value_dim], core: f32 [rows, value_dim], proj: bf16 (see
// above), weight: bf16 [Dv], rows, Hk, Dk, Hv, Dv, eps, proj_stride). Per (row, value head):
// out = core * (1 / sqrt(mean(core²) + eps)) * weight * silu(z), z at r * proj_stride +
// conv_dim + j*Dv. One warp per (row blockIdx.x, head blockIdx.y); lanes over Dv.
extern "C" __global__ void gated_rms_norm(GATED_RMS_NORM_PARAMS) {
    pdl_enter(rows);  // a programmatic dependent (common.cuh)
    const uint32_t r = blockIdx.x, j = blockIdx.y;
    if (r >= rows || j >= hv || threadIdx.x >= 32) return;
    const uint32_t cd = 2 * hk * dk + hv * dv;
    const uint32_t pw = proj_stride;
    if (pw < cd + hv * dv) {
        if (threadIdx.x == 0) mt_fault(MT_KERNEL_GATED_RMS_NORM, MT_FAULT_SHAPE);
        return;
    }
    const size_t at = (size_t)r * hv * dv + (size_t)j * dv;
    const float* o = core + at;
    const bf16* z = proj + (size_t)r * pw + cd + (size_t)j * dv;
    const uint32_t lane = threadIdx.x;
    float ss = 0.0f;
    for (uint32_t i = lane; i < dv; i += 32) ss += o[i] * o[i];
    ss = warp_sum(ss);
    const float inv = 1.0f / sqrtf(ss / (float)dv + eps);
    for (uint32_t i = lane; i < dv; i += 32)
        out[at + i] = f2bf(o[i] * inv * bf2f(weight[i]) * siluf_acc(bf2f(z[i])));
}
