// wgmma lab: does a Hopper warpgroup MMA (wgmma.mma_async m64n8k16, operands in shared memory)
// reproduce the numerics of the engine's mma.sync chains bit for bit? The engine's GEMMs feed
// each m16n8k16 a permuted set of 16 k (kernels/gemm.cu: lane q holds k 8q..8q+7 of a 32-wide
// chunk; the first MMA takes 8q..8q+3). Here the same k go to the same MMA slots of a wgmma (or,
// ORDER 1, the same set in ascending order), segment by segment as the engine sums them, and
// every output is compared with the mma.sync tiled kernel (`linear_tiled`, the prefill kernel of
// the compute_90 PTX, which cannot use wgmma). Build with lab/build.sh.
#include "../kernels/gemm.cu"

#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <vector>

#include "lab_util.cuh"

// The actual k (within a 32-wide chunk, first MMA; the second adds 4) of each of the 16 MMA
// slots: mma.sync slot 2q + e holds k 8q + e, slot 8 + 2q + e holds k 8q + 2 + e.
__constant__ int kSlotSame[16] = {0, 1, 8, 9, 16, 17, 24, 25, 2, 3, 10, 11, 18, 19, 26, 27};
__constant__ int kSlotSorted[16] = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};

MT_DEVICE uint64_t smem_desc(const void* p, uint32_t lbo, uint32_t sbo) {
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
    return (uint64_t)((a & 0x3FFFF) >> 4) | ((uint64_t)(lbo >> 4) << 16) | ((uint64_t)(sbo >> 4) << 32);
}

MT_DEVICE void wgmma_m64n8k16(float (&d)[4], uint64_t da, uint64_t db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, %4, %5, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "l"(da), "l"(db));
}

// The reference: gemm.cu's mma.sync tiles (128 x 128, 8 warps of 64 x 32, 3 stages of 4 chunks).
__global__ void __launch_bounds__(256, 1)
    mma_ref(float* out, const bf16* x, const bf16* w, uint32_t m, uint32_t n, uint32_t k) {
    extern __shared__ __align__(16) unsigned char smem[];
    linear_tiled<float, 128, 128, 64, 32, 4, 3, true>(out, x, w, m, n, k, smem);
}

// One warpgroup per 64 x 8 output tile; x [m, k], w [n, k], k % 32 == 0 for simplicity.
template <int ORDER>
__global__ void __launch_bounds__(128) wgmma_probe(float* out, const bf16* x, const bf16* w, uint32_t m, uint32_t n,
                                                   uint32_t k) {
    // Per chunk: A = 2 instructions x 8 row groups x 2 k groups x 128 B; B = 2 x 2 x 128 B.
    __shared__ __align__(128) bf16 sa[2 * 64 * 16];
    __shared__ __align__(128) bf16 sb[2 * 8 * 16];
    const int* slot = ORDER == 0 ? kSlotSame : kSlotSorted;
    const uint32_t tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, q = lane % 4;
    const uint32_t n0 = blockIdx.x * 8, m0 = blockIdx.y * 64;
    const uint32_t chunks = k / LIN_KC;
    const uint32_t seg_chunks = (chunks + LIN_SEGS - 1) / LIN_SEGS;
    float acc[4] = {0, 0, 0, 0}, total[4] = {0, 0, 0, 0};
    uint32_t in_seg = 0;
    for (uint32_t c = 0; c < chunks; ++c) {
        __syncthreads();  // the previous chunk's MMAs are done (waited below)
        for (uint32_t i = tid; i < 2 * 64 * 16; i += 128) {
            const uint32_t b = i / (64 * 16), r = (i / 16) % 64, j = i % 16;
            const uint32_t kk = c * LIN_KC + slot[j] + 4 * b;
            const bf16 v = m0 + r < m ? x[(size_t)(m0 + r) * k + kk] : __float2bfloat16(0.0f);
            sa[(b * 2048 + ((r / 8) * 2 + j / 8) * 128 + (r % 8) * 16 + (j % 8) * 2) / 2] = v;
        }
        for (uint32_t i = tid; i < 2 * 8 * 16; i += 128) {
            const uint32_t b = i / (8 * 16), r = (i / 16) % 8, j = i % 16;
            const uint32_t kk = c * LIN_KC + slot[j] + 4 * b;
            const bf16 v = n0 + r < n ? w[(size_t)(n0 + r) * k + kk] : __float2bfloat16(0.0f);
            sb[(b * 256 + (j / 8) * 128 + r * 16 + (j % 8) * 2) / 2] = v;
        }
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
        wgmma_m64n8k16(acc, smem_desc(sa, 128, 256), smem_desc(sb, 128, 256));
        wgmma_m64n8k16(acc, smem_desc(sa + 1024, 128, 256), smem_desc(sb + 128, 128, 256));
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        if (++in_seg == seg_chunks || c + 1 == chunks) {
            in_seg = 0;
            for (int e = 0; e < 4; ++e) {
                total[e] += acc[e];
                acc[e] = 0.0f;
            }
        }
    }
    for (int e = 0; e < 4; ++e) {
        const uint32_t row = m0 + warp * 16 + g + (e >= 2 ? 8 : 0), col = n0 + 2 * q + (e & 1);
        if (row < m && col < n) out[(size_t)row * n + col] = total[e];
    }
}

int main() {
    struct Shape { uint32_t m, n, k; float xs; };
    const Shape shapes[] = {{64, 256, 4096, 1.0f}, {37, 136, 1024, 1.0f}, {64, 64, 12288, 1.0f},
                            {64, 128, 256, 1000.0f}, {17, 64, 96, 0.001f}};
    int bad = 0;
    for (int order = 0; order < 2; ++order) {
        for (auto sh : shapes) {
            bf16 *x, *w;
            float *ref, *out;
            CK(cudaMalloc(&x, (size_t)sh.m * sh.k * 2));
            CK(cudaMalloc(&w, (size_t)sh.n * sh.k * 2));
            CK(cudaMalloc(&ref, (size_t)sh.m * sh.n * 4));
            CK(cudaMalloc(&out, (size_t)sh.m * sh.n * 4));
            fill_bf16<<<256, 256>>>(x, (size_t)sh.m * sh.k, sh.m + 3 * sh.k, sh.xs);
            fill_bf16<<<256, 256>>>(w, (size_t)sh.n * sh.k, sh.n + 5 * sh.k, sqrtf(3.0f / sh.k));
            CK(cudaMemset(ref, 0xFF, (size_t)sh.m * sh.n * 4));
            CK(cudaMemset(out, 0xFF, (size_t)sh.m * sh.n * 4));
            CK(cudaFuncSetAttribute(mma_ref, cudaFuncAttributeMaxDynamicSharedMemorySize, 3 * 4 * 256 * 64));
            mma_ref<<<dim3((sh.n + 127) / 128, (sh.m + 127) / 128), 256, 3 * 4 * 256 * 64>>>(ref, x, w, sh.m, sh.n, sh.k);
            if (order == 0)
                wgmma_probe<0><<<dim3(sh.n / 8, (sh.m + 63) / 64), 128>>>(out, x, w, sh.m, sh.n, sh.k);
            else
                wgmma_probe<1><<<dim3(sh.n / 8, (sh.m + 63) / 64), 128>>>(out, x, w, sh.m, sh.n, sh.k);
            CK(cudaDeviceSynchronize());
            std::vector<uint32_t> hr((size_t)sh.m * sh.n), ho(hr.size());
            CK(cudaMemcpy(hr.data(), ref, hr.size() * 4, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(ho.data(), out, ho.size() * 4, cudaMemcpyDeviceToHost));
            size_t diff = 0, first = 0, unwritten = 0;
            for (size_t i = 0; i < hr.size(); ++i) {
                unwritten += ho[i] == 0xFFFFFFFFu;
                if (hr[i] != ho[i]) { if (!diff) first = i; ++diff; }
            }
            float a, b;
            memcpy(&a, &hr[first], 4);
            memcpy(&b, &ho[first], 4);
            printf("order %d m=%u n=%u k=%u xs=%g: %zu of %zu differ (%zu unwritten), first [%zu] %.9g vs %.9g\n", order,
                   sh.m, sh.n, sh.k, sh.xs, diff, hr.size(), unwritten, first, a, b);
            bad += diff != 0;
            CK(cudaFree(x)); CK(cudaFree(w)); CK(cudaFree(ref)); CK(cudaFree(out));
        }
    }
    printf("wgmma lab: %d of %d cases differ\n", bad, 2 * (int)(sizeof shapes / sizeof shapes[0]));
    return 0;
}
