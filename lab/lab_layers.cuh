// What the decode GEMM labs share (gemm_lab, decode_tma_lab): `alloc_fill` (a filled bf16 buffer),
// `lab_small` (a stand-in for the small kernels between projections) and `LabLayers`, 36
// Qwen3-8B-shaped layers' weights and the LM head with the buffers between them, whose
// `enqueue` runs one step's chain: per layer small, qkv, small, small, o, small, gate_up, small,
// down; then small and the LM head. Include after kernels/ and lab_util.cuh.
#pragma once

#include <vector>

static bf16* alloc_fill(size_t n, uint64_t seed, float scale) {
    bf16* p;
    CK(cudaMalloc(&p, std::max<size_t>(n, 8) * 2));
    fill_bf16<<<1024, 256>>>(p, n, seed, scale);
    CK(cudaGetLastError());
    return p;
}

// One block per 4096 elements copies a constant source to `out`, after reading `prev` (the
// projection output before it); `pdl`: launched as a programmatic dependent, it waits first.
__global__ void lab_small(bf16* out, const bf16* src, const float* prev, uint32_t elems, int pdl) {
    if (pdl) {
        pdl_wait();
        pdl_trigger();
    }
    const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i * 8 >= elems) return;
    uint4 v = *reinterpret_cast<const uint4*>(src + 8 * i);
    if (prev[i] == 12345.0f) v.x = 0;
    *reinterpret_cast<uint4*>(out + 8 * i) = v;
}

struct LabLayers {
    static constexpr uint32_t H = 4096, QKV = 6144, FFN = 12288, V = 151936, L = 36, MM = 128;
    std::vector<bf16*> wq, wo, wgu, wd;
    bf16 *head, *src, *xn, *xa, *xact;
    float *o1, *o2;

    LabLayers() {
        for (uint32_t l = 0; l < L; ++l) {
            wq.push_back(alloc_fill((size_t)QKV * H, 1000 + 4 * l, 0.03f));
            wo.push_back(alloc_fill((size_t)H * H, 1001 + 4 * l, 0.03f));
            wgu.push_back(alloc_fill((size_t)2 * FFN * H, 1002 + 4 * l, 0.03f));
            wd.push_back(alloc_fill((size_t)H * FFN, 1003 + 4 * l, 0.02f));
        }
        head = alloc_fill((size_t)V * H, 7, 0.03f);
        src = alloc_fill((size_t)MM * 2 * FFN, 9, 1.0f);
        CK(cudaMalloc(&xn, (size_t)MM * H * 2));
        CK(cudaMalloc(&xa, (size_t)MM * H * 2));
        CK(cudaMalloc(&xact, (size_t)MM * FFN * 2));
        CK(cudaMalloc(&o1, (size_t)MM * 2 * FFN * 4));
        CK(cudaMalloc(&o2, (size_t)MM * V * 4));
        CK(cudaDeviceSynchronize());
    }

    // The weights once over `read_gbs`, ms.
    static double floor_ms(double read_gbs) {
        const double layer_bytes = ((double)QKV * H + H * H + 2.0 * FFN * H + (double)H * FFN) * 2;
        return (L * layer_bytes + (double)V * H * 2) / read_gbs / 1e6;
    }

    // One step of m rows on `st`: gemm(st, out, x, w, n, k) for every projection, small kernels
    // between them (none when !smalls; as programmatic dependents when pdl_small).
    template <typename Gemm>
    void enqueue(cudaStream_t st, uint32_t m, bool smalls, bool pdl_small, const Gemm& gemm) const {
        auto small = [&](bf16* out, const float* prev, uint32_t elems) {
            if (!smalls) return;
            const bf16* sp = src;
            int flag = pdl_small ? 1 : 0;
            void* args[] = {&out, &sp, &prev, &elems, &flag};
            launch_ex((const void*)lab_small, dim3((elems / 8 + 255) / 256), dim3(256), 0, pdl_small, st, args);
        };
        for (uint32_t l = 0; l < L; ++l) {
            small(xn, o1, m * H);
            gemm(st, o1, xn, wq[l], QKV, H);
            small(xa, o1, m * H);
            small(xa, o1, m * H);
            gemm(st, o1, xa, wo[l], H, H);
            small(xn, o1, m * H);
            gemm(st, o1, xn, wgu[l], 2 * FFN, H);
            small(xact, o1, m * FFN);
            gemm(st, o1, xact, wd[l], H, FFN);
        }
        small(xn, o1, m * H);
        gemm(st, o2, xn, head, V, H);
    }
};
