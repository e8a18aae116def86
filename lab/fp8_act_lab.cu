// FP8 activation lab: how fast can the batch-1..8 decode GEMM of a block-FP8 weight run when the
// activations are FP8 too (e4m3 with a scale per row and 128-column block, as the official packs
// intend), so the weight bytes go to the tensor cores as they are (mma.sync m16n8k32 e4m3) with
// no conversion? `linear_stream_fp8` converts every weight pair to bf16 and is bound by
// instruction issue.
//
// The candidate: x is quantized first (`quantize_x`: per row and 128 columns, scale = amax /
// 448, each element rounded to the nearest e4m3), then each warp streams units of 16 weight rows
// by 1,024 columns (two 16-byte loads a lane per 64 columns, rows g and g + 8; a lane's bytes are
// k 16 q .. 16 q + 15 of each 64, so the two MMAs of a step take k sets {0-7, 16-23, 32-39,
// 48-55} and {8-15, 24-31, ...} and x's fragment is 16 contiguous bytes), sums each 128-column
// block from zero and adds it scaled by the weight's and the row's scales; the units' sums are
// added into f32 outputs with atomics (speed only: the order varies). Printed per Qwen3-8B
// projection and m, beside `linear_stream_fp8`: the time of each (20 launches a graph, the
// weight rotated past L2; the candidate's includes its quantize launch) and each one's largest
// error against the exact weight with bf16 x, relative to the row's largest output.
//
// Build: lab/build.sh (target/gemm-lab/fp8_act_lab); run with no arguments.
#include "../kernels/gemm.cu"

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#include "lab_util.cuh"

constexpr uint32_t ACT_UNIT_K = 1024;  // columns of a work unit
constexpr uint32_t ACT_MAX_M = 8;

MT_DEVICE void mma_e4m3(float (&d)[4], uint4 a, uint2 b) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b.x), "r"(b.y));
}

// x [m, k] bf16 -> xq [m, k] e4m3 and xs [m, k / 128] f32: a warp per (row, block).
__global__ void quantize_x(uint8_t* xq, float* xs, const bf16* x, uint32_t m, uint32_t k) {
    const uint32_t kb = k / 128, warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
    if (warp >= m * kb) return;
    const uint32_t r = warp / kb, b = warp % kb;
    float v[4], amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        v[i] = __bfloat162float(x[(size_t)r * k + b * 128 + 4 * lane + i]);
        amax = fmaxf(amax, fabsf(v[i]));
    }
#pragma unroll
    for (int d = 16; d > 0; d /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, d));
    const float scale = amax > 0.0f ? amax / 448.0f : 1.0f;
    uint32_t packed = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const __nv_fp8_e4m3 q(v[i] / scale);
        packed |= (uint32_t)q.__x << (8 * i);
    }
    *reinterpret_cast<uint32_t*>(xq + (size_t)r * k + b * 128 + 4 * lane) = packed;
    if (lane == 0) xs[(size_t)r * (k / 128) + b] = scale;
}

// out [m, n] f32 (zeroed first) += the weight's units; w [n, k] e4m3, ws [n / 128, k / 128].
// n % 16 == 0 and k % 1024 == 0 here.
__global__ void __launch_bounds__(256, 2) act_gemv(float* out, const uint8_t* xq, const float* xs, const uint8_t* w,
                                                  const float* ws, uint32_t m, uint32_t n, uint32_t k) {
    extern __shared__ __align__(16) uint8_t sx[];  // xq, ACT_MAX_M rows (zeros past m)
    for (uint32_t i = threadIdx.x; i < ACT_MAX_M * k / 16; i += blockDim.x) {
        const uint32_t r = i / (k / 16), c = i % (k / 16);
        const uint4 v = r < m ? *reinterpret_cast<const uint4*>(xq + (size_t)r * k + 16 * c) : make_uint4(0, 0, 0, 0);
        *reinterpret_cast<uint4*>(sx + (size_t)r * k + 16 * c) = v;
    }
    __syncthreads();
    const uint32_t lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
    const uint32_t warps = gridDim.x * (blockDim.x / 32), wid = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const uint32_t tiles = n / 16, segs = k / ACT_UNIT_K, kb = k / 128;
    for (uint32_t u = wid; u < tiles * segs; u += warps) {
        const uint32_t tile = u / segs, seg = u % segs, r0 = tile * 16 + g, k0 = seg * ACT_UNIT_K;
        const uint8_t* w0 = w + (size_t)r0 * k + k0 + 16 * q;
        const uint8_t* w1 = w0 + (size_t)8 * k;
        const uint8_t* xr = sx + (size_t)g * k + k0 + 16 * q;
        float tot[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (uint32_t blk = 0; blk < ACT_UNIT_K / 128; ++blk) {
            uint4 a0[2], a1[2];
#pragma unroll
            for (int st = 0; st < 2; ++st) {  // the block's two 64-column steps, loaded first
                a0[st] = __ldg(reinterpret_cast<const uint4*>(w0 + blk * 128 + st * 64));
                a1[st] = __ldg(reinterpret_cast<const uint4*>(w1 + blk * 128 + st * 64));
            }
            float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int st = 0; st < 2; ++st) {
                const uint4 xb = *reinterpret_cast<const uint4*>(xr + blk * 128 + st * 64);
                // MMA 1: rows g / g + 8 bytes 0-3 and 4-7 of the lane's 16; MMA 2: bytes 8-15.
                mma_e4m3(acc, make_uint4(a0[st].x, a1[st].x, a0[st].y, a1[st].y), make_uint2(xb.x, xb.y));
                mma_e4m3(acc, make_uint4(a0[st].z, a1[st].z, a0[st].w, a1[st].w), make_uint2(xb.z, xb.w));
            }
            const uint32_t kbi = seg * (ACT_UNIT_K / 128) + blk;
            const float wsc = ws[(size_t)(tile * 16 / 128) * kb + kbi];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const uint32_t col = 2 * q + (e & 1);
                const float xsc = col < m ? xs[(size_t)col * kb + kbi] : 0.0f;
                tot[e] = fmaf(acc[e], wsc * xsc, tot[e]);
            }
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const uint32_t col = 2 * q + (e & 1), row = r0 + (e >= 2 ? 8 : 0);
            if (col < m) atomicAdd(out + (size_t)col * n + row, tot[e]);
        }
    }
}

int main() {
    const uint32_t shapes[][2] = {{6144, 4096}, {4096, 4096}, {24576, 4096}, {4096, 12288}};
    const uint32_t ms[] = {1, 4, 8};
    const int copies = 4, grid = 264;
    cudaStream_t s;
    CK(cudaStreamCreate(&s));
    for (auto& sh : shapes) {
        const uint32_t n = sh[0], k = sh[1], kb = k / 128;
        const size_t wbytes = (size_t)n * k, sbytes = (size_t)(n / 128) * kb;
        const uint32_t smem = ACT_MAX_M * k;
        CK(cudaFuncSetAttribute(act_gemv, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        uint8_t *w, *xq;
        float *sc, *xs, *o2;
        bf16 *x, *o1;
        CK(cudaMalloc(&w, wbytes * copies));
        CK(cudaMalloc(&sc, sbytes * 4 * copies));
        CK(cudaMalloc(&x, (size_t)16 * k * 2));
        CK(cudaMalloc(&xq, (size_t)16 * k));
        CK(cudaMalloc(&xs, (size_t)16 * kb * 4));
        CK(cudaMalloc(&o1, (size_t)16 * n * 2));
        CK(cudaMalloc(&o2, (size_t)16 * n * 4));
        fill_u8<<<1024, 256>>>(w, wbytes * copies, n + k);
        fill_scales<<<64, 256>>>(sc, sbytes * copies, n);
        fill_bf16<<<256, 256>>>(x, (size_t)16 * k, 7, 1.0f);
        CK(cudaDeviceSynchronize());
        std::vector<uint8_t> hw(wbytes);
        std::vector<float> hs(sbytes);
        std::vector<uint16_t> hx((size_t)16 * k);
        CK(cudaMemcpy(hw.data(), w, wbytes, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(hs.data(), sc, sbytes * 4, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(hx.data(), x, hx.size() * 2, cudaMemcpyDeviceToHost));
        for (uint32_t m : ms) {
            const uint32_t shift = 7, qblocks = (m * kb * 32 + 255) / 256;
            auto candidate = [&](cudaStream_t st, int c) {
                CK(cudaMemsetAsync(o2, 0, (size_t)m * n * 4, st));
                quantize_x<<<qblocks, 256, 0, st>>>(xq, xs, x, m, k);
                act_gemv<<<grid, 256, smem, st>>>(o2, xq, xs, w + c * wbytes, sc + c * sbytes, m, n, k);
            };
            CK(cudaMemset(o1, 0xFF, (size_t)16 * n * 2));
            linear_stream_fp8<<<grid, 256, 0, s>>>(o1, x, w, sc, m, n, k, shift);
            candidate(s, 0);
            CK(cudaStreamSynchronize(s));
            std::vector<uint16_t> h1((size_t)m * n);
            std::vector<float> h2((size_t)m * n);
            CK(cudaMemcpy(h1.data(), o1, h1.size() * 2, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(h2.data(), o2, h2.size() * 4, cudaMemcpyDeviceToHost));
            // Errors against the exact weight (with bf16 x), relative to the row's largest output.
            const Fp8Exact exact = fp8_exact(hw, hs, hx, m, n, k);
            const double e1 = fp8_max_error(exact, [&](size_t r, uint32_t c) { return bf16_value(h1[r * n + c]); });
            const double e2 = fp8_max_error(exact, [&](size_t r, uint32_t c) { return (double)h2[r * n + c]; });
            auto rec = [&](bool cand) {
                return [&, cand](cudaStream_t st) {
                    for (int it = 0; it < 20; ++it) {
                        const int c = it % copies;
                        if (cand)
                            candidate(st, c);
                        else
                            linear_stream_fp8<<<grid, 256, 0, st>>>(o1, x, w + c * wbytes, sc + c * sbytes, m, n, k,
                                                                     shift);
                    }
                };
            };
            const double t1 = time_graph(s, rec(false), 10) * 1000.0 / 20;
            const double t2 = time_graph(s, rec(true), 10) * 1000.0 / 20;
            printf("n=%5u k=%5u m=%u: linear_stream_fp8 %.2f us (%.2f TB/s) err %.2e | e4m3 x e4m3 %.2f us (%.2f TB/s) "
                   "err %.2e\n",
                   n, k, m, t1, wbytes / t1 / 1e6, e1, t2, wbytes / t2 / 1e6, e2);
        }
        CK(cudaFree(w)); CK(cudaFree(sc)); CK(cudaFree(x)); CK(cudaFree(xq)); CK(cudaFree(xs));
        CK(cudaFree(o1)); CK(cudaFree(o2));
    }
    return 0;
}
