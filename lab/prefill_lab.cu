// Prefill GEMM lab: the engine's `linear` (the warp-specialized wgmma kernel), the mma.sync tiled
// body (`linear_tiled`, the compute_90 PTX's `linear`: 128 x 128 tiles, 4-chunk stages),
// `linear_ws` at other row tiles and `linear_tma` (after `permute_k32_tiles`, timed together;
// `prefill_lab prof` launches each variant once for ncu), all with the engine's numerics (chunks
// of 32 k, LIN_SEGS segments, a chain of tensor-core MMAs per segment, summed in segment order),
// each checked bitwise against `linear_f32out` (poisoned outputs) and timed at prefill row counts
// on the four Qwen3-8B projections. Build: lab/build.sh (target/gemm-lab/prefill_lab).
#include "../kernels/gemm.cu"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "lab_util.cuh"

// gemm.cu's tiled body at block tile BM x BN, warp tile WM x WN, SC chunks (of 32 k) per stage,
// ST stages.
template <int BM, int BN, int WM, int WN, int SC, int ST>
__global__ void __launch_bounds__((BM / WM) * (BN / WN) * 32, 1)
    tiled2(float* __restrict__ out, const bf16* __restrict__ x, const bf16* __restrict__ w, uint32_t m,
           uint32_t n, uint32_t k) {
    extern __shared__ __align__(16) unsigned char smem[];
    linear_tiled<float, BM, BN, WM, WN, SC, ST, true>(out, x, w, m, n, k, smem);
}

// gemm.cu's warp-specialized body at other row tiles (BM / 64 consumer warpgroups) and rings.
template <int ST, uint32_t BM>
__global__ void __launch_bounds__(128 + 2 * BM, 1)
    ws(float* __restrict__ out, const bf16* __restrict__ x, const bf16* __restrict__ w, uint32_t m, uint32_t n,
       uint32_t k) {
    extern __shared__ __align__(16) unsigned char smem[];
    linear_ws<float, ST, BM, true>(out, x, w, m, n, k, smem);
}

#include "lab_tmap.cuh"

// The tensor map `linear_tma` reads the weight through, copied to device memory (the last
// weight's, kept).
static void* weight_map(const bf16* w, uint32_t n, uint32_t k) {
    static void* dev = nullptr;
    static const bf16* last_w = nullptr;
    static uint32_t last_n = 0, last_k = 0;
    if (dev && w == last_w && n == last_n && k == last_k) return dev;  // uploaded already (untimed)
    last_w = w, last_n = n, last_k = k;
    if (!dev) CK(cudaMalloc(&dev, 128));
    CUtensorMap map = encode_weight_map(w, n, k);
    CK(cudaMemcpy(dev, &map, 128, cudaMemcpyHostToDevice));
    return dev;
}

static bf16* g_xp = nullptr;  // the stage images of `linear_tma`

struct Var {
    const char* name;
    const void* fn;
    int bm, bn, threads, smem;
    bool tma = false;  // `linear_tma`: x to stage images first, the weight's map as an argument
};

static void launch(const Var& v, cudaStream_t s, float* out, const bf16* x, const bf16* w, uint32_t m,
                   uint32_t n, uint32_t k) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3((n + v.bn - 1) / v.bn, (m + v.bm - 1) / v.bm, 1);
    void* map = nullptr;
    if (v.tma) {
        permute_k32_tiles<<<(unsigned)std::min<size_t>(4096, ((m + 127) / 128 * 128 * ((k + 63) / 64) + 255) / 256), 256, 0, s>>>(g_xp, x, m, k);
        cfg.gridDim = dim3((m + v.bm - 1) / v.bm, (n + v.bn - 1) / v.bn, 1);
        x = g_xp;
        map = weight_map(w, n, k);
    }
    cfg.blockDim = dim3(v.threads, 1, 1);
    cfg.dynamicSmemBytes = v.smem;
    cfg.stream = s;
    void* args_tma[] = {&out, &x, &w, &map, &m, &n, &k};
    void* args[] = {&out, &x, &w, &m, &n, &k};
    CK(cudaLaunchKernelExC(&cfg, v.fn, v.tma ? args_tma : args));
}

#define VAR(BM, BN, WM, WN, SC, ST)                                                              \
    Var {                                                                                      \
        #BM "x" #BN " w" #WM "x" #WN " s" #SC "x" #ST, (const void*)tiled2<BM, BN, WM, WN, SC, ST>, BM, BN, \
            (BM / WM) * (BN / WN) * 32, ST * SC * (BM + BN) * 64                               \
    }

int main(int argc, char** argv) {
    const bool prof = argc > 1 && strcmp(argv[1], "prof") == 0;  // one launch per variant (for ncu)
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    std::vector<Var> vars = {
        {"linear", (const void*)linear_f32out, LIN_BM, LIN_BN, LIN_THREADS, LIN_STAGES * (LIN_BM + LIN_BN) * 128 + 2048},
        VAR(128, 128, 64, 32, 4, 3),
        {"ws128x4", (const void*)ws<4, 128>, 128, 128, 384, 4 * 32768 + 2048},
        {"ws192x4", (const void*)ws<4, 192>, 192, 128, 512, 4 * 40960 + 2048},
        {"tma", (const void*)linear_tma_f32out, LIN_TMA_TILE, LIN_TMA_TILE, 384, LIN_TMA_STAGES * 32768 + 2048, true},
    };
    CK(cudaMalloc(&g_xp, (size_t)8192 * 12288 * 2));
    for (auto& v : vars) {
        CK(cudaFuncSetAttribute(v.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, v.smem));
        cudaFuncAttributes fa;
        CK(cudaFuncGetAttributes(&fa, v.fn));
        printf("kernel %-24s threads %3d smem %6d regs %3d local %zu\n", v.name, v.threads, v.smem, fa.numRegs,
               fa.localSizeBytes);
    }
    struct Shape { uint32_t m, n, k; };
    if (prof) {
        const uint32_t m = 2048, n = 24576, k = 4096;
        bf16 *x, *w;
        float* out;
        CK(cudaMalloc(&x, (size_t)m * k * 2));
        CK(cudaMalloc(&w, (size_t)n * k * 2));
        CK(cudaMalloc(&out, (size_t)m * n * 4));
        fill_bf16<<<1024, 256>>>(x, (size_t)m * k, 3, 1.0f);
        fill_bf16<<<1024, 256>>>(w, (size_t)n * k, 4, 0.03f);
        for (auto& v : vars) launch(v, s, out, x, w, m, n, k);
        CK(cudaStreamSynchronize(s));
        return 0;
    }
    // Bitwise against the tiled kernel.
    {
        std::vector<Shape> shapes = {{2048, 6144, 4096}, {300, 4096, 12288}, {129, 1000, 4096}, {17, 136, 96},
                                     {1000, 520, 1000}, {2048, 4096, 4096},
                                     {130, 136, 512}, {2048, 24576, 4096}, {777, 300, 2048}};
        int bad = 0, checked = 0;
        for (auto sh : shapes) {
            bf16 *x, *w;
            CK(cudaMalloc(&x, (size_t)sh.m * sh.k * 2));
            CK(cudaMalloc(&w, (size_t)sh.n * sh.k * 2));
            fill_bf16<<<1024, 256>>>(x, (size_t)sh.m * sh.k, sh.m * 7 + sh.k, 1.0f);
            fill_bf16<<<1024, 256>>>(w, (size_t)sh.n * sh.k, sh.n * 13 + sh.k, sqrtf(3.0f / sh.k));
            float *ref, *out;
            const size_t bytes = (size_t)sh.m * sh.n * 4;
            CK(cudaMalloc(&ref, bytes));
            CK(cudaMalloc(&out, bytes));
            CK(cudaDeviceSynchronize());
            CK(cudaMemsetAsync(ref, 0xFF, bytes, s));
            launch(vars[0], s, ref, x, w, sh.m, sh.n, sh.k);
            std::vector<uint32_t> hr(sh.m * (size_t)sh.n), ho(hr.size());
            CK(cudaMemcpyAsync(hr.data(), ref, bytes, cudaMemcpyDeviceToHost, s));
            CK(cudaStreamSynchronize(s));
            for (size_t vi = 1; vi < vars.size(); ++vi) {
                if (vars[vi].tma && sh.k % 8 != 0) continue;
                CK(cudaMemsetAsync(out, 0xFF, bytes, s));
                launch(vars[vi], s, out, x, w, sh.m, sh.n, sh.k);
                CK(cudaMemcpyAsync(ho.data(), out, bytes, cudaMemcpyDeviceToHost, s));
                CK(cudaStreamSynchronize(s));
                size_t diff = 0;
                for (size_t i = 0; i < hr.size(); ++i) diff += hr[i] != ho[i];
                ++checked;
                if (diff) {
                    ++bad;
                    printf("CHECK %-24s m=%u n=%u k=%u: %zu differ\n", vars[vi].name, sh.m, sh.n, sh.k, diff);
                }
            }
            CK(cudaFree(x)); CK(cudaFree(w)); CK(cudaFree(ref)); CK(cudaFree(out));
        }
        printf("bitwise: %d of %d variant runs differ from tiled\n", bad, checked);
    }
    // Timing at prefill row counts.
    std::vector<Shape> projs = {{2048, 6144, 4096}, {2048, 4096, 4096}, {2048, 24576, 4096}, {2048, 4096, 12288},
                                {512, 24576, 4096}, {8192, 4096, 4096}};
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    for (auto sh : projs) {
        bf16 *x, *w;
        float* out;
        CK(cudaMalloc(&x, (size_t)sh.m * sh.k * 2));
        CK(cudaMalloc(&w, (size_t)sh.n * sh.k * 2));
        CK(cudaMalloc(&out, (size_t)sh.m * sh.n * 4));
        fill_bf16<<<1024, 256>>>(x, (size_t)sh.m * sh.k, 3, 1.0f);
        fill_bf16<<<1024, 256>>>(w, (size_t)sh.n * sh.k, 4, 0.03f);
        CK(cudaDeviceSynchronize());
        const double flop = 2.0 * sh.m * sh.n * sh.k;
        printf("m=%u n=%u k=%u:", sh.m, sh.n, sh.k);
        for (auto& v : vars) {
            std::vector<float> t;
            for (int i = 0; i < 7; ++i) {
                CK(cudaEventRecord(a, s));
                launch(v, s, out, x, w, sh.m, sh.n, sh.k);
                CK(cudaEventRecord(b, s));
                CK(cudaEventSynchronize(b));
                float ms;
                CK(cudaEventElapsedTime(&ms, a, b));
                if (i >= 2) t.push_back(ms);
            }
            std::sort(t.begin(), t.end());
            printf("  %s %.3f ms (%.0f TF)", v.name, t[2], flop / (t[2] * 1e9));
        }
        {
            std::vector<float> t;
            for (int i = 0; i < 7; ++i) {
                CK(cudaEventRecord(a, s));
                permute_k32_tiles<<<(unsigned)std::min<size_t>(4096, ((sh.m + 127) / 128 * 128 * ((sh.k + 63) / 64) + 255) / 256), 256, 0, s>>>(g_xp, x, sh.m, sh.k);
                CK(cudaEventRecord(b, s));
                CK(cudaEventSynchronize(b));
                float ms;
                CK(cudaEventElapsedTime(&ms, a, b));
                if (i >= 2) t.push_back(ms);
            }
            std::sort(t.begin(), t.end());
            printf("  (permute alone %.3f ms)", t[2]);
        }
        printf("\n");
        CK(cudaFree(x)); CK(cudaFree(w)); CK(cudaFree(out));
    }
    printf("lab done\n");
    return 0;
}
