// wgmma attention lab: can a warpgroup MMA attention kernel (the building blocks a
// FlashAttention-3-style prefill kernel needs) reproduce the engine's attention arithmetic bit
// for bit? The reference is `atp_unit` of kernels/attention_prefill.cuh (four warps, one 16-row
// tile each, mma.sync): per 16-token unit, scores in two chains (even and odd k steps of 16
// dimensions), `att_softmax_row`, the running outputs rescaled unless no maximum moved, P V.
// The candidates run one warpgroup over the same 64 virtual rows and units:
// - scores S = Q Kᵀ by wgmma from shared memory, one m64n16k16 per k step and unit (SN 16), or
//   one m64n64k16 per k step for four units at once (SN 64, sliced into units for the softmax:
//   an element's sum depends only on its 16 k, whatever N);
// - the softmax of kernels/attention_unit.cuh on the accumulator fragments (a wgmma's fragment
//   of rows 16 w..16 w + 15 is mma.sync's m16n8 fragment for each 8 columns);
// - O += P V by m64n128k16 with P as the register A operand (mma.sync's A fragment) and V by
//   descriptor: VT 0 with V stored transposed (dimensions as N rows, tokens as K, k-major),
//   VT 1 and 2 with V as stored in the cache (tokens as K rows, dimensions contiguous) and the
//   instruction's transpose of B, under the two readings of the descriptor's strides.
// Every operand is in the no-swizzle core-matrix layout (8 rows of 16 bytes a core matrix).
// Prints, per candidate and case, how many outputs (the unnormalized O, the maxima and the sums
// of every row) differ from the reference; the first candidate of each line that matches is the
// layout a fast kernel can use. Context lengths and the causal mask are the prefill's: virtual
// row v = 4 j + h (head h of position p0 + j), context p0 + j + 1.
//
// Build: lab/build.sh (target/gemm-lab/wgmma_attention_lab); run with no arguments.
#include "../kernels/attention.cu"

#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <vector>

#include "lab_util.cuh"

constexpr int D = 128;         // head_dim
constexpr int HB = 4;          // heads a key/value head (Qwen3-8B)
constexpr int VROWS = 64;      // virtual rows of an item
constexpr int RS = D + 8;      // the reference's padded rows

// The no-swizzle descriptor: lbo and sbo in bytes.
MT_DEVICE uint64_t lab_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)(lbo >> 4) << 16) | ((uint64_t)(sbo >> 4) << 32);
}

MT_DEVICE void lab_wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
MT_DEVICE void lab_wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
MT_DEVICE void lab_wg_wait() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }

// d[8] += A B, A 64 x 16 and B 16 x 16 (k-major), both by descriptor.
MT_DEVICE void wg_m64n16(float (&d)[8], uint64_t da, uint64_t db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, "
        "1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "l"(da), "l"(db));
}

#define LAB_ACC32_REGS                                                                                        \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
    "%23, %24, %25, %26, %27, %28, %29, %30, %31"
#define LAB_ACC4(d, i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define LAB_ACC16(d, i) LAB_ACC4(d, i), LAB_ACC4(d, i + 4), LAB_ACC4(d, i + 8), LAB_ACC4(d, i + 12)

// d[32] += A B, A 64 x 16 and B 64 x 16 (k-major), both by descriptor.
MT_DEVICE void wg_m64n64(float (&d)[32], uint64_t da, uint64_t db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" LAB_ACC32_REGS
                 "}, %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : LAB_ACC16(d, 0), LAB_ACC16(d, 16)
                 : "l"(da), "l"(db));
}

#define LAB_ACC64_REGS                                                                                        \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
    "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, " \
    "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"

// d[64] += A B: A 64 x 16 from registers (mma.sync's A fragment per warp), B by descriptor,
// transposed (TB 1: B's N contiguous) or not (k-major).
template <int TB>
MT_DEVICE void wg_m64n128_rs(float (&d)[64], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint64_t db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" LAB_ACC64_REGS
                 "}, {%64, %65, %66, %67}, %68, p, 1, 1, %69;\n}\n"
                 : LAB_ACC16(d, 0), LAB_ACC16(d, 16), LAB_ACC16(d, 32), LAB_ACC16(d, 48)
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(db), "n"(TB));
}

// One item: q [64][D] (virtual rows), k and v [ctx_max][D] (the item's key/value head), and the
// positions p0 .. p0 + 15 of its rows; outputs o [64][D] (unnormalized), m [64], l [64].
struct Item {
    const bf16* q;
    const bf16* k;
    const bf16* v;
    uint32_t p0;
};

MT_DEVICE uint32_t lab_ctx(uint32_t p0, uint32_t vrow) { return p0 + vrow / HB + 1; }

// The reference: four warps, warp w on tile w, the engine's prefill unit (atp_unit) over every
// unit up to the item's last context.
__global__ void __launch_bounds__(128) ref_kernel(Item it, float* o_out, float* m_out, float* l_out) {
    __shared__ __align__(16) bf16 qs[VROWS * RS];
    __shared__ __align__(16) bf16 stage[2 * ATT_UNIT * RS];
    const uint32_t tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, c = lane % 4;
    for (uint32_t i = tid; i < VROWS * D; i += 128) qs[(i / D) * RS + i % D] = it.q[i];
    const uint32_t ctx_max = lab_ctx(it.p0, VROWS - 1), units = (ctx_max + ATT_UNIT - 1) / ATT_UNIT;
    const uint32_t ctx0 = lab_ctx(it.p0, 16 * warp + g), ctx1 = lab_ctx(it.p0, 16 * warp + g + 8);
    float o[D / 8][4] = {}, m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    const float scale_log2 = ATT_LOG2E / sqrtf((float)D);
    for (uint32_t u = 0; u < units; ++u) {
        __syncthreads();
        for (uint32_t i = tid; i < ATT_UNIT * D; i += 128) {
            const uint32_t t = i / D, e = i % D, tok = u * ATT_UNIT + t;
            const bool live = tok < ctx_max;
            stage[t * RS + e] = live ? it.k[(size_t)tok * D + e] : __float2bfloat16(0.0f);
            stage[(ATT_UNIT + t) * RS + e] = live ? it.v[(size_t)tok * D + e] : __float2bfloat16(0.0f);
        }
        __syncthreads();
        atp_unit<D, D>(stage, qs, warp, 0, u, ctx0, ctx1, scale_log2, u == 0, lane, o, m, l);
    }
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            o_out[(16 * warp + g + (e >= 2 ? 8 : 0)) * D + 8 * n + 2 * c + (e & 1)] = o[n][e];
    if (c == 0) {
        m_out[16 * warp + g] = m[0];
        m_out[16 * warp + g + 8] = m[1];
        l_out[16 * warp + g] = l[0];
        l_out[16 * warp + g + 8] = l[1];
    }
}

// Byte offset of element (row r, k) in a k-major no-swizzle operand of `rows` rows and K 16 a
// step: step k / 16 a block of rows * 32 bytes; in it core matrix (r / 8, k-half) at
// ((r / 8) * 2 + half) * 128, its row r % 8 at 16 (r % 8). Descriptor: lbo 128 (the k-halves),
// sbo 256 (the 8-row groups).
__host__ __device__ constexpr uint32_t kmaj_off(uint32_t rows, uint32_t r, uint32_t k) {
    return (k / 16) * rows * 32 + ((r / 8) * 2 + (k % 16) / 8) * 128 + (r % 8) * 16 + (k % 8) * 2;
}

// Byte offset of V's element (token k of 16, dimension n) for the transposed-B readings (VT 1,
// 2): core matrix (n / 8, k / 8) at ((n / 8) * 2 + k / 8) * 128, its row k % 8 holding
// dimensions 8 (n / 8) .. + 7.
__host__ __device__ constexpr uint32_t mn_off(uint32_t n, uint32_t k) {
    return ((n / 8) * 2 + k / 8) * 128 + (k % 8) * 16 + (n % 8) * 2;
}

// One warpgroup over the item, S by m64n{SN}k16, V read as VT says (see the header).
template <int SN, int VT>
__global__ void __launch_bounds__(128) wg_kernel(Item it, float* o_out, float* m_out, float* l_out) {
    constexpr uint32_t UNITS = SN / ATT_UNIT;  // units a score tile spans
    __shared__ __align__(128) unsigned char qs[VROWS * D * 2];
    __shared__ __align__(128) unsigned char ks[SN * D * 2];
    __shared__ __align__(128) unsigned char vs[UNITS * ATT_UNIT * D * 2];
    const uint32_t tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, c = lane % 4;
    for (uint32_t i = tid; i < VROWS * D; i += 128)
        *reinterpret_cast<bf16*>(qs + kmaj_off(VROWS, i / D, i % D)) = it.q[i];
    const uint32_t ctx_max = lab_ctx(it.p0, VROWS - 1), units = (ctx_max + ATT_UNIT - 1) / ATT_UNIT;
    const uint32_t ctx0 = lab_ctx(it.p0, 16 * warp + g), ctx1 = lab_ctx(it.p0, 16 * warp + g + 8);
    const uint32_t qa = (uint32_t)__cvta_generic_to_shared(qs), ka = (uint32_t)__cvta_generic_to_shared(ks),
                   va = (uint32_t)__cvta_generic_to_shared(vs);
    float o[64] = {}, m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    const float scale_log2 = ATT_LOG2E / sqrtf((float)D);
    for (uint32_t u0 = 0; u0 < units; u0 += UNITS) {
        __syncthreads();
        for (uint32_t i = tid; i < SN * D; i += 128) {
            const uint32_t t = i / D, e = i % D, tok = u0 * ATT_UNIT + t;
            const bool live = tok < ctx_max;
            const bf16 kv = live ? it.k[(size_t)tok * D + e] : __float2bfloat16(0.0f);
            const bf16 vv = live ? it.v[(size_t)tok * D + e] : __float2bfloat16(0.0f);
            *reinterpret_cast<bf16*>(ks + kmaj_off(SN, t, e)) = kv;
            // Unit t / 16's V, 4 KiB a unit.
            const uint32_t ub = (t / ATT_UNIT) * ATT_UNIT * D * 2, tk = t % ATT_UNIT;
            const uint32_t voff = VT == 0 ? kmaj_off(D, e, tk) : mn_off(e, tk);
            *reinterpret_cast<bf16*>(vs + ub + voff) = vv;
        }
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
        // Scores: chain 0 the even k steps, chain 1 the odd ones, as the reference.
        float s[2][SN / 2] = {};
        lab_wg_fence();
#pragma unroll
        for (int t = 0; t < D / 16; ++t) {
            const uint64_t dq = lab_desc(qa + t * VROWS * 32, 128, 256), dk = lab_desc(ka + t * SN * 32, 128, 256);
            if constexpr (SN == 16)
                wg_m64n16(s[t & 1], dq, dk);
            else
                wg_m64n64(s[t & 1], dq, dk);
        }
        lab_wg_commit();
        lab_wg_wait();
        for (uint32_t j = 0; j < UNITS && u0 + j < units; ++j) {
            const uint32_t u = u0 + j;
            // The unit's columns 16 j .. 16 j + 15: n8 blocks 2 j and 2 j + 1.
            float s0[2][2][2], s1[2][2][2];  // [row g | g + 8][n-tile][c0, c1]
#pragma unroll
            for (int rh = 0; rh < 2; ++rh)
#pragma unroll
                for (int n = 0; n < 2; ++n)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        s0[rh][n][e] = s[0][4 * (2 * j + n) + 2 * rh + e];
                        s1[rh][n][e] = s[1][4 * (2 * j + n) + 2 * rh + e];
                    }
            float corr[2];
            uint32_t pa[2][2];
            att_softmax_row(s0[0], s1[0], u, ctx0, scale_log2, c, m[0], l[0], corr[0], pa[0]);
            att_softmax_row(s0[1], s1[1], u, ctx1, scale_log2, c, m[1], l[1], corr[1], pa[1]);
            if (att_rescale(u == 0, corr[0] != 1.0f || corr[1] != 1.0f)) {
#pragma unroll
                for (int i = 0; i < 64; ++i) o[i] *= corr[(i & 2) ? 1 : 0];
            }
            const uint32_t vb = va + j * ATT_UNIT * D * 2;
            const uint64_t dv = VT == 0   ? lab_desc(vb, 128, 256)
                                : VT == 1 ? lab_desc(vb, 128, 256)
                                          : lab_desc(vb, 256, 128);
            lab_wg_fence();
            wg_m64n128_rs<VT == 0 ? 0 : 1>(o, pa[0][0], pa[1][0], pa[0][1], pa[1][1], dv);
            lab_wg_commit();
            lab_wg_wait();
        }
    }
    for (int i = 0; i < 64; ++i)
        o_out[(16 * warp + g + ((i & 2) ? 8 : 0)) * D + 8 * (i / 4) + 2 * c + (i & 1)] = o[i];
    if (c == 0) {
        m_out[16 * warp + g] = m[0];
        m_out[16 * warp + g + 8] = m[1];
        l_out[16 * warp + g] = l[0];
        l_out[16 * warp + g + 8] = l[1];
    }
}

struct Outs {
    float *o, *m, *l;
};

static Outs alloc_outs() {
    Outs r;
    CK(cudaMalloc(&r.o, VROWS * D * 4));
    CK(cudaMalloc(&r.m, VROWS * 4));
    CK(cudaMalloc(&r.l, VROWS * 4));
    CK(cudaMemset(r.o, 0xFF, VROWS * D * 4));  // poisoned: an unwritten output differs
    CK(cudaMemset(r.m, 0xFF, VROWS * 4));
    CK(cudaMemset(r.l, 0xFF, VROWS * 4));
    return r;
}

static std::vector<uint32_t> fetch(const Outs& r) {
    std::vector<uint32_t> h(VROWS * D + 2 * VROWS);
    CK(cudaMemcpy(h.data(), r.o, VROWS * D * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(h.data() + VROWS * D, r.m, VROWS * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(h.data() + VROWS * D + VROWS, r.l, VROWS * 4, cudaMemcpyDeviceToHost));
    return h;
}

int main() {
    // Positions of the item's first row: a first chunk, rows across a unit boundary late in a
    // prompt, and a long context (many units, most maxima settled).
    const uint32_t p0s[] = {0, 37, 500, 2032};
    const float scales[] = {1.0f, 8.0f};  // query scale: flat and peaked softmax
    typedef void (*Kernel)(Item, float*, float*, float*);
    struct Cand {
        const char* name;
        Kernel k;
    };
    const Cand cands[] = {
        {"S m64n16, V transposed (VT 0)", wg_kernel<16, 0>},
        {"S m64n64, V transposed (VT 0)", wg_kernel<64, 0>},
        {"S m64n16, V trans-b lbo=K sbo=N (VT 1)", wg_kernel<16, 1>},
        {"S m64n16, V trans-b lbo=N sbo=K (VT 2)", wg_kernel<16, 2>},
    };
    int bad = 0, cases = 0;
    for (float qscale : scales) {
        for (uint32_t p0 : p0s) {
            const uint32_t ctx_max = p0 + VROWS / HB;
            bf16 *q, *k, *v;
            CK(cudaMalloc(&q, VROWS * D * 2));
            CK(cudaMalloc(&k, (size_t)(ctx_max + 64) * D * 2));
            CK(cudaMalloc(&v, (size_t)(ctx_max + 64) * D * 2));
            fill_bf16<<<64, 256>>>(q, VROWS * D, p0 + 1, qscale);
            fill_bf16<<<64, 256>>>(k, (size_t)(ctx_max + 64) * D, p0 + 2, 1.0f);
            fill_bf16<<<64, 256>>>(v, (size_t)(ctx_max + 64) * D, p0 + 3, 1.0f);
            const Item it{q, k, v, p0};
            Outs ref = alloc_outs();
            ref_kernel<<<1, 128>>>(it, ref.o, ref.m, ref.l);
            CK(cudaDeviceSynchronize());
            const std::vector<uint32_t> want = fetch(ref);
            for (const Cand& cand : cands) {
                Outs got = alloc_outs();
                cand.k<<<1, 128>>>(it, got.o, got.m, got.l);
                CK(cudaDeviceSynchronize());
                const std::vector<uint32_t> have = fetch(got);
                size_t diff = 0, first = 0;
                for (size_t i = 0; i < want.size(); ++i)
                    if (want[i] != have[i]) {
                        if (!diff) first = i;
                        ++diff;
                    }
                float a, b;
                memcpy(&a, &want[first], 4);
                memcpy(&b, &have[first], 4);
                printf("%-42s p0=%4u qscale=%g: %zu of %zu differ%s", cand.name, p0, qscale, diff, want.size(),
                       diff ? "" : "\n");
                if (diff) printf(", first [%zu] %.9g vs %.9g\n", first, a, b);
                bad += diff != 0;
                ++cases;
                CK(cudaFree(got.o)); CK(cudaFree(got.m)); CK(cudaFree(got.l));
            }
            CK(cudaFree(ref.o)); CK(cudaFree(ref.m)); CK(cudaFree(ref.l));
            CK(cudaFree(q)); CK(cudaFree(k)); CK(cudaFree(v));
        }
    }
    printf("wgmma attention lab: %d of %d candidate cases differ from the mma.sync reference\n", bad, cases);
    return 0;
}
