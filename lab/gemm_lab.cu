// GEMM lab: the decode kernels of kernels/gemm.cu and lab variants of them (wg_variants.cuh,
// direct_rt.cuh), checked bitwise against the tiled kernel (poisoned outputs) and timed on the
// GPU machine: each projection alone (20 launches per CUDA graph, weights rotated past L2, with
// and without programmatic dependent launch), then 36 Qwen3-8B-shaped layers and the LM head
// with stand-in small kernels between the projections. Ceilings measured in the same run (a
// read-only stream). `gemm_lab quick`: fewer row counts; `gemm_lab narrow`: the m <= 16 kernels
// (and the tiled reference) at 1 and 8 rows. Build with lab/build.sh.
#include "../kernels/gemm.cu"
#include "wg_variants.cuh"
#include "direct_rt.cuh"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "lab_tmap.cuh"
#include "lab_layers.cuh"

// The cluster kernel with other stage shapes / occupancy.
template <int NT, int SC, int ST, int MINB>
__global__ void __cluster_dims__(LIN_SEGS, 1, 1) __launch_bounds__(256, MINB)
    lab_wide(float* out, const bf16* x, const bf16* w, uint32_t m, uint32_t n, uint32_t k) {
    extern __shared__ __align__(16) unsigned char sm[];
    linear_wide_impl<float, NT, SC, ST, true>(out, x, w, m, n, k, sm, blockIdx.x / LIN_SEGS);
}
template <int ST, bool PIR, int MINB>
__global__ void __cluster_dims__(LIN_SEGS, 1, 1) __launch_bounds__(128, MINB)
    lab_wg(float* out, const bf16* x, const bf16* w, uint32_t m, uint32_t n, uint32_t k) {
    extern __shared__ __align__(16) unsigned char sm[];
    linear_wg_impl<float, ST, PIR>(out, x, w, m, n, k, sm);
}
constexpr int wg_smem(int st, bool pir) { return st * 24576 + (pir ? 0 : 32768) + 1024; }

typedef void (*KernelFn)(float*, const bf16*, const bf16*, uint32_t, uint32_t, uint32_t);

struct Var {
    const char* name;
    const void* fn;
    int smem;
    int per_sm;     // blocks per SM (persistent grid = per_sm * 132), 0: tiled grid, -1: one block
                    // per unit, -2: a cluster of LIN_SEGS blocks per unit
    int nt, rt;     // unit: 8 * nt columns by 16 * rt rows
    int max_m;      // rows this kernel may take (any, but beyond this it is not meant to)
    int threads = 256;
    int clusters = 0;  // resident clusters of a persistent cluster kernel (per_sm -3), set at start
};

static const int SMS = 132;

// Which variants are timed at m rows: each where the launcher could pick it.
static bool timed(const Var& v, uint32_t m) {
    if (v.per_sm == -4) return m > 16 && m <= 16 * (uint32_t)v.rt;
    if (v.per_sm == 0) return m >= 32;
    if (v.per_sm <= -2) return m >= 16;
    return m <= 16;
}

static void launch(const Var& v, bool pdl, cudaStream_t s, float* out, const bf16* x, const bf16* w, uint32_t m,
                   uint32_t n, uint32_t k) {
    cudaLaunchConfig_t cfg = {};
    if (v.per_sm == 0) {
        cfg.gridDim = dim3((n + LIN_BN - 1) / LIN_BN, (m + LIN_BM - 1) / LIN_BM, 1);
    } else if (v.per_sm == -3) {
        const uint32_t tiles = ((n + 8 * v.nt - 1) / (8 * v.nt)) * ((m + 16 * v.rt - 1) / (16 * v.rt));
        cfg.gridDim = dim3(LIN_SEGS * std::min<uint32_t>(tiles, v.clusters), 1, 1);
    } else if (v.per_sm == -2) {
        cfg.gridDim = dim3(LIN_SEGS * ((n + 8 * v.nt - 1) / (8 * v.nt)) * ((m + 16 * v.rt - 1) / (16 * v.rt)), 1, 1);
    } else if (v.per_sm < 0) {  // -1 and -4: one block per unit
        cfg.gridDim = dim3(((n + 8 * v.nt - 1) / (8 * v.nt)) * ((m + 16 * v.rt - 1) / (16 * v.rt)), 1, 1);
    } else {
        const uint32_t units = ((n + 8 * v.nt - 1) / (8 * v.nt)) * ((m + 16 * v.rt - 1) / (16 * v.rt));
        cfg.gridDim = dim3(std::min<uint32_t>(units, v.per_sm * SMS), 1, 1);
    }
    void* args[] = {&out, &x, &w, &m, &n, &k};
    launch_ex(v.fn, cfg.gridDim, dim3(v.threads, 1, 1), v.smem, pdl, s, args);
}

int main(int argc, char** argv) {
    const bool quick = argc > 1 && strcmp(argv[1], "quick") == 0;
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("device %s, %d SMs, L2 %d MB\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20);
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

    std::vector<Var> vars = {
        {"tiled", (const void*)linear_f32out, LIN_STAGES * (LIN_BM + LIN_BN) * 128 + 2048, 0, 8, 12, 1 << 30, LIN_THREADS},
        {"wide", (const void*)linear_stream_wide_f32out, LIN_W_STAGES * LIN_W_STAGE_CH * 192 * 64, -2, 16, 4, 1 << 30},
        {"wg3r", (const void*)lab_wg<3, true, 3>, wg_smem(3, true), -2, 16, 4, 1 << 30, 128},
        // The narrow kernels: persistent (as many blocks as are resident, as the launcher runs
        // them), and a block per unit.
        {"direct", (const void*)linear_stream_f32out, 0, 2, 1, 1, 16},
        {"b4", (const void*)linear_stream_b4_f32out, 0, 3, 1, 1, 16},
        {"direct-units", (const void*)linear_stream_f32out, 0, -1, 1, 1, 16},
        {"b4-units", (const void*)linear_stream_b4_f32out, 0, -1, 1, 1, 16},
        {"d4x2b2", (const void*)lab_drt<float, 2, 4, 2, 1>, 0, -4, 4, 2, 1 << 30},
        {"d4x2b2m2", (const void*)lab_drt<float, 2, 4, 2, 2>, 0, -4, 4, 2, 1 << 30},
        {"d2x2b4", (const void*)lab_drt<float, 4, 2, 2, 1>, 0, -4, 2, 2, 1 << 30},
        {"d4x4b1", (const void*)lab_drt<float, 1, 4, 4, 1>, 0, -4, 4, 4, 1 << 30},
        {"d8x2b1", (const void*)lab_drt<float, 1, 8, 2, 1>, 0, -4, 8, 2, 1 << 30},
    };
    // `narrow`: only the m <= 16 kernels, at 1 and 8 rows.
    const bool narrow = argc > 1 && strcmp(argv[1], "narrow") == 0;
    if (narrow)
        vars.erase(std::remove_if(vars.begin() + 1, vars.end(), [](const Var& v) { return v.per_sm < -1; }), vars.end());
    for (auto& v : vars) {
        if (v.smem > 0) CK(cudaFuncSetAttribute(v.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, v.smem));
        if (v.per_sm == -3) {
            cudaLaunchConfig_t cfg = {};
            cfg.gridDim = dim3(LIN_SEGS * 64, 1, 1);
            cfg.blockDim = dim3(v.threads, 1, 1);
            cfg.dynamicSmemBytes = v.smem;
            CK(cudaOccupancyMaxActiveClusters(&v.clusters, v.fn, &cfg));
            printf("kernel %-18s resident clusters %d\n", v.name, v.clusters);
        }
        cudaFuncAttributes fa;
        CK(cudaFuncGetAttributes(&fa, v.fn));
        printf("kernel %-18s smem %6d regs %3d local %zu\n", v.name, v.smem, fa.numRegs, fa.localSizeBytes);
    }

    // ---- 1. bitwise against the tiled kernel ----
    {
        struct Shape { uint32_t m, n, k; };
        std::vector<Shape> shapes = {{1, 4096, 4096}, {1, 1004, 4096}, {5, 6144, 4096}, {16, 520, 256},
                                     {3, 136, 96},    {17, 1000, 4096}, {32, 4096, 12288}, {64, 300, 1024},
                                     {100, 264, 1024}, {128, 4096, 4096}, {33, 136, 64}, {8, 12352, 4096}};
        int bad = 0, checked = 0;
        for (auto sh : shapes) {
            bf16* x = alloc_fill((size_t)sh.m * sh.k, sh.m * 7 + sh.k, 1.0f);
            bf16* w = alloc_fill((size_t)sh.n * sh.k, sh.n * 13 + sh.k, sqrtf(3.0f / sh.k));
            float *ref, *out;
            const size_t bytes = (size_t)sh.m * sh.n * 4;
            CK(cudaMalloc(&ref, bytes));
            CK(cudaMalloc(&out, bytes));
            CK(cudaDeviceSynchronize());  // the fills ran on the legacy stream
            CK(cudaMemsetAsync(ref, 0xFF, bytes, s));
            launch(vars[0], false, s, ref, x, w, sh.m, sh.n, sh.k);
            std::vector<uint32_t> hr(sh.m * (size_t)sh.n), ho(hr.size());
            CK(cudaMemcpyAsync(hr.data(), ref, bytes, cudaMemcpyDeviceToHost, s));
            CK(cudaStreamSynchronize(s));
            size_t unwritten = 0;
            for (auto v : hr) unwritten += v == 0xFFFFFFFFu;
            if (unwritten) { printf("CHECK tiled m=%u n=%u k=%u: %zu unwritten\n", sh.m, sh.n, sh.k, unwritten); ++bad; }
            for (size_t vi = 1; vi < vars.size(); ++vi) {
                const Var& v = vars[vi];
                if ((int)sh.m > v.max_m) continue;
                for (int pdl = 0; pdl < 2; ++pdl) {
                    CK(cudaMemsetAsync(out, 0xFF, bytes, s));
                    launch(v, pdl, s, out, x, w, sh.m, sh.n, sh.k);
                    CK(cudaMemcpyAsync(ho.data(), out, bytes, cudaMemcpyDeviceToHost, s));
                    CK(cudaStreamSynchronize(s));
                    size_t diff = 0, first = 0;
                    for (size_t i = 0; i < hr.size(); ++i)
                        if (hr[i] != ho[i]) { if (!diff) first = i; ++diff; }
                    ++checked;
                    if (diff) {
                        ++bad;
                        float a, b;
                        memcpy(&a, &hr[first], 4);
                        memcpy(&b, &ho[first], 4);
                        printf("CHECK %-18s m=%u n=%u k=%u pdl=%d: %zu differ, first [%zu] %g vs %g\n", v.name, sh.m,
                               sh.n, sh.k, pdl, diff, first, a, b);
                    }
                }
            }
            CK(cudaFree(x)); CK(cudaFree(w)); CK(cudaFree(ref)); CK(cudaFree(out));
        }
        printf("bitwise: %d of %d variant runs differ from tiled\n", bad, checked);
    }

    // ---- 2. ceiling: a read-only stream of 2 GiB ----
    const double read_gbs = read_ceiling_gbs(s);
    printf("ceiling: read-only stream %.0f GB/s\n", read_gbs);

    // ---- 3. each projection alone: 20 launches per graph, weights rotated ----
    struct Proj { const char* name; uint32_t n, k; };
    std::vector<Proj> projs = {{"qkv", 6144, 4096}, {"o", 4096, 4096}, {"gate_up", 24576, 4096},
                               {"down", 4096, 12288}, {"lm_head", 151936, 4096}, {"gdn_in", 12352, 4096}};
    std::vector<uint32_t> ms_list = narrow  ? std::vector<uint32_t>{1, 8}
                                    : quick ? std::vector<uint32_t>{1, 32}
                                            : std::vector<uint32_t>{1, 8, 16, 32, 64, 128};
    std::vector<std::string> summary;
    for (auto pj : projs) {
        const size_t wbytes = (size_t)pj.n * pj.k * 2;
        const int copies = (int)std::min<size_t>(8, std::max<size_t>(2, (320ull << 20) / wbytes + 1));
        std::vector<bf16*> ws;
        for (int c = 0; c < copies; ++c) ws.push_back(alloc_fill((size_t)pj.n * pj.k, 100 + c, 0.03f));
        bf16* x = alloc_fill((size_t)128 * pj.k, 5, 1.0f);
        float* out;
        CK(cudaMalloc(&out, (size_t)128 * pj.n * 4));
        CK(cudaDeviceSynchronize());
        for (uint32_t m : ms_list) {
            if (pj.n == 151936 && m > 32) continue;
            if (pj.n == 151936 && (m == 4 || m == 16)) continue;
            char line[1024];
            int len = snprintf(line, sizeof line, "%-8s m=%-3u floor %6.1f us:", pj.name, m, wbytes / read_gbs / 1e3);
            for (size_t vi = 0; vi < vars.size(); ++vi) {
                const Var& v = vars[vi];
                if ((int)m > v.max_m) continue;
                if (!timed(v, m)) continue;
                for (int pdl = 0; pdl < 2; ++pdl) {
                    const int reps = 20;
                    double ms = time_graph(s, [&](cudaStream_t st) {
                        for (int r = 0; r < reps; ++r) launch(v, pdl, st, out, x, ws[r % copies], m, pj.n, pj.k);
                    }, 5) / reps;
                    len += snprintf(line + len, sizeof line - len, " %s%s %.1f(%.0f%%)", v.name, pdl ? "+p" : "",
                                    ms * 1e3, 100.0 * wbytes / (ms * 1e6) / read_gbs);
                }
            }
            printf("%s\n", line);
        }
        for (auto w : ws) CK(cudaFree(w));
        CK(cudaFree(x));
        CK(cudaFree(out));
    }

    // ---- 4. 36 Qwen3-8B layers + LM head, small kernels between the projections ----
    {
        const LabLayers layers;
        const double floor_ms = LabLayers::floor_ms(read_gbs);
        auto run = [&](const Var& v, uint32_t m, int pdl_gemm, int pdl_small, bool smalls) {
            return time_graph(s, [&](cudaStream_t st) {
                layers.enqueue(st, m, smalls, pdl_small != 0,
                               [&](cudaStream_t q, float* out, const bf16* x, const bf16* w, uint32_t n, uint32_t k) {
                                   launch(v, pdl_gemm, q, out, x, w, m, n, k);
                               });
            }, 5);
        };
        for (uint32_t m : narrow ? std::vector<uint32_t>{1, 8} : std::vector<uint32_t>{1, 8, 32, 64, 128}) {
            printf("layers m=%u: weight floor %.3f ms (read-only bandwidth)\n", m, floor_ms);
            for (size_t vi = 0; vi < vars.size(); ++vi) {
                const Var& v = vars[vi];
                if ((int)m > v.max_m || !timed(v, m)) continue;
                const double a = run(v, m, 0, 0, true), b = run(v, m, 1, 0, true), c = run(v, m, 1, 1, true),
                             d = run(v, m, 0, 0, false), e = run(v, m, 1, 0, false);
                printf("  %-18s plain %.3f | pdl gemm %.3f | pdl all %.3f | gemms only %.3f, pdl %.3f ms (%.0f%% of floor)\n",
                       v.name, a, b, c, d, e, 100.0 * floor_ms / std::min(d, e));
            }
        }
    }
    printf("lab done\n");
    return 0;
}
