// Attention in pieces: a candidate arithmetic shared by decode and prefill attention, and whether
// a decode kernel in it keeps the engine's decode speed. The engine's arithmetic cuts every row's
// context into 8 splits of 4 chains in proportion to its length, so a prefill row of 1,024 keys
// folds 32 partials, and the folds, not the MMAs, set a wgmma prefill kernel's rate at 2,048
// tokens (wgmma_attention_lab: 80 TFLOP/s in that arithmetic against 240-270 with a fold every
// 256 tokens). Here the cut depends on positions alone:
// - tiles of 64 keys at absolute positions (keys 64 t .. 64 t + 63), each one softmax step: the
//   scores by m16n8k16 MMAs over the 8 k steps of 16 dimensions in order from zero, or (K2) in
//   two chains of the even and odd k steps added at the end (a wgmma m64n64k16 sum per k step is
//   the same), scaled by log2(e) / sqrt(d), keys past the row's context masked; the tile's row
//   maximum (exact in any order); m' = max(m, tile max); the running outputs and sums times
//   2^(m - m'); P = bf16(2^(x - m')); each quad lane's sum of its 16 probabilities as
//   ((b0 + b1) + b2) + b3, b_w the sum of its pairs in keys 16 w .. 16 w + 15 (so four warps
//   that each hold 16 keys and one warpgroup that holds all 64 add alike); the running outputs
//   += P V by four k steps of 16 keys in order;
// - pieces of TP tiles at absolute positions (piece p = tiles p TP .. p TP + TP - 1), each from
//   an empty state;
// - the pieces folded in order into the row (att_fold_weights / att_fold, a walk folds each as it
//   ends), the output the folded numerators over ((L0 + L1) + L2) + L3.
// A prefill walk holds one running state and one total (a fold every TP tiles). Decode computes
// a row's pieces side by side, a block of four warps a piece, in one of two ways:
// - NS stages: the piece's tiles through a ring of NS stages, each tile's keys a quarter a warp
//   for the scores and its dimensions a quarter a warp for P V, the tile's maxima, probabilities
//   and sums exchanged through shared memory (three block barriers a tile);
// - NS 0 (TP 2 or 4): every tile copied at once, each warp the scores of one tile (or half of
//   one), each tile's running maximum the maximum of the tiles up to it (exact in any order, so
//   the walk's bits), then P V tile after tile;
// then a fold kernel (a programmatic dependent) folds each head's pieces in order: their
// partials copied into shared memory 32 pieces at a time (the next chunk in flight while one is
// folded), their running maxima by a scan, then each dimension's chain of fmaf. Or, in one launch (CL 8 or 16), a cluster of CL blocks an item:
// block b the pieces b, b + CL, ... through the ring, their partials kept in its shared memory,
// then every block folds its share of the dimensions over the cluster's partials.
//
// The program checks the decode kernels bit for bit against a walk (one warp a row and key/value
// head, every tile in order, one fold a piece: the arithmetic a prefill kernel computes), and the
// walk against a float64 softmax, at several contexts; then times decode (both launches, one CUDA
// graph of launches over copies of the pools past L2, and the pieces kernel alone) at batch 1
// with contexts 1,025 and 32,769 and at batch 32 with 8,193, Qwen3-8B heads (8 key/value heads of
// 128, 4 query heads each), the keys and values gathered from 16-token blocks in shuffled order,
// against the keys' and values' bytes over the device-to-device copy rate. Build: lab/build.sh
// (target/gemm-lab/attention_pieces_lab); no arguments (`verbose` names each launch of a first
// small check as it runs).
#include "../kernels/attention.cu"

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cstdio>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include "lab_util.cuh"

constexpr uint32_t D = 128;     // head_dim
constexpr uint32_t HB = 4;      // query heads a key/value head
constexpr uint32_t HKV = 8;     // key/value heads
constexpr uint32_t RS = D + 8;  // padded shared rows (bf16)
constexpr uint32_t TILE = 64;   // keys a softmax step
constexpr uint32_t PS = TILE + 8;  // padded probability rows (bf16)
constexpr uint32_t BLOCK = 16;  // tokens a cache block

struct Attn {
    const bf16* q;         // [rows][HKV * HB][D]
    const bf16* k;         // [slots][HKV][D]
    const bf16* v;
    const uint32_t* table;  // [rows][max_blocks]
    uint32_t max_blocks;
    const uint32_t* ctx;   // [rows]
    float* po;             // [items][pieces][HB][D] (pieces = max_pieces)
    float* pm;             // [items][pieces][HB]
    float* pl;             // [items][pieces][HB][4]
    float* fo;             // [items][HB][D]: folded numerators
    float* fm;             // [items][HB]
    float* fl;             // [items][HB][4]
    bf16* out;             // [items][HB][D]
    uint32_t max_pieces;
};

MT_DEVICE const bf16* slot_row(const Attn& a, const bf16* pool, uint32_t row, uint32_t kvh, uint32_t tok) {
    const uint32_t slot = a.table[row * a.max_blocks + tok / BLOCK] * BLOCK + tok % BLOCK;
    return pool + ((size_t)slot * HKV + kvh) * D;
}

// A tile's keys and values into `st` (K [64][RS] then V [64][RS]), `nthr` threads from `t0`,
// keys past the context zero-filled.
MT_DEVICE void copy_tile(const Attn& a, bf16* st, uint32_t row, uint32_t kvh, uint32_t tile, uint32_t ctx, uint32_t tid,
                         uint32_t nthr) {
    for (uint32_t x = tid; x < TILE * (D / 8); x += nthr) {
        const uint32_t t = x / (D / 8), ck = x % (D / 8), tok = tile * TILE + t;
        const bool live = tok < ctx;
        const uint32_t at = live ? tok : 0;
        cp_async16(st + t * RS + 8 * ck, slot_row(a, a.k, row, kvh, at) + 8 * ck, live ? 16u : 0u);
        cp_async16(st + (TILE + t) * RS + 8 * ck, slot_row(a, a.v, row, kvh, at) + 8 * ck, live ? 16u : 0u);
    }
}

MT_DEVICE uint32_t smem_addr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

// The scores of 16 keys (k0 .. k0 + 15 of the tile at `kt`) for the 16 rows of `qa`: s[j] the
// n-tile of keys k0 + 8 j .. k0 + 8 j + 7, the 8 k steps in order from zero, or with K2 in two
// chains (even and odd k steps) added at the end (halves the chain of dependent MMAs).
template <bool K2>
MT_DEVICE void scores16(const uint32_t (&qa)[D / 16][4], const bf16* kt, uint32_t k0, uint32_t lane, float (&s)[2][4]) {
    float t[2][2][4] = {};
    const uint32_t mi = lane / 8, r = lane % 8;
#pragma unroll
    for (uint32_t kk = 0; kk < D / 16; ++kk) {
        uint32_t b[4];
        att_ldsm4(b, smem_addr(kt + (k0 + (mi / 2) * 8 + r) * RS + 16 * kk + (mi % 2) * 8));
        float(&u)[2][4] = t[K2 ? kk % 2 : 0];
        att_mma16(u[0][0], u[0][1], u[0][2], u[0][3], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], b[0], b[1]);
        att_mma16(u[1][0], u[1][1], u[1][2], u[1][3], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], b[2], b[3]);
    }
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[j][e] = K2 ? __fadd_rn(t[0][j][e], t[1][j][e]) : t[0][j][e];
}

// The A fragments of 16 rows of `rows` (row stride `stride` bf16), columns 16 kk .. 16 kk + 15.
MT_DEVICE void a_frag(uint32_t (&a)[4], const bf16* rows, uint32_t stride, uint32_t kk, uint32_t lane) {
    const uint32_t mi = lane / 8, r = lane % 8;
    att_ldsm4(a, smem_addr(rows + ((mi % 2) * 8 + r) * stride + 16 * kk + (mi / 2) * 8));
}

// o[n] (n-tiles of dimensions d0 + 8 n, n < N) += P V over the tile's 4 k steps of 16 keys.
template <int N>
MT_DEVICE void pv(float (&o)[N][4], const bf16* ps, uint32_t stride, const bf16* vt, uint32_t d0, uint32_t lane) {
    const uint32_t mi = lane / 8, r = lane % 8;
#pragma unroll
    for (uint32_t ks = 0; ks < TILE / 16; ++ks) {
        uint32_t a[4];
        a_frag(a, ps, stride, ks, lane);
#pragma unroll
        for (int np = 0; np < N / 2; ++np) {
            uint32_t b[4];
            att_ldsm4_t(b, smem_addr(vt + (16 * ks + (mi % 2) * 8 + r) * RS + d0 + 16 * np + (mi / 2) * 8));
            att_mma16(o[2 * np][0], o[2 * np][1], o[2 * np][2], o[2 * np][3], a[0], a[1], a[2], a[3], b[0], b[1]);
            att_mma16(o[2 * np + 1][0], o[2 * np + 1][1], o[2 * np + 1][2], o[2 * np + 1][3], a[0], a[1], a[2], a[3],
                      b[2], b[3]);
        }
    }
}

// Scaled, masked scores of a warp's 16 keys (tile `tile`, keys k0 ..): x[j][e], e 0/1 row g, 2/3
// row g + 8; and their row maxima over the quad.
MT_DEVICE void scaled(const float (&s)[2][4], uint32_t tile, uint32_t k0, uint32_t ctx, float scale_log2, uint32_t c,
                      float (&x)[2][4], float& mx0, float& mx1) {
    mx0 = -INFINITY;
    mx1 = -INFINITY;
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const uint32_t t = tile * TILE + k0 + 8 * j + 2 * c + (e & 1);
            x[j][e] = t < ctx ? __fmul_rn(s[j][e], scale_log2) : -INFINITY;
            if (e < 2) mx0 = fmaxf(mx0, x[j][e]);
            else mx1 = fmaxf(mx1, x[j][e]);
        }
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
}

// The probabilities of a warp's 16 keys under the new maxima (pa row g, pb row g + 8, an A
// fragment pair each n-tile) and each row's b_w (the sum of its two n-tiles' pairs).
MT_DEVICE void probs(const float (&x)[2][4], float m0, float m1, uint32_t (&pa)[2], uint32_t (&pb)[2], float& b0,
                     float& b1) {
    float a0[2], a1[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        pa[j] = att_pack_bf16(att_exp2(x[j][0] - m0), att_exp2(x[j][1] - m0));
        pb[j] = att_pack_bf16(att_exp2(x[j][2] - m1), att_exp2(x[j][3] - m1));
        a0[j] = __fadd_rn(__uint_as_float(pa[j] << 16), __uint_as_float(pa[j] & 0xFFFF0000u));
        a1[j] = __fadd_rn(__uint_as_float(pb[j] << 16), __uint_as_float(pb[j] & 0xFFFF0000u));
    }
    b0 = __fadd_rn(a0[0], a0[1]);
    b1 = __fadd_rn(a1[0], a1[1]);
}

// A 16-key group's probabilities (keys k0 .. k0 + 15, as probs leaves them: pa row g, pb row
// g + 8) into the probability rows `ps` (row stride `stride`), as P V's A operand reads them.
MT_DEVICE void put_probs(bf16* ps, uint32_t stride, uint32_t k0, const uint32_t (&pa)[2], const uint32_t (&pb)[2],
                         uint32_t g, uint32_t c) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const uint32_t key = k0 + 8 * j + 2 * c;
        *reinterpret_cast<uint32_t*>(ps + g * stride + key) = pa[j];
        *reinterpret_cast<uint32_t*>(ps + (g + 8) * stride + key) = pb[j];
    }
}

MT_DEVICE void load_q(const Attn& a, bf16* qs, uint32_t row, uint32_t kvh, uint32_t tid, uint32_t nthr) {
    for (uint32_t i = tid; i < 16 * D; i += nthr) {
        const uint32_t hh = i / D, e = i % D;
        qs[hh * RS + e] = hh < HB ? a.q[((size_t)row * HKV * HB + kvh * HB + hh) * D + e] : __float2bfloat16(0.0f);
    }
}

// The item's queries into `qs` by the block, then each warp's A fragments of them (`qa`).
MT_DEVICE void block_queries(const Attn& a, bf16* qs, uint32_t row, uint32_t kvh, uint32_t (&qa)[D / 16][4]) {
    load_q(a, qs, row, kvh, threadIdx.x, blockDim.x);
    __syncthreads();
#pragma unroll
    for (uint32_t kk = 0; kk < D / 16; ++kk) a_frag(qa[kk], qs, RS, kk, threadIdx.x % 32);
}

// ---- Decode: a block of four warps a (row, key/value head, piece) ----
template <uint32_t TP, uint32_t NS>
struct PieceSmem {
    static constexpr uint32_t STAGE = 2 * TILE * RS;  // bf16
    static constexpr uint32_t BYTES = (16 * RS + NS * STAGE + 16 * PS) * 2 + (4 * 16 + 4 * 16 * 4) * 4;
};

// Running outputs times the tile's corrections (rows g: c0, g + 8: c1).
template <int N>
MT_DEVICE void rescale(float (&o)[N][4], float c0, float c1) {
#pragma unroll
    for (int nt = 0; nt < N; ++nt) {
        o[nt][0] = __fmul_rn(o[nt][0], c0);
        o[nt][1] = __fmul_rn(o[nt][1], c0);
        o[nt][2] = __fmul_rn(o[nt][2], c1);
        o[nt][3] = __fmul_rn(o[nt][3], c1);
    }
}

// One tile into a warp's running state: its sums (`bs`: [16-key group][16 rows][4 quad lanes],
// added group after group) into the running sums, and its P V (probabilities `ps`, row stride
// `stride`; values `vt`) into the running outputs of the warp's 32 dimensions, both rescaled
// by the tile's corrections first.
MT_DEVICE void tile_accumulate(const float* bs, float c0, float c1, float& l0, float& l1, float (&o)[4][4],
                               const bf16* ps, uint32_t stride, const bf16* vt) {
    const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
    float t0 = bs[g * 4 + c], t1 = bs[(g + 8) * 4 + c];
#pragma unroll
    for (uint32_t w = 1; w < 4; ++w) {
        t0 = __fadd_rn(t0, bs[(w * 16 + g) * 4 + c]);
        t1 = __fadd_rn(t1, bs[(w * 16 + g + 8) * 4 + c]);
    }
    l0 = fmaf(l0, c0, t0);
    l1 = fmaf(l1, c1, t1);
    rescale(o, c0, c1);
    pv<4>(o, ps, stride, vt, 32 * warp, lane);
}

// A piece's partial into the global partials: each warp's running outputs of rows g < HB (the
// item's heads), warp 0 the rows' maxima and quad-lane sums.
MT_DEVICE void store_partial(const Attn& a, uint32_t item, uint32_t piece, const float (&o)[4][4], float m0, float l0) {
    const uint32_t warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4, c = threadIdx.x % 4;
    if (g >= HB) return;
    const size_t base = ((size_t)item * a.max_pieces + piece) * HB + g;
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
        a.po[base * D + 32 * warp + 8 * nt + 2 * c] = o[nt][0];
        a.po[base * D + 32 * warp + 8 * nt + 2 * c + 1] = o[nt][1];
    }
    if (warp == 0) {
        if (c == 0) a.pm[base] = m0;
        a.pl[base * 4 + c] = l0;
    }
}

// The fold weights of pieces j0 .. j0 + n - 1 of one head, by one warp: `m(j)` the piece's
// maximum; `carry` the running maximum before them (updated to the one after); each piece's
// weights (att_fold_weights against the running maximum through the piece before it) into
// wt[j * stride], wp[j * stride]. The running maxima by an inclusive scan, exact in any order.
template <typename M>
MT_DEVICE void scan_weights(M&& m_of, uint32_t n, float& carry, float* wt, float* wp, uint32_t stride, uint32_t lane) {
    for (uint32_t j0 = 0; j0 < n; j0 += 32) {
        const uint32_t j = j0 + lane;
        const float m = j < n ? m_of(j) : -INFINITY;
        float v = fmaxf(m, carry);
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
            const float u = __shfl_up_sync(0xffffffffu, v, d);
            if (lane >= (uint32_t)d) v = fmaxf(v, u);
        }
        const float up = __shfl_up_sync(0xffffffffu, v, 1);  // every lane takes part
        const float prev = lane == 0 ? carry : up;
        if (j < n) {
            float mn, w0, w1;
            att_fold_weights(prev, m, mn, w0, w1);
            wt[j * stride] = w0;
            wp[j * stride] = w1;
        }
        carry = __shfl_sync(0xffffffffu, v, 31);
    }
}

// One piece of (row, kvh) by the block's four warps through the ring: each warp's running
// outputs (rows g, g + 8; dimensions 32 warp + 8 nt + 2 c), and its rows' maxima and quad-lane
// sums. `qa` holds the queries' A fragments. The ring is free when it returns.
template <uint32_t TP, uint32_t NS, bool K2>
MT_DEVICE void piece_run(const Attn& a, bf16* ring, bf16* ps, float* mx_s, float* b_s, const uint32_t (&qa)[D / 16][4],
                         uint32_t row, uint32_t kvh, uint32_t piece, uint32_t ctx, float (&o)[4][4], float& m0,
                         float& l0) {
    using S = PieceSmem<TP, NS>;
    const uint32_t tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, c = lane % 4;
    const uint32_t tiles = (ctx + TILE - 1) / TILE, t0 = piece * TP, n = min(TP, tiles - t0);
#pragma unroll
    for (uint32_t i = 0; i < NS; ++i) {
        if (i < n) copy_tile(a, ring + i * S::STAGE, row, kvh, t0 + i, ctx, tid, 128);
        cp_async_commit();
    }
    const float scale_log2 = ATT_LOG2E / sqrtf((float)D);
    float m1 = -INFINITY, l1 = 0.0f;
    m0 = -INFINITY;
    l0 = 0.0f;
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;
    for (uint32_t i = 0; i < n; ++i) {
        // Tile i is in group i below NS stages, else in group i + 1 (one group a step, the
        // first empty); NS + i groups are committed here.
        cp_async_wait<NS - 2>();
        __syncthreads();  // the tile landed; every warp is past the last tile's P V
        if (i >= 1 && i - 1 + NS < n) copy_tile(a, ring + ((i - 1) % NS) * S::STAGE, row, kvh, t0 + i - 1 + NS, ctx, tid, 128);
        cp_async_commit();
        const bf16* kt = ring + (i % NS) * S::STAGE;
        float s[2][4], x[2][4], mx0, mx1;
        scores16<K2>(qa, kt, 16 * warp, lane, s);
        scaled(s, t0 + i, 16 * warp, ctx, scale_log2, c, x, mx0, mx1);
        if (c == 0) {
            mx_s[warp * 16 + g] = mx0;
            mx_s[warp * 16 + g + 8] = mx1;
        }
        __syncthreads();
#pragma unroll
        for (uint32_t w = 0; w < 4; ++w) {
            mx0 = fmaxf(mx0, mx_s[w * 16 + g]);
            mx1 = fmaxf(mx1, mx_s[w * 16 + g + 8]);
        }
        const float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);
        const float c0 = att_exp2(m0 - n0), c1 = att_exp2(m1 - n1);
        m0 = n0;
        m1 = n1;
        uint32_t pa[2], pb[2];
        float b0, b1;
        probs(x, n0, n1, pa, pb, b0, b1);
        b_s[(warp * 16 + g) * 4 + c] = b0;
        b_s[(warp * 16 + g + 8) * 4 + c] = b1;
        put_probs(ps, PS, 16 * warp, pa, pb, g, c);
        __syncthreads();
        tile_accumulate(b_s, c0, c1, l0, l1, o, ps, PS, kt + TILE * RS);
    }
    cp_async_wait<0>();
    __syncthreads();  // every warp is past the ring before the next piece refills it
}

template <uint32_t TP, uint32_t NS, bool K2>
__global__ void __launch_bounds__(128) piece_decode(Attn a) {
    extern __shared__ __align__(16) bf16 sm[];
    using S = PieceSmem<TP, NS>;
    bf16* qs = sm;
    bf16* ring = qs + 16 * RS;
    bf16* ps = ring + NS * S::STAGE;
    float* mx_s = reinterpret_cast<float*>(ps + 16 * PS);  // [warp][16 rows]
    float* b_s = mx_s + 4 * 16;                            // [warp][16 rows][4 quad lanes]
    const uint32_t item = blockIdx.y, piece = blockIdx.x, row = item / HKV, kvh = item % HKV;
    const uint32_t ctx = a.ctx[row], tiles = (ctx + TILE - 1) / TILE;
    if (piece * TP >= tiles) return;
    uint32_t qa[D / 16][4];
    block_queries(a, qs, row, kvh, qa);
    float o[4][4], m0, l0;
    piece_run<TP, NS, K2>(a, ring, ps, mx_s, b_s, qa, row, kvh, piece, ctx, o, m0, l0);
    pdl_trigger();
    store_partial(a, item, piece, o, m0, l0);
}

// ---- Decode in one kernel: a cluster of CL blocks an item, folded through the cluster ----
// Block b of the item's cluster computes pieces b, b + CL, b + 2 CL, ... (the ring kernel's
// piece_run) and keeps their partials in its shared memory; after a cluster barrier every block
// folds its share of the outputs over all the pieces in order, reading the partials from their
// blocks' shared memory (each piece's weights from the prefix maxima first), and writes them.
// No second launch.
constexpr uint32_t CL_SLOTS = 20;  // pieces a block keeps (CL 16, TP 2: 40,960 keys)
constexpr uint32_t CL_PIECES = 512;  // pieces the fold weighs
template <uint32_t TP, uint32_t NS>
struct ClusterSmem {
    static constexpr uint32_t PART = HB * D + HB + HB * 4;  // floats of a piece's partial
    static constexpr uint32_t BYTES = PieceSmem<TP, NS>::BYTES + CL_SLOTS * PART * 4 + 2 * CL_PIECES * HB * 4;
};

template <uint32_t TP, uint32_t NS, bool K2, uint32_t CL>
__global__ void __launch_bounds__(128) piece_decode_cluster(Attn a) {
    namespace cg = cooperative_groups;
    extern __shared__ __align__(16) bf16 sm[];
    using S = PieceSmem<TP, NS>;
    using C = ClusterSmem<TP, NS>;
    bf16* qs = sm;
    bf16* ring = qs + 16 * RS;
    bf16* ps = ring + NS * S::STAGE;
    float* mx_s = reinterpret_cast<float*>(ps + 16 * PS);
    float* b_s = mx_s + 4 * 16;
    float* part = reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(sm) + S::BYTES);  // [slot][PART]
    cg::cluster_group cluster = cg::this_cluster();
    const uint32_t tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, c = lane % 4;
    const uint32_t rank = cluster.block_rank(), item = blockIdx.x / CL, row = item / HKV, kvh = item % HKV;
    const uint32_t ctx = a.ctx[row], tiles = (ctx + TILE - 1) / TILE, pieces = (tiles + TP - 1) / TP;
    uint32_t qa[D / 16][4];
    block_queries(a, qs, row, kvh, qa);
    for (uint32_t piece = rank, slot = 0; piece < pieces; piece += CL, ++slot) {
        float o[4][4], m0, l0;
        piece_run<TP, NS, K2>(a, ring, ps, mx_s, b_s, qa, row, kvh, piece, ctx, o, m0, l0);
        float* pt = part + slot * C::PART;
        if (g < HB) {
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) {
                pt[g * D + 32 * warp + 8 * nt + 2 * c] = o[nt][0];
                pt[g * D + 32 * warp + 8 * nt + 2 * c + 1] = o[nt][1];
            }
            if (warp == 0) {
                if (c == 0) pt[HB * D + g] = m0;
                pt[HB * D + HB + g * 4 + c] = l0;
            }
        }
    }
    cluster.sync();
    // Every block folds its share of the item's outputs: dimensions E0 .. E0 + DB of each head
    // (DB = D / CL), and block 0 also the sums. First each piece's weights (warp h scans head
    // h's maxima), then its share of every piece's partial copied into the free ring, all loads
    // issued before any is used, then each element's fold in piece order.
    constexpr uint32_t DB = D / CL, E = HB * DB;
    float* wt_s = part + CL_SLOTS * C::PART;
    float* wp_s = wt_s + CL_PIECES * HB;
    float* loc = reinterpret_cast<float*>(ring);  // [piece][E + HB * 4]
    constexpr uint32_t LW = E + HB * 4;
    if (warp < HB) {
        float carry = -INFINITY;
        scan_weights([&](uint32_t j) { return cluster.map_shared_rank(part, j % CL)[(j / CL) * C::PART + HB * D + warp]; },
                     pieces, carry, wt_s + warp, wp_s + warp, HB, lane);
        if (lane == 0) mx_s[warp] = carry;
    }
    const uint32_t e0 = rank * DB;
    for (uint32_t x = tid; x < pieces * LW; x += 128) {
        const uint32_t j = x / LW, q = x % LW;
        const float* pt = cluster.map_shared_rank(part, j % CL) + (j / CL) * C::PART;
        loc[x] = q < E ? pt[(q / DB) * D + e0 + q % DB] : pt[HB * D + HB + (q - E)];
    }
    __syncthreads();
    if (tid < E || (rank == 0 && tid >= 64 && tid < 64 + HB * 4)) {
        const bool sum = tid >= E;
        const uint32_t q = sum ? E + (tid - 64) : tid, h = sum ? (tid - 64) / 4 : tid / DB;
        float acc = 0.0f;
#pragma unroll 8
        for (uint32_t j = 0; j < pieces; ++j) acc = att_fold(acc, loc[j * LW + q], wt_s[j * HB + h], wp_s[j * HB + h]);
        loc[q] = acc;  // piece 0's slot is read only by this thread, before this write
    }
    // The sums every block needs: block 0's, through the cluster.
    cluster.sync();
    {
        const float* l0s = cluster.map_shared_rank(loc, 0) + E;
        if (tid < E) {
            const uint32_t h = tid / DB;
            const float den = __fadd_rn(__fadd_rn(__fadd_rn(l0s[h * 4], l0s[h * 4 + 1]), l0s[h * 4 + 2]), l0s[h * 4 + 3]);
            const size_t f = (size_t)item * HB + h;
            const float ot = loc[tid];
            a.fo[f * D + e0 + tid % DB] = ot;
            a.out[f * D + e0 + tid % DB] = att_value(ot, den, nullptr);
        }
        if (rank == 0 && tid < HB * 4) a.fl[((size_t)item * HB + tid / 4) * 4 + tid % 4] = l0s[tid];
        if (rank == 0 && tid < HB) a.fm[(size_t)item * HB + tid] = mx_s[tid];
    }
    cluster.sync();  // no block leaves while another reads its shared memory
}

// ---- Decode with a piece's tiles side by side ----
// Every tile of the piece copied at once (one stage each), then: warp w the scores of tile
// w / (4 / TP) (all its keys at TP 4, half at TP 2), the tiles' maxima through shared memory,
// each tile's running maximum as the maximum of the tiles up to it (exact in any order, so the
// walk's bits), its probabilities and sums; then each warp a quarter of the dimensions, P V tile
// after tile with the running outputs rescaled between. Fewer barriers and the scores of every
// tile at once, for short contexts, where a row has few pieces.
template <uint32_t TP>
struct AllSmem {
    static constexpr uint32_t STAGE = 2 * TILE * RS;
    static constexpr uint32_t PSA = TP * TILE + 8;
    static constexpr uint32_t BYTES = (16 * RS + TP * STAGE + 16 * PSA) * 2 + (4 * 16 + TP * 4 * 16 * 4 + TP * 16) * 4;
};

template <uint32_t TP, bool K2>
__global__ void __launch_bounds__(128) piece_decode_all(Attn a) {
    static_assert(TP == 2 || TP == 4, "a tile for every one or two warps");
    constexpr uint32_t WPT = 4 / TP, G = 4 / WPT;  // warps a tile, 16-key groups a warp
    using S = AllSmem<TP>;
    extern __shared__ __align__(16) bf16 sm[];
    bf16* qs = sm;
    bf16* ring = qs + 16 * RS;
    bf16* ps = ring + TP * S::STAGE;                        // [16 rows][TP * 64 keys]
    float* mx_s = reinterpret_cast<float*>(ps + 16 * S::PSA);  // [warp][16 rows]
    float* b_s = mx_s + 4 * 16;                             // [tile][16-key group][16 rows][4]
    float* c_s = b_s + TP * 4 * 16 * 4;                     // [tile][16 rows]
    const uint32_t tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, c = lane % 4;
    const uint32_t item = blockIdx.y, piece = blockIdx.x, row = item / HKV, kvh = item % HKV;
    const uint32_t ctx = a.ctx[row], tiles = (ctx + TILE - 1) / TILE, t0 = piece * TP;
    if (t0 >= tiles) return;
    const uint32_t n = min(TP, tiles - t0);
    load_q(a, qs, row, kvh, tid, 128);
    for (uint32_t i = 0; i < n; ++i) copy_tile(a, ring + i * S::STAGE, row, kvh, t0 + i, ctx, tid, 128);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    uint32_t qa[D / 16][4];
#pragma unroll
    for (uint32_t kk = 0; kk < D / 16; ++kk) a_frag(qa[kk], qs, RS, kk, lane);
    const float scale_log2 = ATT_LOG2E / sqrtf((float)D);
    const uint32_t tile = warp / WPT, kb = (warp % WPT) * (TILE / WPT);
    const bool live = tile < n;
    float x[G][2][4], mx0 = -INFINITY, mx1 = -INFINITY;
    if (live) {
#pragma unroll
        for (uint32_t gi = 0; gi < G; ++gi) {
            float s[2][4], a0, a1;
            scores16<K2>(qa, ring + tile * S::STAGE, kb + 16 * gi, lane, s);
            scaled(s, t0 + tile, kb + 16 * gi, ctx, scale_log2, c, x[gi], a0, a1);
            mx0 = fmaxf(mx0, a0);
            mx1 = fmaxf(mx1, a1);
        }
    }
    if (c == 0) {
        mx_s[warp * 16 + g] = mx0;
        mx_s[warp * 16 + g + 8] = mx1;
    }
    __syncthreads();
    if (live) {
        float p0 = -INFINITY, p1 = -INFINITY, r0 = -INFINITY, r1 = -INFINITY;  // before / through the tile
#pragma unroll
        for (uint32_t w = 0; w < 4; ++w) {
            const float v0 = mx_s[w * 16 + g], v1 = mx_s[w * 16 + g + 8];
            if (w / WPT < tile) {
                p0 = fmaxf(p0, v0);
                p1 = fmaxf(p1, v1);
            }
            if (w / WPT <= tile) {
                r0 = fmaxf(r0, v0);
                r1 = fmaxf(r1, v1);
            }
        }
#pragma unroll
        for (uint32_t gi = 0; gi < G; ++gi) {
            uint32_t pa[2], pb[2];
            float b0, b1;
            probs(x[gi], r0, r1, pa, pb, b0, b1);
            const uint32_t grp = kb / 16 + gi;
            b_s[((tile * 4 + grp) * 16 + g) * 4 + c] = b0;
            b_s[((tile * 4 + grp) * 16 + g + 8) * 4 + c] = b1;
            put_probs(ps, S::PSA, tile * TILE + 16 * grp, pa, pb, g, c);
        }
        if (warp % WPT == 0 && c == 0) {
            c_s[tile * 16 + g] = att_exp2(p0 - r0);
            c_s[tile * 16 + g + 8] = att_exp2(p1 - r1);
        }
    }
    __syncthreads();
    float o[4][4] = {}, l0 = 0.0f, l1 = 0.0f;
    for (uint32_t t = 0; t < n; ++t) {
        const float c0 = c_s[t * 16 + g], c1 = c_s[t * 16 + g + 8];
        tile_accumulate(b_s + t * 4 * 16 * 4, c0, c1, l0, l1, o, ps + t * TILE, S::PSA, ring + t * S::STAGE + TILE * RS);
    }
    pdl_trigger();
    const float m0 = fmaxf(fmaxf(mx_s[0 * 16 + g], mx_s[1 * 16 + g]), fmaxf(mx_s[2 * 16 + g], mx_s[3 * 16 + g]));
    store_partial(a, item, piece, o, m0, l0);
}

// Each head's pieces folded in order: block (item, head), thread e dimension e, threads 0..3
// also the head's four sums. Launched as a programmatic dependent of the pieces: it waits for
// them, then copies FOLD_CHUNK pieces' partials at a time into shared memory (one burst of
// cp.async a chunk, the next chunk's in flight while one is folded), works out their weights
// against the running maximum (a scan), and folds.
constexpr uint32_t FOLD_CHUNK = 32;
template <uint32_t TP>
__global__ void __launch_bounds__(128) piece_fold(Attn a) {
    __shared__ __align__(16) float po_s[2][FOLD_CHUNK][D];  // by chunk parity
    __shared__ __align__(16) float pl_s[2][FOLD_CHUNK][4];
    __shared__ float wt_s[FOLD_CHUNK], wp_s[FOLD_CHUNK];
    __shared__ float ls[4];
    const uint32_t item = blockIdx.x, hh = blockIdx.y, e = threadIdx.x, lane = e % 32;
    pdl_wait();
    const uint32_t tiles = (a.ctx[item / HKV] + TILE - 1) / TILE, count = (tiles + TP - 1) / TP;
    const uint32_t chunks = (count + FOLD_CHUNK - 1) / FOLD_CHUNK;
    const size_t b0 = ((size_t)item * a.max_pieces) * HB + hh;  // piece j at b0 + j * HB
    // Chunk k's partials into buffer k % 2, one commit group (every thread commits one).
    auto issue = [&](uint32_t k) {
        const uint32_t c0 = k * FOLD_CHUNK, nc = min(FOLD_CHUNK, count - c0), b = k % 2;
        for (uint32_t x = e; x < nc * (D / 4); x += 128) {
            const uint32_t j = x / (D / 4), q = x % (D / 4);
            cp_async16(&po_s[b][j][4 * q], a.po + (b0 + (size_t)(c0 + j) * HB) * D + 4 * q, 16u);
        }
        if (e < nc) cp_async16(&pl_s[b][e][0], a.pl + (b0 + (size_t)(c0 + e) * HB) * 4, 16u);
        cp_async_commit();
    };
    float carry = -INFINITY, ot = 0.0f, lt = 0.0f;
    if (chunks > 0) issue(0);
    for (uint32_t k = 0; k < chunks; ++k) {
        // The next chunk's copies fly while this one is weighed and folded (its buffer was last
        // read by the fold before the barrier that ended the previous step).
        if (k + 1 < chunks) issue(k + 1);
        const uint32_t c0 = k * FOLD_CHUNK, nc = min(FOLD_CHUNK, count - c0), b = k % 2;
        if (e < 32)  // the running maxima and each piece's weights
            scan_weights([&](uint32_t j) { return a.pm[b0 + (size_t)(c0 + j) * HB]; }, nc, carry, wt_s, wp_s, 1, lane);
        if (k + 1 < chunks)
            cp_async_wait<1>();
        else
            cp_async_wait<0>();
        __syncthreads();
#pragma unroll 8
        for (uint32_t j = 0; j < nc; ++j) {
            ot = att_fold(ot, po_s[b][j][e], wt_s[j], wp_s[j]);
            if (e < 4) lt = att_fold(lt, pl_s[b][j][e], wt_s[j], wp_s[j]);
        }
        __syncthreads();
    }
    carry = __shfl_sync(0xffffffffu, carry, 0);
    const size_t f = (size_t)item * HB + hh;
    a.fo[f * D + e] = ot;
    if (e == 0) a.fm[f] = carry;
    if (e < 4) a.fl[f * 4 + e] = lt;
    if (e < 4) ls[e] = lt;
    __syncthreads();
    const float den = __fadd_rn(__fadd_rn(__fadd_rn(ls[0], ls[1]), ls[2]), ls[3]);
    a.out[f * D + e] = att_value(ot, den, nullptr);
}

// ---- The walk: one warp a (row, key/value head), every tile in order, a fold a piece ----
template <uint32_t TP, bool K2>
__global__ void __launch_bounds__(32) piece_walk(Attn a, float* wo, float* wm, float* wl) {
    __shared__ __align__(16) bf16 qs[16 * RS];
    __shared__ __align__(16) bf16 st[2 * TILE * RS];
    __shared__ __align__(16) bf16 ps[16 * PS];
    const uint32_t lane = threadIdx.x, g = lane / 4, c = lane % 4, item = blockIdx.x, row = item / HKV, kvh = item % HKV;
    const uint32_t ctx = a.ctx[row], tiles = (ctx + TILE - 1) / TILE;
    load_q(a, qs, row, kvh, lane, 32);
    __syncwarp();
    uint32_t qa[D / 16][4];
#pragma unroll
    for (uint32_t kk = 0; kk < D / 16; ++kk) a_frag(qa[kk], qs, RS, kk, lane);
    const float scale_log2 = ATT_LOG2E / sqrtf((float)D);
    float O[16][4] = {}, M0 = -INFINITY, M1 = -INFINITY, L0 = 0.0f, L1 = 0.0f;
    float o[16][4] = {}, m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
    for (uint32_t t = 0; t < tiles; ++t) {
        copy_tile(a, st, row, kvh, t, ctx, lane, 32);
        cp_async_commit();
        cp_async_wait<0>();
        __syncwarp();
        // The whole tile's scores: four groups of 16 keys, as the decode block's warps hold them.
        float x[4][2][4], mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
        for (uint32_t w = 0; w < 4; ++w) {
            float s[2][4], a0, a1;
            scores16<K2>(qa, st, 16 * w, lane, s);
            scaled(s, t, 16 * w, ctx, scale_log2, c, x[w], a0, a1);
            mx0 = fmaxf(mx0, a0);
            mx1 = fmaxf(mx1, a1);
        }
        const float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);
        const float c0 = att_exp2(m0 - n0), c1 = att_exp2(m1 - n1);
        m0 = n0;
        m1 = n1;
        float t_0 = 0.0f, t_1 = 0.0f;
#pragma unroll
        for (uint32_t w = 0; w < 4; ++w) {
            uint32_t pa[2], pb[2];
            float b0, b1;
            probs(x[w], n0, n1, pa, pb, b0, b1);
            t_0 = w == 0 ? b0 : __fadd_rn(t_0, b0);
            t_1 = w == 0 ? b1 : __fadd_rn(t_1, b1);
            put_probs(ps, PS, 16 * w, pa, pb, g, c);
        }
        __syncwarp();
        l0 = fmaf(l0, c0, t_0);
        l1 = fmaf(l1, c1, t_1);
        rescale(o, c0, c1);
        pv<16>(o, ps, PS, st + TILE * RS, 0, lane);
        __syncwarp();
        if ((t + 1) % TP == 0 || t + 1 == tiles) {  // the piece ends: fold it, start afresh
            float mn0, wt0, wp0, mn1, wt1, wp1;
            att_fold_weights(M0, m0, mn0, wt0, wp0);
            att_fold_weights(M1, m1, mn1, wt1, wp1);
#pragma unroll
            for (int nt = 0; nt < 16; ++nt) {
                O[nt][0] = att_fold(O[nt][0], o[nt][0], wt0, wp0);
                O[nt][1] = att_fold(O[nt][1], o[nt][1], wt0, wp0);
                O[nt][2] = att_fold(O[nt][2], o[nt][2], wt1, wp1);
                O[nt][3] = att_fold(O[nt][3], o[nt][3], wt1, wp1);
                o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;
            }
            L0 = att_fold(L0, l0, wt0, wp0);
            L1 = att_fold(L1, l1, wt1, wp1);
            M0 = mn0;
            M1 = mn1;
            m0 = m1 = -INFINITY;
            l0 = l1 = 0.0f;
        }
    }
    if (g < HB) {
        const size_t f = (size_t)item * HB + g;
#pragma unroll
        for (int nt = 0; nt < 16; ++nt) {
            wo[f * D + 8 * nt + 2 * c] = O[nt][0];
            wo[f * D + 8 * nt + 2 * c + 1] = O[nt][1];
        }
        if (c == 0) wm[f] = M0;
        wl[f * 4 + c] = L0;
    }
}

// ---- Host ----
static bool g_verbose = false;
static float bf(bf16 h) { return __bfloat162float(h); }

// The pieces kernel's shared-memory limit (outside any capture).
template <uint32_t TP, uint32_t NS, bool K2, uint32_t CL = 0>
static void prepare() {
    if constexpr (CL > 0) {
        CK(cudaFuncSetAttribute(piece_decode_cluster<TP, NS, K2, CL>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                ClusterSmem<TP, NS>::BYTES));
        CK(cudaFuncSetAttribute(piece_decode_cluster<TP, NS, K2, CL>, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    } else if constexpr (NS == 0)
        CK(cudaFuncSetAttribute(piece_decode_all<TP, K2>, cudaFuncAttributeMaxDynamicSharedMemorySize, AllSmem<TP>::BYTES));
    else
        CK(cudaFuncSetAttribute(piece_decode<TP, NS, K2>, cudaFuncAttributeMaxDynamicSharedMemorySize, PieceSmem<TP, NS>::BYTES));
}

// The pieces kernel: NS stages a block, or (NS 0) every tile of the piece at once; with CL, the
// clustered kernel that folds too.
template <uint32_t TP, uint32_t NS, bool K2, uint32_t CL = 0>
static void launch_pieces(const Attn& a, uint32_t rows, cudaStream_t s) {
    if constexpr (CL > 0) {
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(CL * rows * HKV);
        cfg.blockDim = dim3(128);
        cfg.dynamicSmemBytes = ClusterSmem<TP, NS>::BYTES;
        cfg.stream = s;
        cudaLaunchAttribute attr[1];
        attr[0].id = cudaLaunchAttributeClusterDimension;
        attr[0].val.clusterDim.x = CL;
        attr[0].val.clusterDim.y = 1;
        attr[0].val.clusterDim.z = 1;
        cfg.attrs = attr;
        cfg.numAttrs = 1;
        Attn arg = a;
        void* args[] = {&arg};
        CK(cudaLaunchKernelExC(&cfg, (const void*)piece_decode_cluster<TP, NS, K2, CL>, args));
    } else if constexpr (NS == 0) {
        piece_decode_all<TP, K2><<<dim3(a.max_pieces, rows * HKV), 128, AllSmem<TP>::BYTES, s>>>(a);
    } else {
        piece_decode<TP, NS, K2><<<dim3(a.max_pieces, rows * HKV), 128, PieceSmem<TP, NS>::BYTES, s>>>(a);
    }
}

template <uint32_t TP, uint32_t NS, bool K2, uint32_t CL = 0>
static void launch_decode(const Attn& a, uint32_t rows, cudaStream_t s) {
    launch_pieces<TP, NS, K2, CL>(a, rows, s);
    if constexpr (CL > 0) return;
    Attn arg = a;
    void* args[] = {&arg};
    launch_ex((const void*)piece_fold<TP>, dim3(rows * HKV, HB), dim3(128), 0, true, s, args);
}

// A launch's buffers but the pools: queries (random), a block table of every row's blocks in
// shuffled order (returned in `table`), the contexts, the partials and the outputs (the folded
// ones poisoned, so a value never written differs); `k` and `v` are left to the caller.
static Attn alloc_attn(const std::vector<uint32_t>& ctxs, uint32_t tp, uint64_t seed, std::vector<uint32_t>& table) {
    const uint32_t rows = ctxs.size(), items = rows * HKV;
    const uint32_t maxc = *std::max_element(ctxs.begin(), ctxs.end());
    const uint32_t max_blocks = (maxc + BLOCK - 1) / BLOCK, max_pieces = ((maxc + TILE - 1) / TILE + tp - 1) / tp;
    table.resize(rows * max_blocks);
    for (uint32_t i = 0; i < table.size(); ++i) table[i] = i;
    std::mt19937 rng(seed);
    std::shuffle(table.begin(), table.end(), rng);
    bf16 *q, *out;
    uint32_t *t, *cx;
    float *po, *pm, *pl, *fo, *fm, *fl;
    const size_t qn = (size_t)rows * HKV * HB * D;
    CK(cudaMalloc(&q, qn * 2));
    CK(cudaMalloc(&out, (size_t)items * HB * D * 2));
    CK(cudaMalloc(&t, table.size() * 4));
    CK(cudaMalloc(&cx, rows * 4));
    CK(cudaMalloc(&po, (size_t)items * max_pieces * HB * D * 4));
    CK(cudaMalloc(&pm, (size_t)items * max_pieces * HB * 4));
    CK(cudaMalloc(&pl, (size_t)items * max_pieces * HB * 16));
    CK(cudaMalloc(&fo, (size_t)items * HB * D * 4));
    CK(cudaMalloc(&fm, (size_t)items * HB * 4));
    CK(cudaMalloc(&fl, (size_t)items * HB * 16));
    CK(cudaMemset(fo, 0xFF, (size_t)items * HB * D * 4));
    CK(cudaMemset(fm, 0xFF, (size_t)items * HB * 4));
    CK(cudaMemset(fl, 0xFF, (size_t)items * HB * 16));
    CK(cudaMemcpy(t, table.data(), table.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(cx, ctxs.data(), rows * 4, cudaMemcpyHostToDevice));
    fill_bf16<<<256, 256>>>(q, qn, seed + 1, 2.0f);
    return Attn{q, nullptr, nullptr, t, max_blocks, cx, po, pm, pl, fo, fm, fl, out, max_pieces};
}

static void free_attn(const Attn& a) {
    for (const void* p : {(const void*)a.q, (const void*)a.out, (const void*)a.table, (const void*)a.ctx,
                          (const void*)a.po, (const void*)a.pm, (const void*)a.pl, (const void*)a.fo, (const void*)a.fm,
                          (const void*)a.fl})
        CK(cudaFree((void*)p));
}

// Rows of the given contexts over shuffled blocks: decode against the walk bit for bit, the walk
// against float64; returns the count of differing values.
template <uint32_t TP, uint32_t NS, bool K2, uint32_t CL = 0>
static size_t check(const std::vector<uint32_t>& ctxs, uint64_t seed) {
    const uint32_t rows = ctxs.size(), items = rows * HKV;
    std::vector<uint32_t> table;
    Attn a = alloc_attn(ctxs, TP, seed, table);
    const uint32_t max_blocks = a.max_blocks, slots = rows * max_blocks * BLOCK;
    bf16 *k, *v;
    float *wo, *wm, *wl;
    const size_t qn = (size_t)rows * HKV * HB * D, kvn = (size_t)slots * HKV * D;
    CK(cudaMalloc(&k, kvn * 2));
    CK(cudaMalloc(&v, kvn * 2));
    // The walk's outputs, poisoned as the folded ones are.
    for (auto [p, n] : {std::pair{&wo, (size_t)items * HB * D}, {&wm, (size_t)items * HB}, {&wl, (size_t)items * HB * 4}}) {
        CK(cudaMalloc(p, n * 4));
        CK(cudaMemset(*p, 0xFF, n * 4));
    }
    fill_bf16<<<1024, 256>>>(k, kvn, seed + 2, 2.0f);
    fill_bf16<<<1024, 256>>>(v, kvn, seed + 3, 1.0f);
    a.k = k;
    a.v = v;
    const bf16* q = a.q;
    float *fo = a.fo, *fm = a.fm, *fl = a.fl;
    prepare<TP, NS, K2, CL>();
    if (g_verbose) printf("  check TP=%u NS=%u: decode\n", TP, NS);
    launch_pieces<TP, NS, K2, CL>(a, rows, 0);
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    if (g_verbose) printf("  check: fold\n");
    if (CL == 0) piece_fold<TP><<<dim3(rows * HKV, HB), 128>>>(a);
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    if (g_verbose) printf("  check: walk\n");
    piece_walk<TP, K2><<<items, 32>>>(a, wo, wm, wl);
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    if (g_verbose) printf("  check: compare\n");
    const size_t on = (size_t)items * HB * D;
    auto down = [](const float* p, size_t n) {
        std::vector<uint32_t> h(n);
        CK(cudaMemcpy(h.data(), p, n * 4, cudaMemcpyDeviceToHost));
        return h;
    };
    const std::vector<uint32_t> h_fo = down(fo, on), h_wo = down(wo, on), h_fm = down(fm, items * HB),
                                h_wm = down(wm, items * HB), h_fl = down(fl, items * HB * 4), h_wl = down(wl, items * HB * 4);
    size_t diff = 0;
    for (size_t i = 0; i < on; ++i) diff += h_fo[i] != h_wo[i];
    for (size_t i = 0; i < h_fm.size(); ++i) diff += h_fm[i] != h_wm[i];
    for (size_t i = 0; i < h_fl.size(); ++i) diff += h_fl[i] != h_wl[i];
    // The walk against float64 on the first and last items.
    std::vector<bf16> hq(qn), hk(kvn), hv(kvn);
    CK(cudaMemcpy(hq.data(), q, qn * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hk.data(), k, kvn * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hv.data(), v, kvn * 2, cudaMemcpyDeviceToHost));
    double worst = 0.0;
    for (uint32_t it : {0u, items - 1}) {
        const uint32_t row = it / HKV, kvh = it % HKV, n = ctxs[row];
        for (uint32_t hh = 0; hh < HB; ++hh) {
            const bf16* qr = &hq[((size_t)row * HKV * HB + kvh * HB + hh) * D];
            std::vector<double> sc(n);
            double mx = -1e300;
            for (uint32_t tok = 0; tok < n; ++tok) {
                const uint32_t slot = table[row * max_blocks + tok / BLOCK] * BLOCK + tok % BLOCK;
                const bf16* kr = &hk[((size_t)slot * HKV + kvh) * D];
                double s = 0;
                for (uint32_t e = 0; e < D; ++e) s += (double)bf(qr[e]) * bf(kr[e]);
                sc[tok] = s / sqrt((double)D);
                mx = std::max(mx, sc[tok]);
            }
            double den = 0;
            std::vector<double> o(D, 0.0);
            for (uint32_t tok = 0; tok < n; ++tok) {
                const uint32_t slot = table[row * max_blocks + tok / BLOCK] * BLOCK + tok % BLOCK;
                const bf16* vr = &hv[((size_t)slot * HKV + kvh) * D];
                const double p = exp(sc[tok] - mx);
                den += p;
                for (uint32_t e = 0; e < D; ++e) o[e] += p * bf(vr[e]);
            }
            const size_t f = (size_t)it * HB + hh;
            float lsum = 0.0f;
            for (int cc = 0; cc < 4; ++cc) lsum += *reinterpret_cast<const float*>(&h_wl[f * 4 + cc]);
            double num = 0, dd = 0;
            for (uint32_t e = 0; e < D; ++e) {
                const double got = *reinterpret_cast<const float*>(&h_wo[f * D + e]) / lsum, want = o[e] / den;
                num += (got - want) * (got - want);
                dd += want * want;
            }
            worst = std::max(worst, sqrt(num / std::max(dd, 1e-300)));
        }
    }
    printf("check TP=%u NS=%u K2=%d CL=%u rows=%u ctx %u..%u: %zu of %zu values differ from the walk; the walk %.2e from float64 "
           "(relative L2, worst head)\n",
           TP, NS, (int)K2, CL, rows, ctxs.front(), ctxs.back(), diff, on + h_fm.size() + h_fl.size(), worst);
    for (void* p : {(void*)k, (void*)v, (void*)wo, (void*)wm, (void*)wl}) CK(cudaFree(p));
    free_attn(a);
    return diff + (worst > 2e-2 ? 1 : 0);
}

// Decode at `rows` rows of context `ctx`, both launches in one graph over copies of the pools.
template <uint32_t TP, uint32_t NS, bool K2, uint32_t CL = 0>
static void time_decode(uint32_t rows, uint32_t ctx, double copy_gbs) {
    if (CL > 0 && ((ctx + TILE - 1) / TILE + TP - 1) / TP > CL * CL_SLOTS) {
        printf("decode TP=%u CL=%u ctx %u: more pieces than the cluster keeps\n", TP, CL, ctx);
        return;
    }
    std::vector<uint32_t> table;
    const Attn base = alloc_attn(std::vector<uint32_t>(rows, ctx), TP, 7, table);
    const size_t kvn = (size_t)rows * base.max_blocks * BLOCK * HKV * D, kv_bytes = 2 * (size_t)rows * ctx * HKV * D * 2;
    const int copies = (int)std::min<size_t>(32, std::max<size_t>(1, ((size_t)320 << 20) / (4 * kvn) + 1));
    std::vector<Attn> as;
    for (int cpy = 0; cpy < copies; ++cpy) {
        bf16 *k, *v;
        CK(cudaMalloc(&k, kvn * 2));
        CK(cudaMalloc(&v, kvn * 2));
        fill_bf16<<<1024, 256>>>(k, kvn, 2 * cpy + 2, 2.0f);
        fill_bf16<<<1024, 256>>>(v, kvn, 2 * cpy + 3, 1.0f);
        Attn x = base;
        x.k = k;
        x.v = v;
        as.push_back(x);
    }
    prepare<TP, NS, K2, CL>();
    CK(cudaDeviceSynchronize());
    cudaStream_t s;
    CK(cudaStreamCreate(&s));
    const int per_graph = std::max(copies, 20);
    const double ms = time_graph(s, [&](cudaStream_t s2) { for (int i = 0; i < per_graph; ++i) launch_decode<TP, NS, K2, CL>(as[i % copies], rows, s2); }, 20);
    const double ms_chain = time_graph(s, [&](cudaStream_t s2) {
        for (int i = 0; i < per_graph; ++i)
            launch_pieces<TP, NS, K2, CL>(as[i % copies], rows, s2);
    }, 20);
    const double us = 1000.0 * ms / per_graph, us_pieces = 1000.0 * ms_chain / per_graph;
    const double floor_us = kv_bytes / (copy_gbs * 1e3);  // the bytes over the copy rate, as the bench's floors
    printf("decode TP=%u NS=%u K2=%d CL=%u batch %3u ctx %5u: %8.2f us a layer (pieces %8.2f alone), %5.0f GB/s of keys and values; "
           "floor %7.2f us at %.0f GB/s, %.2fx\n",
           TP, NS, (int)K2, CL, rows, ctx, us, us_pieces, kv_bytes / (us * 1e3), floor_us, copy_gbs, us / floor_us);
    for (auto& x : as) {
        CK(cudaFree((void*)x.k));
        CK(cudaFree((void*)x.v));
    }
    free_attn(base);
    CK(cudaStreamDestroy(s));
}

// Device-to-device copy rate (read + write) over 1 GiB, GB/s.
static double copy_rate() {
    const size_t n = (size_t)1 << 30;
    void *a, *b;
    CK(cudaMalloc(&a, n));
    CK(cudaMalloc(&b, n));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    std::vector<double> t;
    for (int i = 0; i < 7; ++i) {
        CK(cudaEventRecord(e0));
        CK(cudaMemcpy(b, a, n, cudaMemcpyDeviceToDevice));
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        t.push_back(ms);
    }
    CK(cudaFree(a));
    CK(cudaFree(b));
    return 2.0 * n / (median(t) * 1e6);
}

template <uint32_t TP, uint32_t NS, bool K2, uint32_t CL = 0>
static size_t run_all(double gbs) {
    size_t bad = 0;
    bad += check<TP, NS, K2, CL>({1, 17, 64, 65, 200, 1025}, 11);
    bad += check<TP, NS, K2, CL>({4097, 3000, 130, 64 * TP * 3, 64 * TP * 3 + 1}, 12);
    time_decode<TP, NS, K2, CL>(1, 1025, gbs);
    time_decode<TP, NS, K2, CL>(1, 32769, gbs);
    time_decode<TP, NS, K2, CL>(32, 8193, gbs);
    return bad;
}

int main(int argc, char** argv) {
    setvbuf(stdout, nullptr, _IOLBF, 0);
    g_verbose = argc > 1 && strcmp(argv[1], "verbose") == 0;
    const double gbs = copy_rate();
    printf("device-to-device copy %.0f GB/s (read + write)\n", gbs);
    size_t bad = 0;
    if (g_verbose) bad += check<4, 2, false>({65}, 3);
    bad += run_all<4, 2, true, 16>(gbs);
    bad += run_all<2, 2, true, 16>(gbs);
    bad += run_all<4, 2, true, 8>(gbs);
    bad += run_all<4, 3, true>(gbs);
    bad += run_all<8, 2, true>(gbs);
    bad += run_all<2, 0, true>(gbs);
    printf("%s\n", bad ? "FAILED" : "all checks bitwise");
    return bad ? 1 : 0;
}
