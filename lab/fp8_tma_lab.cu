// FP8 tensor-map lab: `linear_stream_tma_fp8` and `linear_tma_fp8` (kernels/gemm.cu: the bf16
// tensor-map kernels reading a block-FP8 weight's e4m3 bytes through a byte map under the
// 64-byte swizzle, each wgmma fragment converted as it is loaded) against the map-less FP8
// paths the launcher takes without a map (`linear_stream_fp8` at m <= 16, `linear_stream_wide_fp8`
// above, and at prefill sizes `dequant_fp8` then the bf16 `linear_tma`):
// 1. bitwise on mixed shapes (poisoned outputs; 128-row scale blocks and a scale row per weight
//    row; the decode kernel from x's rows and from x's stage images);
// 2. timed per Qwen3-8B projection (graphs of 20 launches, programmatic dependents, weights
//    rotated past L2) at 1..128 rows: the launcher serves 17..128 rows by the map and 1..16
//    rows with `linear_stream_fp8`, faster there;
// 3. timed at 2048 prefill rows: bf16 `linear_tma` of the dequantized weight (what the FP8 path
//    computes, without the conversion), `dequant_fp8` + `linear_tma` (the map-less FP8 path) and
//    `linear_tma_fp8`, in TFLOP/s.
// Build with lab/build.sh; `fp8_tma_lab quick` stops after the bitwise checks.
#include "../kernels/gemm.cu"

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <vector>

#include "lab_tmap.cuh"
#include "lab_layers.cuh"

static const int TMA_SMEM = LIN_DEC_SPACE + 2048;
static const int PREFILL_SMEM = LIN_TMA_STAGES * 32768 + 2048;
static const int WIDE_FP8_SMEM = LIN_WF_STAGES * LIN_WF_STAGE_CH * (64 * LIN_W_NT * 32 + LIN_W_ROWS * 64);
static int g_clusters = 1;  // resident clusters of linear_stream_tma_fp8

// A block-FP8 weight [n, k]: its bytes, scales (rows of 2^shift weight rows), its byte map, and
// its dequantized bf16 image with that image's bf16 map.
struct Fp8Weight {
    uint8_t* q;
    float* scales;
    uint32_t n, k, shift;
    void* map8;
    bf16* deq;
    void* map16;
    size_t bytes() const {
        const size_t rows = shift ? ((n - 1) >> shift) + 1 : n;
        return (size_t)n * k + rows * ((k + 127) / 128) * 4;
    }
};

static void launch_dequant(cudaStream_t s, bool pdl, bf16* out, const Fp8Weight& w) {
    const uint8_t* q = w.q;
    const float* sc = w.scales;
    uint32_t n = w.n, k = w.k, shift = w.shift;
    void* args[] = {&out, &q, &sc, &n, &k, &shift};
    const size_t blocks = std::min<size_t>(1056, ((size_t)n * k + FP8_CONVERT_THREADS - 1) / FP8_CONVERT_THREADS);
    launch_ex((const void*)dequant_fp8, dim3((uint32_t)blocks), dim3(FP8_CONVERT_THREADS), 0, pdl, s, args);
}

static Fp8Weight make_weight(uint32_t n, uint32_t k, uint32_t shift, uint64_t seed) {
    Fp8Weight w{};
    w.n = n;
    w.k = k;
    w.shift = shift;
    const size_t rows = shift ? ((n - 1) >> shift) + 1 : n, nscales = rows * ((k + 127) / 128);
    CK(cudaMalloc(&w.q, (size_t)n * k));
    CK(cudaMalloc(&w.scales, nscales * 4));
    CK(cudaMalloc(&w.deq, (size_t)n * k * 2));
    fill_u8<<<512, 256>>>(w.q, (size_t)n * k, seed);
    fill_scales<<<64, 256>>>(w.scales, nscales, seed);
    launch_dequant(0, false, w.deq, w);
    CK(cudaDeviceSynchronize());
    w.map8 = upload_map(encode_fp8_weight_map(w.q, n, k));
    w.map16 = upload_map(encode_weight_map(w.deq, n, k));
    return w;
}

static void free_weight(Fp8Weight& w) {
    CK(cudaFree(w.q));
    CK(cudaFree(w.scales));
    CK(cudaFree(w.deq));
    CK(cudaFree(w.map8));
    CK(cudaFree(w.map16));
}

// The map-less decode path (ops_gemm::fp8's without a map).
static void launch_ref(bool pdl, cudaStream_t s, bf16* out, const bf16* x, const Fp8Weight& w, uint32_t m) {
    const uint8_t* q = w.q;
    const float* sc = w.scales;
    uint32_t n = w.n, k = w.k, shift = w.shift;
    void* args[] = {&out, &x, &q, &sc, &m, &n, &k, &shift};
    if (m <= 16)
        launch_ex((const void*)linear_stream_fp8, dim3(264), dim3(256), 0, pdl, s, args);
    else
        launch_ex((const void*)linear_stream_wide_fp8, dim3(LIN_SEGS * ((n + 127) / 128) * ((m + 63) / 64)), dim3(256),
                  WIDE_FP8_SMEM, pdl, s, args);
}

// `linear_stream_tma_fp8` of m rows (x's stage images `ximg` or null); false where it does not
// fit (then nothing is launched).
static bool launch_tma(bool pdl, cudaStream_t s, bf16* out, const bf16* x, const bf16* ximg, const Fp8Weight& w,
                       uint32_t m) {
    uint32_t blocks = 0;
    if (w.k % 16 != 0 || tma_rows(m, w.k, &blocks) == 0 || blocks > 4) return false;
    const uint8_t* q = w.q;
    const float* sc = w.scales;
    void* map = w.map8;
    uint32_t n = w.n, k = w.k, shift = w.shift;
    void* args[] = {&out, &x, &ximg, &q, &sc, &map, &m, &n, &k, &shift};
    const uint32_t tiles = (n + 127) / 128;
    const uint32_t clusters = std::min<uint32_t>(tiles, std::max<uint32_t>(g_clusters / blocks, 1)) * blocks;
    launch_ex((const void*)linear_stream_tma_fp8, dim3(LIN_SEGS * clusters), dim3(LIN_DEC_THREADS), TMA_SMEM, pdl,
              s, args);
    return true;
}

// `permute_k32_tiles` of x [m, k] into `img` (ceil(m / 128) * ceil(k / 64) * 16 KiB).
static void permute(cudaStream_t s, bool pdl, bf16* img, const bf16* x, uint32_t m, uint32_t k) {
    void* args[] = {&img, &x, &m, &k};
    launch_ex((const void*)permute_k32_tiles, dim3(1024), dim3(256), 0, pdl, s, args);
}

static size_t image_bytes(uint32_t m, uint32_t k) { return (size_t)((m + 127) / 128) * ((k + 63) / 64) * 16384; }

// The prefill kernels from x's images: `linear_tma_fp8` of the FP8 weight, or (`bf16`) the bf16
// `linear_tma` of its dequantized image.
static void launch_prefill(bool pdl, cudaStream_t s, bf16* out, const bf16* xt, const Fp8Weight& w, uint32_t m,
                           bool bf16_path) {
    uint32_t n = w.n, k = w.k, shift = w.shift;
    const dim3 grid((m + 127) / 128, (n + 127) / 128);
    if (bf16_path) {
        const bf16* deq = w.deq;
        void* map = w.map16;
        void* args[] = {&out, &xt, &deq, &map, &m, &n, &k};
        launch_ex((const void*)linear_tma, grid, dim3(LIN_TMA_THREADS), PREFILL_SMEM, pdl, s, args);
    } else {
        const uint8_t* q = w.q;
        const float* sc = w.scales;
        void* map = w.map8;
        void* args[] = {&out, &xt, &q, &sc, &map, &m, &n, &k, &shift};
        launch_ex((const void*)linear_tma_fp8, grid, dim3(LIN_TMA_THREADS), PREFILL_SMEM, pdl, s, args);
    }
}

// Outputs that differ between two poisoned-then-written [m, n] bf16 buffers, and outputs left
// unwritten (still the poison) in `got`.
static size_t compare(const bf16* want, const bf16* got, size_t count, size_t* unwritten) {
    std::vector<uint16_t> a(count), b(count);
    CK(cudaMemcpy(a.data(), want, count * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(b.data(), got, count * 2, cudaMemcpyDeviceToHost));
    size_t diff = 0;
    *unwritten = 0;
    for (size_t i = 0; i < count; ++i) {
        diff += a[i] != b[i];
        *unwritten += b[i] == 0xFFFF;
    }
    return diff;
}

// One shape: the decode kernel (x's rows, and x's images where it takes them) against the
// map-less decode path at m <= 128, the prefill kernel against bf16 `linear_tma` of the
// dequantized weight above; returns the failing runs.
static int check(cudaStream_t s, uint32_t m, uint32_t n, uint32_t k, uint32_t shift) {
    Fp8Weight w = make_weight(n, k, shift, n * 31 + k);
    bf16* x = alloc_fill((size_t)m * k, m * 7 + k, 1.0f);
    bf16 *want, *got, *img;
    const size_t count = (size_t)m * n;
    CK(cudaMalloc(&want, count * 2));
    CK(cudaMalloc(&got, count * 2));
    CK(cudaMalloc(&img, image_bytes(m, k)));
    CK(cudaMemset(want, 0xFF, count * 2));
    permute(s, false, img, x, m, k);
    int bad = 0;
    auto report = [&](const char* what) {
        CK(cudaStreamSynchronize(s));
        size_t unwritten = 0;
        const size_t diff = compare(want, got, count, &unwritten);
        if (diff || unwritten) {
            printf("CHECK %s m=%u n=%u k=%u shift=%u: %zu differ, %zu unwritten\n", what, m, n, k, shift, diff,
                   unwritten);
            ++bad;
        }
    };
    if (m <= 128) {
        launch_ref(false, s, want, x, w, m);
        for (int images = 0; images < 2; ++images) {
            if (images && !(takes_images(k) && m >= 17)) continue;
            CK(cudaMemsetAsync(got, 0xFF, count * 2, s));
            if (!launch_tma(false, s, got, x, images ? img : nullptr, w, m)) break;
            report(images ? "stream_tma_fp8 images" : "stream_tma_fp8");
        }
    } else {
        launch_prefill(false, s, want, img, w, m, true);
        CK(cudaMemsetAsync(got, 0xFF, count * 2, s));
        launch_prefill(false, s, got, img, w, m, false);
        report("tma_fp8");
    }
    CK(cudaFree(x));
    CK(cudaFree(want));
    CK(cudaFree(got));
    CK(cudaFree(img));
    free_weight(w);
    return bad;
}

int main(int argc, char** argv) {
    const bool quick = argc > 1 && strcmp(argv[1], "quick") == 0;
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CK(cudaFuncSetAttribute((const void*)linear_stream_tma_fp8, cudaFuncAttributeMaxDynamicSharedMemorySize, TMA_SMEM));
    CK(cudaFuncSetAttribute((const void*)linear_stream_wide_fp8, cudaFuncAttributeMaxDynamicSharedMemorySize,
                            WIDE_FP8_SMEM));
    for (const void* fn : {(const void*)linear_tma, (const void*)linear_tma_fp8})
        CK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, PREFILL_SMEM));
    {
        cudaFuncAttributes fa;
        CK(cudaFuncGetAttributes(&fa, (const void*)linear_stream_tma_fp8));
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(LIN_SEGS * 64);
        cfg.blockDim = dim3(LIN_DEC_THREADS);
        cfg.dynamicSmemBytes = TMA_SMEM;
        CK(cudaOccupancyMaxActiveClusters(&g_clusters, (const void*)linear_stream_tma_fp8, &cfg));
        printf("linear_stream_tma_fp8: regs %d local %zu, resident clusters %d\n", fa.numRegs, fa.localSizeBytes,
               g_clusters);
        CK(cudaFuncGetAttributes(&fa, (const void*)linear_tma_fp8));
        printf("linear_tma_fp8: regs %d local %zu\n", fa.numRegs, fa.localSizeBytes);
    }

    // ---- 1. bitwise ----
    struct Shape {
        uint32_t m, n, k;
    };
    const Shape shapes[] = {{1, 4096, 4096},   {3, 136, 208},    {8, 6144, 4096},  {9, 136, 96},
                            {16, 4096, 12288}, {17, 1000, 4096}, {32, 200, 208},   {40, 24576, 4096},
                            {64, 4096, 12288}, {100, 264, 1024}, {128, 4096, 4096}, {129, 264, 1024},
                            {300, 1030, 4096}, {257, 136, 96},   {2048, 4096, 4096}};
    int bad = 0, runs = 0;
    for (const Shape& sh : shapes)
        for (uint32_t shift : {7u, 0u}) {
            bad += check(s, sh.m, sh.n, sh.k, shift);
            ++runs;
        }
    printf("bitwise: %d of %d shapes differ\n", bad, runs);
    if (quick) return bad ? 1 : 0;

    // ---- 2. decode rows ----
    const double read_gbs = read_ceiling_gbs(s);
    printf("ceiling: read-only stream %.0f GB/s\n", read_gbs);
    struct Proj {
        const char* name;
        uint32_t n, k;
    };
    const Proj projs[] = {{"qkv", 6144, 4096}, {"o", 4096, 4096}, {"gate_up", 24576, 4096}, {"down", 4096, 12288}};
    for (const Proj& pj : projs) {
        const size_t wbytes = (size_t)pj.n * pj.k;
        const int copies = (int)std::min<size_t>(8, std::max<size_t>(2, (320ull << 20) / wbytes + 1));
        std::vector<Fp8Weight> ws;
        for (int c = 0; c < copies; ++c) ws.push_back(make_weight(pj.n, pj.k, 7, 100 + c));
        bf16* x = alloc_fill((size_t)2048 * pj.k, 5, 1.0f);
        bf16 *out, *img;
        CK(cudaMalloc(&out, (size_t)2048 * pj.n * 2));
        CK(cudaMalloc(&img, image_bytes(2048, pj.k)));
        const double floor_us = ws[0].bytes() / read_gbs / 1e3;
        const int reps = 20;
        for (uint32_t m : {1u, 2u, 4u, 8u, 16u, 32u, 64u, 128u}) {
            permute(s, false, img, x, m, pj.k);
            double t[3] = {0, 0, 0};
            for (int v = 0; v < 3; ++v) {
                if (v == 2 && !(takes_images(pj.k) && m >= 17)) continue;
                t[v] = time_graph(s, [&](cudaStream_t st) {
                    for (int r = 0; r < reps; ++r) {
                        if (v == 0)
                            launch_ref(true, st, out, x, ws[r % copies], m);
                        else
                            launch_tma(true, st, out, x, v == 2 ? img : nullptr, ws[r % copies], m);
                    }
                }, 5) / reps * 1e3;
            }
            printf("%-8s m=%-3u floor %6.1f us: ref %6.1f (%.2fx)  tma_fp8 %6.1f (%.2fx)  images %6.1f\n", pj.name, m,
                   floor_us, t[0], t[0] / floor_us, t[1], t[1] / floor_us, t[2]);
        }

        // ---- 3. prefill rows ----
        const uint32_t m = 2048;
        permute(s, false, img, x, m, pj.k);
        const double flops = 2.0 * m * pj.n * pj.k;
        double t[3];
        for (int v = 0; v < 3; ++v)
            t[v] = time_graph(s, [&](cudaStream_t st) {
                for (int r = 0; r < 4; ++r) {
                    const Fp8Weight& w = ws[r % copies];
                    if (v == 1) launch_dequant(st, true, w.deq, w);
                    launch_prefill(true, st, out, img, w, m, v < 2);
                }
            }, 5) / 4;
        printf("%-8s m=%u: bf16 linear_tma %.1f us (%.0f TFLOP/s)  dequant+linear_tma %.1f us (%.0f)  "
               "linear_tma_fp8 %.1f us (%.0f)\n",
               pj.name, m, t[0] * 1e3, flops / t[0] / 1e9, t[1] * 1e3, flops / t[1] / 1e9, t[2] * 1e3,
               flops / t[2] / 1e9);
        for (auto& w : ws) free_weight(w);
        CK(cudaFree(x));
        CK(cudaFree(out));
        CK(cudaFree(img));
    }
    printf("lab done\n");
    return bad ? 1 : 0;
}
