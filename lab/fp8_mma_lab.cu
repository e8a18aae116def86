// FP8 MMA lab: can FP8 weights and FP8 activations (e4m3, the official packs' intent) run on the
// tensor cores with the same sums in the decode kernels (mma.sync m16n8k32) and the prefill
// kernels (wgmma m64n8k32), and what sum does one instruction compute? Today every FP8 path
// converts the weight to bf16 first (bitwise the bf16 GEMM of the dequantized weight); a prefill
// 1.4x faster than bf16 needs FP8 tensor cores, and then decode must take the same sums.
//
// For random e4m3 A (64 x K) and B (8 x K) and a random f32 start C (K = 32 and 128, one FP8
// block), it prints:
// - how many of the 512 outputs differ between the mma.sync chain and the wgmma chain (the same
//   32 k to each instruction, in order), and with the wgmma's slots reversed (the same k set);
// - between wgmma chains: m64n8k32 against m64n64k32 on the same 8 columns (56 more random ones
//   beside them), and m64n8k32 against itself on reversed slots: whether kernels that all run
//   wgmma with the weight as A (decode at 8 tokens, prefill at 64 or more) share their sums;
// - for one instruction (K = 32), how many outputs equal the host's candidate models of it:
//   (a) C + (the exact sum of the 32 products), rounded to f32 once; (b) the products summed
//   exactly, rounded to f32, then added to C in f32; and the largest distance, in units of the
//   output's last place, from (a): the sum a CPU twin would have to reproduce.
//
// Build: lab/build.sh (target/gemm-lab/fp8_mma_lab); run with no arguments.
#include <cuda_runtime.h>
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

typedef __nv_bfloat16 bf16;
#include "lab_util.cuh"

constexpr int M = 64, N = 8;

// d (+)= A B for one m16n8k32 e4m3 tile (A: a0 row g k 4q..4q+3, a1 row g + 8, a2 / a3 the same
// at k + 16; B: b0 column g k 4q..4q+3, b1 at k + 16; four e4m3 a register, lowest k first).
__device__ __forceinline__ void mma_e4m3(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// A thread's m16n8-shaped fragment (rows r0 and r1, columns n0 and n0 + 1) into `out` [M][N].
__device__ __forceinline__ void store_frag(float* out, int r0, int r1, int n0, const float* d) {
    out[r0 * N + n0] = d[0];
    out[r0 * N + n0 + 1] = d[1];
    out[r1 * N + n0] = d[2];
    out[r1 * N + n0 + 1] = d[3];
}

__device__ __forceinline__ uint32_t load4(const uint8_t* p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

// The reference: four warps, warp w on rows 16 w..16 w + 15, an mma.sync chain over k.
__global__ void __launch_bounds__(128) mma_ref(float* out, const uint8_t* a, const uint8_t* b, const float* c,
                                               int k) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
    const int r0 = 16 * warp + g, r1 = r0 + 8, n0 = 2 * q;
    float d[4] = {c[r0 * N + n0], c[r0 * N + n0 + 1], c[r1 * N + n0], c[r1 * N + n0 + 1]};
    for (int k0 = 0; k0 < k; k0 += 32) {
        const uint32_t fa[4] = {load4(a + r0 * k + k0 + 4 * q), load4(a + r1 * k + k0 + 4 * q),
                                load4(a + r0 * k + k0 + 16 + 4 * q), load4(a + r1 * k + k0 + 16 + 4 * q)};
        const uint32_t fb[2] = {load4(b + g * k + k0 + 4 * q), load4(b + g * k + k0 + 16 + 4 * q)};
        mma_e4m3(d, fa, fb);
    }
    store_frag(out, r0, r1, n0, d);
}

__device__ __forceinline__ uint64_t desc(const void* p, uint32_t lbo, uint32_t sbo) {
    const uint32_t s = (uint32_t)__cvta_generic_to_shared(p);
    return (uint64_t)((s & 0x3FFFF) >> 4) | ((uint64_t)(lbo >> 4) << 16) | ((uint64_t)(sbo >> 4) << 32);
}

// Rows 0..rows of a row-major e4m3 operand (`k` a row), its k0..k0 + 31 (reversed with REV),
// into `s` k-major without swizzle: core matrices of 8 rows x 16 bytes, lbo 128 between the two
// k halves, sbo 256 between row groups. `row(r)` gives row r's bytes. By the block's threads.
template <typename Row>
__device__ __forceinline__ void stage_k32(uint8_t* s, int rows, int k0, bool rev, Row&& row) {
    for (int i = threadIdx.x; i < rows * 32; i += blockDim.x) {
        const int r = i / 32, kk = i % 32;
        s[((r / 8) * 2 + kk / 16) * 128 + (r % 8) * 16 + kk % 16] = row(r)[k0 + (rev ? 31 - kk : kk)];
    }
}

// d[NW / 2] += A B by one wgmma m64n{NW}k32 (e4m3, f32 accumulate), both operands by descriptor.
template <int NW>
__device__ __forceinline__ void wg_e4m3(float (&d)[NW / 2], uint64_t da, uint64_t db) {
    if constexpr (NW == 8) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0, %1, %2, %3}, %4, %5, p, 1, 1;\n}\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "l"(da), "l"(db));
    } else {
        static_assert(NW == 64, "NW is 8 or 64");
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, "
            "%11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, "
            "%31}, %32, %33, p, 1, 1;\n}\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
              "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
              "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]),
              "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
              "+f"(d[30]), "+f"(d[31])
            : "l"(da), "l"(db));
    }
}

// The candidate: one warpgroup, a wgmma m64n{NW}k32 per 32 k, operands staged k-major without
// swizzle (core matrices of 8 rows x 16 bytes: lbo 128 between the two k halves, sbo 256
// between row groups). REV stages each 32 k in reverse order, in both operands: the same k set
// and pairs, other slots (whether only the set counts, as for bf16). NW 64: B's 8 rows and 56
// more (`bx`, random), C's 8 columns beside 56 zero ones, the first 8 columns written; whether an
// output's FP8 sum depends on the instruction's N (a decode kernel of 8 tokens and a prefill
// kernel of 64 or more that both put the weight in A agree only if it does not).
template <int NW, bool REV>
__global__ void __launch_bounds__(128) wg_cand(float* out, const uint8_t* a, const uint8_t* b, const uint8_t* bx,
                                               const float* c, int k) {
    __shared__ __align__(128) uint8_t sa[M * 32];
    __shared__ __align__(128) uint8_t sb[NW * 32];
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, q = lane % 4;
    const int r0 = 16 * warp + g, r1 = r0 + 8, n0 = 2 * q;
    float d[NW / 2] = {};
    d[0] = c[r0 * N + n0];
    d[1] = c[r0 * N + n0 + 1];
    d[2] = c[r1 * N + n0];
    d[3] = c[r1 * N + n0 + 1];
    for (int k0 = 0; k0 < k; k0 += 32) {
        __syncthreads();
        stage_k32(sa, M, k0, REV, [&](int r) { return a + r * k; });
        stage_k32(sb, NW, k0, REV, [&](int r) { return r < N ? b + r * k : bx + (r - N) * k; });
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
        wg_e4m3<NW>(d, desc(sa, 128, 256), desc(sb, 128, 256));
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    }
    store_frag(out, r0, r1, n0, d);
}

static int ulps(float x, float y) {
    int32_t a, b;
    memcpy(&a, &x, 4);
    memcpy(&b, &y, 4);
    if ((a < 0) != (b < 0)) return x == y ? 0 : 1 << 30;
    return std::abs(a - b);
}

int main() {
    int bad = 0;
    for (int k : {32, 128}) {
        for (float cscale : {0.0f, 1.0f, 1000.0f}) {
            uint8_t *a, *b, *bx;
            float *c, *ref, *cand, *rev, *wide;
            CK(cudaMalloc(&a, M * k));
            CK(cudaMalloc(&b, N * k));
            CK(cudaMalloc(&c, M * N * 4));
            CK(cudaMalloc(&ref, M * N * 4));
            CK(cudaMalloc(&cand, M * N * 4));
            CK(cudaMalloc(&rev, M * N * 4));
            CK(cudaMalloc(&wide, M * N * 4));
            CK(cudaMalloc(&bx, 56 * k));
            fill_u8<<<16, 256>>>(bx, 56 * k, 11 + k);
            fill_u8<<<16, 256>>>(a, M * k, 7 + k);
            fill_u8<<<16, 256>>>(b, N * k, 9 + k);
            std::vector<float> hc(M * N);
            for (int i = 0; i < M * N; ++i) hc[i] = cscale * std::sin(0.37 * i + 1.0);
            CK(cudaMemcpy(c, hc.data(), M * N * 4, cudaMemcpyHostToDevice));
            CK(cudaMemset(ref, 0xFF, M * N * 4));
            CK(cudaMemset(cand, 0xFF, M * N * 4));
            CK(cudaMemset(rev, 0xFF, M * N * 4));
            CK(cudaMemset(wide, 0xFF, M * N * 4));
            wg_cand<64, false><<<1, 128>>>(wide, a, b, bx, c, k);
            mma_ref<<<1, 128>>>(ref, a, b, c, k);
            wg_cand<8, false><<<1, 128>>>(cand, a, b, nullptr, c, k);
            wg_cand<8, true><<<1, 128>>>(rev, a, b, nullptr, c, k);
            CK(cudaDeviceSynchronize());
            std::vector<float> hr(M * N), hw(M * N), hv(M * N), hx(M * N);
            CK(cudaMemcpy(hx.data(), wide, M * N * 4, cudaMemcpyDeviceToHost));
            std::vector<uint8_t> ha(M * k), hb(N * k);
            CK(cudaMemcpy(hr.data(), ref, M * N * 4, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(hw.data(), cand, M * N * 4, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(hv.data(), rev, M * N * 4, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(ha.data(), a, M * k, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(hb.data(), b, N * k, cudaMemcpyDeviceToHost));
            int diff = 0, rdiff = 0, wdiff = 0, sdiff = 0;
            for (int i = 0; i < M * N; ++i) {
                diff += memcmp(&hr[i], &hw[i], 4) != 0;
                rdiff += memcmp(&hr[i], &hv[i], 4) != 0;
                wdiff += memcmp(&hw[i], &hx[i], 4) != 0;
                sdiff += memcmp(&hw[i], &hv[i], 4) != 0;
            }
            printf("K=%3d C scale %6g: wgmma n8 vs n64 (the same 8 columns): %d of %d differ; n8 vs its reversed "
                   "slots: %d differ\n",
                   k, cscale, wdiff, M * N, sdiff);
            printf("K=%3d C scale %6g: mma.sync vs wgmma: %d of %d differ; vs wgmma on reversed slots: %d differ\n", k,
                   cscale, diff, M * N, rdiff);
            bad += diff != 0;
            if (k == 32) {
                int model_a = 0, model_b = 0, worst = 0;
                for (int r = 0; r < M; ++r)
                    for (int n = 0; n < N; ++n) {
                        double s = 0.0;  // exact: 32 products of 4-bit significands fit a double
                        for (int kk = 0; kk < 32; ++kk) s += e4m3_value(ha[r * k + kk]) * e4m3_value(hb[n * k + kk]);
                        const float got = hr[r * N + n], cv = hc[r * N + n];
                        const float fa = (float)((double)cv + s), fb = cv + (float)s;
                        model_a += memcmp(&got, &fa, 4) == 0;
                        model_b += memcmp(&got, &fb, 4) == 0;
                        worst = std::max(worst, ulps(got, fa));
                    }
                printf("          one instruction: %d of %d equal fl(C + exact), %d equal C + fl(exact); "
                       "largest distance from fl(C + exact) %d ulp\n",
                       model_a, M * N, model_b, worst);
            }
            CK(cudaFree(a)); CK(cudaFree(b)); CK(cudaFree(c)); CK(cudaFree(ref)); CK(cudaFree(cand));
            CK(cudaFree(rev)); CK(cudaFree(wide)); CK(cudaFree(bx));
        }
    }
    printf("fp8 mma lab: %d of 6 cases differ between mma.sync and wgmma\n", bad);
    return 0;
}
