// FP8 exact lab: a candidate numerics for the block-FP8 decode GEMM, timed against
// `linear_stream_fp8` (whose weight is bf16(e4m3 * scale'), converted with integer work,
// two f32 multiplies and a conversion per pair). The candidate keeps each weight as its exact
// e4m3 value: the hardware conversion `cvt.rn.f16x2.e4m3x2` makes the f16 MMA operand (e4m3
// is a subset of f16), x is converted from bf16 to f16 as it is loaded (exact for |x| in [2^-14, 65504]), the MMA
// chain of each 128-wide scale block starts from zero in its own accumulator, and the block's
// scale multiplies it into the segment's sum (one FMA per accumulator per block): the weight is
// e4m3 * scale as the packs define it, with no rounding of the weight. Same units, batches and
// segment order as `linear_fp8_swapped` (one token tile, m <= 8).
//
// Prints, per Qwen3-8B projection and m: both kernels' times (CUDA graphs of 20 launches, the
// weight rotated past L2), and each kernel's largest error relative to the row's largest output
// against a host reference in double on the exact weight. Build: nvcc as lab/build.sh does.
#include "../kernels/gemm.cu"

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#include "lab_util.cuh"

MT_DEVICE void mma16816_f16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                            uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Two e4m3 bytes (the low 16 bits of `v`) as an f16 pair, low element first.
MT_DEVICE uint32_t e4m3x2_f16(uint32_t v) {
    uint32_t r;
    asm("{\n .reg .b16 t;\n cvt.u16.u32 t, %1;\n cvt.rn.f16x2.e4m3x2 %0, t;\n}\n" : "=r"(r) : "r"(v));
    return r;
}

// A lane's 8 e4m3 bytes as the f16 MMA fragment (k order, as `fp8_frag`).
MT_DEVICE uint4 e4m3_frag(uint2 q) {
    return make_uint4(e4m3x2_f16(q.x), e4m3x2_f16(q.x >> 16), e4m3x2_f16(q.y), e4m3x2_f16(q.y >> 16));
}

// A bf16 pair as an f16 pair.
MT_DEVICE uint32_t bf16x2_f16(uint32_t v) {
    const float lo = __uint_as_float(v << 16), hi = __uint_as_float(v & 0xFFFF0000u);
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
}

template <int B>
struct ExactBatch {
    uint2 lo[B], hi[B];
    float s_lo[B / 4], s_hi[B / 4];
};

__global__ void __launch_bounds__(LIN_STREAM_WARPS * 32, 2)
    lab_fp8_exact(bf16* out, const bf16* x, const uint8_t* w, const float* scales, uint32_t m, uint32_t n,
                  uint32_t k, uint32_t shift) {
    constexpr int B = 8;
    float4(*part)[LIN_STREAM_WARPS * 32] = lin_direct_part();
    const uint32_t kblocks = (k + FP8_BLOCK - 1) / FP8_BLOCK;
    const uint32_t tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
    const LinSegment span = lin_segment(k, warp);
    const uint32_t units = (n + 15) / 16;
    const uint32_t mine = blockIdx.x < units ? (units - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
    const uint32_t seg_batches = (span.c_end - span.c_begin) / B;
    const uint32_t total = mine * seg_batches;
    const bf16* xg = x + (size_t)g * k + q * 8;
    auto unit_of = [&](uint32_t t) { return blockIdx.x + (t / seg_batches) * gridDim.x; };
    auto load = [&](ExactBatch<B>& d, uint32_t t) {
        const uint32_t row = unit_of(t) * 16 + g, c0 = span.c_begin + (t % seg_batches) * B;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const uint32_t r = row + 8 * h;
            uint2* dst = h ? d.hi : d.lo;
            float* s = h ? d.s_hi : d.s_lo;
            const bool in = r < n;
            const uint8_t* p = w + (size_t)r * k + c0 * LIN_KC + q * 8;
            const float* sp = scales + (size_t)(r >> shift) * kblocks + c0 / 4;
#pragma unroll
            for (int ch = 0; ch < B; ++ch) dst[ch] = in ? ldg_stream8(p + ch * LIN_KC) : make_uint2(0, 0);
#pragma unroll
            for (int j = 0; j < B / 4; ++j) s[j] = in ? __ldg(sp + j) : 0.0f;
        }
    };
    float acc[4];
    auto compute = [&](const ExactBatch<B>& d, uint32_t t) {
        const uint32_t bb = t % seg_batches, c0 = span.c_begin + bb * B;
        if (bb == 0) acc[0] = acc[1] = acc[2] = acc[3] = 0.0f;
        uint4 xr[B];
#pragma unroll
        for (int ch = 0; ch < B; ++ch) xr[ch] = g < m ? load16(xg + (size_t)(c0 + ch) * LIN_KC) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int j = 0; j < B / 4; ++j) {
            float blk[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int ch = 4 * j + c;
                const uint4 wl = e4m3_frag(d.lo[ch]), wh = e4m3_frag(d.hi[ch]);
                const uint4 xb = make_uint4(bf16x2_f16(xr[ch].x), bf16x2_f16(xr[ch].y), bf16x2_f16(xr[ch].z),
                                            bf16x2_f16(xr[ch].w));
                mma16816_f16(blk, wl.x, wh.x, wl.y, wh.y, xb.x, xb.y);
                mma16816_f16(blk, wl.z, wh.z, wl.w, wh.w, xb.z, xb.w);
            }
            acc[0] = fmaf(d.s_lo[j], blk[0], acc[0]);
            acc[1] = fmaf(d.s_lo[j], blk[1], acc[1]);
            acc[2] = fmaf(d.s_hi[j], blk[2], acc[2]);
            acc[3] = fmaf(d.s_hi[j], blk[3], acc[3]);
        }
        if (bb + 1 < seg_batches) return;
        float4* pp = part[(t / seg_batches) & 1];
        pp[warp * 32 + lane] = make_float4(acc[0], acc[1], acc[2], acc[3]);
        __syncthreads();
        if (tid < 128) {
            const uint32_t ln = tid / 4, e = tid % 4;
            const uint32_t col = unit_of(t) * 16 + ln / 4 + (e >= 2 ? 8 : 0), row = (ln % 4) * 2 + (e & 1);
            if (row < m && col < n) {
                const float* pf = reinterpret_cast<const float*>(pp);
                float sum = 0.0f;
                for (uint32_t sg = 0; sg < span.nsegs; ++sg) sum += pf[(sg * 32 + ln) * 4 + e];
                out[(size_t)row * n + col] = __float2bfloat16_rn(sum);
            }
        }
    };
    ExactBatch<B> a, b;
    if (total > 0) load(a, 0);
    if (total > 1) load(b, 1);
    for (uint32_t t = 0; t < total; t += 2) {
        compute(a, t);
        if (t + 2 < total) load(a, t + 2);
        if (t + 1 < total) compute(b, t + 1);
        if (t + 3 < total) load(b, t + 3);
    }
}

int main() {
    const uint32_t shapes[][2] = {{6144, 4096}, {4096, 4096}, {24576, 4096}, {4096, 12288}};
    const uint32_t ms[] = {1, 4, 8};
    const int copies = 4, grid = 264;
    cudaStream_t s;
    CK(cudaStreamCreate(&s));
    for (auto& sh : shapes) {
        const uint32_t n = sh[0], k = sh[1], kb = (k + 127) / 128;
        const size_t wbytes = (size_t)n * k, sbytes = (size_t)((n + 127) / 128) * kb;
        uint8_t* w;
        float* sc;
        bf16 *x, *o1, *o2;
        CK(cudaMalloc(&w, wbytes * copies));
        CK(cudaMalloc(&sc, sbytes * 4 * copies));
        CK(cudaMalloc(&x, (size_t)16 * k * 2));
        CK(cudaMalloc(&o1, (size_t)16 * n * 2));
        CK(cudaMalloc(&o2, (size_t)16 * n * 2));
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
            const uint32_t shift = 7;
            CK(cudaMemset(o1, 0xFF, (size_t)16 * n * 2));
            CK(cudaMemset(o2, 0xFF, (size_t)16 * n * 2));
            linear_stream_fp8<<<grid, 256, 0, s>>>(o1, x, w, sc, m, n, k, shift);
            lab_fp8_exact<<<grid, 256, 0, s>>>(o2, x, w, sc, m, n, k, shift);
            CK(cudaStreamSynchronize(s));
            std::vector<uint16_t> h1((size_t)m * n), h2((size_t)m * n);
            CK(cudaMemcpy(h1.data(), o1, h1.size() * 2, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(h2.data(), o2, h2.size() * 2, cudaMemcpyDeviceToHost));
            // Errors against the exact weight (with bf16 x), relative to the row's largest output.
            const Fp8Exact exact = fp8_exact(hw, hs, hx, m, n, k);
            const double e1 = fp8_max_error(exact, [&](size_t r, uint32_t c) { return bf16_value(h1[r * n + c]); });
            const double e2 = fp8_max_error(exact, [&](size_t r, uint32_t c) { return bf16_value(h2[r * n + c]); });
            auto rec = [&](bool exact) {
                return [&, exact](cudaStream_t st) {
                    for (int it = 0; it < 20; ++it) {
                        const int c = it % copies;
                        if (exact)
                            lab_fp8_exact<<<grid, 256, 0, st>>>(o2, x, w + c * wbytes, sc + c * sbytes, m, n, k, shift);
                        else
                            linear_stream_fp8<<<grid, 256, 0, st>>>(o1, x, w + c * wbytes, sc + c * sbytes, m, n, k,
                                                                     shift);
                    }
                };
            };
            const double t1 = time_graph(s, rec(false), 10) * 1000.0 / 20;
            const double t2 = time_graph(s, rec(true), 10) * 1000.0 / 20;
            printf("n=%5u k=%5u m=%u: linear_stream_fp8 %.2f us (%.2f TB/s) err %.2e | exact f16 %.2f us (%.2f TB/s) "
                   "err %.2e\n",
                   n, k, m, t1, wbytes / t1 / 1e6, e1, t2, wbytes / t2 / 1e6, e2);
        }
        CK(cudaFree(w));
        CK(cudaFree(sc));
        CK(cudaFree(x));
        CK(cudaFree(o1));
        CK(cudaFree(o2));
    }
    return 0;
}
