// Decode TMA lab: `linear_stream_tma` (kernels/gemm.cu, the weight by tensor map, wgmma) against
// the decode kernels the launcher runs without a map (`linear_stream`, `linear_stream_b4`,
// `linear_stream_wide`): bitwise on mixed shapes (poisoned outputs, f32 and bf16 out), then
// timed per projection (20 launches per CUDA graph, programmatic dependents, weights rotated past
// L2) and over 36 Qwen3-8B-shaped layers and the LM head with stand-in small kernels between the
// projections. Each check and each timing runs the kernel twice: x from its rows, and x from
// `permute_k32_tiles`'s stage images (what `add_rms_norm_staged` / `silu_mul_staged` write at
// decode sizes), where every k segment is whole stages. Build with lab/build.sh;
// `decode_tma_lab quick` skips the layer runs.
#include "../kernels/gemm.cu"

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "lab_tmap.cuh"
#include "lab_layers.cuh"

// `linear_tma`'s map of w, uploaded once per weight and shape (a freed weight's address comes
// back for the next one).
static void* weight_map(const bf16* w, uint32_t n, uint32_t k) {
    static std::map<std::tuple<const bf16*, uint32_t, uint32_t>, void*> maps;
    const auto key = std::make_tuple(w, n, k);
    auto it = maps.find(key);
    if (it != maps.end()) return it->second;
    void* dev = upload_map(encode_weight_map(w, n, k));
    maps[key] = dev;
    return dev;
}

// The launcher's choice without a map (ops_gemm::linear_path).
template <typename OutT>
static void launch_ref(bool pdl, cudaStream_t s, OutT* out, const bf16* x, const bf16* w, uint32_t m, uint32_t n,
                       uint32_t k) {
    const bool f32 = sizeof(OutT) == 4;
    void* args[] = {&out, &x, &w, &m, &n, &k};
    if (m <= 16) {
        const void* fn = n >= 65536 ? (f32 ? (const void*)linear_stream_b4_f32out : (const void*)linear_stream_b4)
                                    : (f32 ? (const void*)linear_stream_f32out : (const void*)linear_stream);
        launch_ex(fn, dim3(((n + 7) / 8) * ((m + 15) / 16)), dim3(256), 0, pdl, s, args);
    } else {
        const void* fn = f32 ? (const void*)linear_stream_wide_f32out : (const void*)linear_stream_wide;
        launch_ex(fn, dim3(LIN_SEGS * ((n + 127) / 128) * ((m + 63) / 64)), dim3(256),
                  LIN_W_STAGES * LIN_W_STAGE_CH * 192 * 64, pdl, s, args);
    }
}

static const int TMA_SMEM = LIN_DEC_SPACE + 2048;

// x's stage images for `linear_stream_tma` (NULL: it copies x's rows).
static const bf16* g_ximg = nullptr;

// `permute_k32_tiles` of x [m, k] (m <= 128) into a new buffer, rows past m NaN (stale, as a
// decode step finds them); the caller frees it.
static bf16* stage_images(const bf16* x, uint32_t m, uint32_t k) {
    const size_t bytes = (size_t)((k + 63) / 64) * 16384;
    bf16* img;
    CK(cudaMalloc(&img, bytes));
    CK(cudaMemset(img, 0xFF, bytes));
    void* args[] = {&img, &x, &m, &k};
    launch_ex((const void*)permute_k32_tiles, dim3(256), dim3(256), 0, false, 0, args);
    CK(cudaDeviceSynchronize());
    for (uint32_t j = 0; j < (k + 63) / 64; ++j)
        CK(cudaMemset(reinterpret_cast<char*>(img) + (size_t)j * 16384 + m * 128, 0xFF, (128 - m) * 128));
    return img;
}
static int g_clusters = 0;  // resident clusters of linear_stream_tma

// Where this lab runs `linear_stream_tma`: up to LIN_DEC_ROWS rows in at most two row blocks
// (the launcher takes it to 128 rows in up to four: ops_gemm::linear_stream_tma_fits).
static bool tma_fits(uint32_t m, uint32_t k) {
    uint32_t blocks = 0;
    return m <= LIN_DEC_ROWS && k % 8 == 0 && tma_rows(m, k, &blocks) != 0 && blocks <= 2;
}

template <typename OutT>
static void launch_tma(bool pdl, cudaStream_t s, OutT* out, const bf16* x, const bf16* w, uint32_t m, uint32_t n,
                       uint32_t k) {
    if (!tma_fits(m, k)) return launch_ref<OutT>(pdl, s, out, x, w, m, n, k);
    const bool f32 = sizeof(OutT) == 4;
    void* map = weight_map(w, n, k);
    const bf16* ximg = g_ximg;
    void* args[] = {&out, &x, &ximg, &w, &map, &m, &n, &k};
    const void* fn = f32 ? (const void*)linear_stream_tma_f32out : (const void*)linear_stream_tma;
    uint32_t blocks = 1;
    tma_rows(m, k, &blocks);
    const uint32_t tiles = (n + 127) / 128;
    const uint32_t clusters = std::min<uint32_t>(tiles, std::max<uint32_t>(g_clusters / blocks, 1)) * blocks;
    launch_ex(fn, dim3(LIN_SEGS * clusters), dim3(LIN_DEC_THREADS), TMA_SMEM, pdl, s, args);
}

template <typename OutT>
static int check(cudaStream_t s, uint32_t m, uint32_t n, uint32_t k, int pdl, bool images) {
    bf16* x = alloc_fill((size_t)m * k, m * 7 + k, 1.0f);
    bf16* w = alloc_fill((size_t)n * k, n * 13 + k, sqrtf(3.0f / k));
    OutT *ref, *out;
    const size_t bytes = (size_t)m * n * sizeof(OutT);
    CK(cudaMalloc(&ref, bytes));
    CK(cudaMalloc(&out, bytes));
    CK(cudaDeviceSynchronize());
    CK(cudaMemsetAsync(ref, 0xFF, bytes, s));
    CK(cudaMemsetAsync(out, 0xFF, bytes, s));
    launch_ref<OutT>(pdl, s, ref, x, w, m, n, k);
    bf16* img = images && m <= 128 && takes_images(k) ? stage_images(x, m, k) : nullptr;
    if (images && !img) {  // nothing to check from images
        CK(cudaStreamSynchronize(s));
        CK(cudaFree(x));
        CK(cudaFree(w));
        CK(cudaFree(ref));
        CK(cudaFree(out));
        return 0;
    }
    g_ximg = img;
    launch_tma<OutT>(pdl, s, out, x, w, m, n, k);
    g_ximg = nullptr;
    std::vector<unsigned char> hr(bytes), ho(bytes);
    CK(cudaMemcpyAsync(hr.data(), ref, bytes, cudaMemcpyDeviceToHost, s));
    CK(cudaMemcpyAsync(ho.data(), out, bytes, cudaMemcpyDeviceToHost, s));
    CK(cudaStreamSynchronize(s));
    size_t diff = 0, unwritten = 0, first = 0;
    const size_t E = sizeof(OutT);
    for (size_t i = 0; i < (size_t)m * n; ++i) {
        bool all_ff = true;
        for (size_t b = 0; b < E; ++b) all_ff &= ho[i * E + b] == 0xFF;
        unwritten += all_ff;
        if (memcmp(&hr[i * E], &ho[i * E], E) != 0) {
            if (!diff) first = i;
            ++diff;
        }
    }
    if (diff || unwritten)
        printf("CHECK %s m=%u n=%u k=%u pdl=%d%s: %zu differ (first [%zu] row %zu col %zu), %zu unwritten\n",
               E == 4 ? "f32" : "bf16", m, n, k, pdl, img ? " images" : "", diff, first, first / n, first % n,
               unwritten);
    if (img) CK(cudaFree(img));
    CK(cudaFree(x));
    CK(cudaFree(w));
    CK(cudaFree(ref));
    CK(cudaFree(out));
    return diff || unwritten ? 1 : 0;
}

int main(int argc, char** argv) {
    const bool quick = argc > 1 && strcmp(argv[1], "quick") == 0;
    const bool brief = argc > 1 && strcmp(argv[1], "brief") == 0;  // for compute-sanitizer
    const bool speed = argc > 1 && strcmp(argv[1], "speed") == 0;  // projections only, no checks
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    for (const void* fn : {(const void*)linear_stream_tma, (const void*)linear_stream_tma_f32out}) {
        CK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, TMA_SMEM));
        cudaFuncAttributes fa;
        CK(cudaFuncGetAttributes(&fa, fn));
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(LIN_SEGS * 64);
        cfg.blockDim = dim3(LIN_DEC_THREADS);
        cfg.dynamicSmemBytes = TMA_SMEM;
        int clusters = 0;
        CK(cudaOccupancyMaxActiveClusters(&clusters, fn, &cfg));
        printf("linear_stream_tma: regs %d local %zu, resident clusters %d\n", fa.numRegs, fa.localSizeBytes, clusters);
        g_clusters = clusters;
    }
    for (const void* fn : {(const void*)linear_stream_wide, (const void*)linear_stream_wide_f32out})
        CK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, LIN_W_STAGES * LIN_W_STAGE_CH * 192 * 64));

    if (argc > 4 && strcmp(argv[1], "profile") == 0) {  // decode_tma_lab profile N K M: three launches
        const uint32_t n = atoi(argv[2]), k = atoi(argv[3]), m = atoi(argv[4]);
        bf16* x = alloc_fill((size_t)m * k, 5, 1.0f);
        bf16* w = alloc_fill((size_t)n * k, 6, 0.03f);
        bf16* out;
        CK(cudaMalloc(&out, (size_t)m * n * 2));
        CK(cudaDeviceSynchronize());
        for (int i = 0; i < 3; ++i) launch_tma<bf16>(true, s, out, x, w, m, n, k);
        for (int i = 0; i < 3; ++i) launch_ref<bf16>(true, s, out, x, w, m, n, k);
        CK(cudaStreamSynchronize(s));
        return 0;
    }

    // ---- 1. bitwise ----
    if (!speed) {
        struct Shape { uint32_t m, n, k; };
        std::vector<Shape> shapes = {{1, 4096, 4096},  {1, 1004, 4096},  {2, 6144, 4096},  {5, 6144, 4096},
                                     {8, 520, 256},    {9, 136, 96},     {16, 4096, 12288}, {17, 1000, 4096},
                                     {32, 4096, 12288}, {33, 136, 64},   {64, 300, 1024},  {65, 264, 1032},
                                     {100, 264, 1024}, {128, 4096, 4096}, {1, 151936, 4096}, {3, 8, 8},
                                     {40, 24576, 4096}, {1, 12352, 4104}, {7, 200, 488}, {64, 4096, 12288},
                                     {48, 1000, 12288}};
        int bad = 0, runs = 0;
        for (auto sh : shapes)
            for (int pdl = 0; pdl < 2; ++pdl)
                for (bool images : {false, true}) {
                    bad += check<float>(s, sh.m, sh.n, sh.k, pdl, images);
                    bad += check<bf16>(s, sh.m, sh.n, sh.k, pdl, images);
                    runs += 2;
                }
        printf("bitwise: %d of %d runs differ from the map-less kernels\n", bad, runs);
    }

    // ---- 2. ceiling ----
    const double read_gbs = read_ceiling_gbs(s);
    printf("ceiling: read-only stream %.0f GB/s\n", read_gbs);

    // ---- 3. each projection alone ----
    struct Proj { const char* name; uint32_t n, k; };
    std::vector<Proj> projs = {{"qkv", 6144, 4096}, {"o", 4096, 4096}, {"gate_up", 24576, 4096},
                               {"down", 4096, 12288}, {"lm_head", 151936, 4096}, {"gdn_in", 12352, 4096}};
    for (auto pj : projs) {
        const size_t wbytes = (size_t)pj.n * pj.k * 2;
        const int copies = (int)std::min<size_t>(8, std::max<size_t>(2, (320ull << 20) / wbytes + 1));
        std::vector<bf16*> ws;
        for (int c = 0; c < copies; ++c) ws.push_back(alloc_fill((size_t)pj.n * pj.k, 100 + c, 0.03f));
        for (auto w : ws) weight_map(w, pj.n, pj.k);
        bf16* x = alloc_fill((size_t)128 * pj.k, 5, 1.0f);
        bf16* out;
        CK(cudaMalloc(&out, (size_t)128 * pj.n * 2));
        CK(cudaDeviceSynchronize());
        for (uint32_t m : {1u, 4u, 8u, 16u, 32u, 64u, 128u}) {
            if (pj.n == 151936 && m > 32) continue;
            if (speed && (m == 4 || m == 16 || pj.n == 151936 || pj.n == 12352)) continue;
            if (brief && m != 1 && m != 64) continue;
            const int reps = brief ? 3 : 20;
            // ref, tma from x's rows, tma from x's images (where it takes them)
            bf16* img = m <= 128 && takes_images(pj.k) ? stage_images(x, m, pj.k) : nullptr;
            double t[3] = {0, 0, 0};
            for (int v = 0; v < (img ? 3 : 2); ++v) {
                printf("(%s m=%u %s)\n", pj.name, m, v == 0 ? "ref" : v == 1 ? "tma" : "tma images");
                fflush(stdout);
                g_ximg = v == 2 ? img : nullptr;
                t[v] = time_graph(s, [&](cudaStream_t st) {
                    for (int r = 0; r < reps; ++r) {
                        if (v == 0) launch_ref<bf16>(true, st, out, x, ws[r % copies], m, pj.n, pj.k);
                        else launch_tma<bf16>(true, st, out, x, ws[r % copies], m, pj.n, pj.k);
                    }
                }, brief ? 1 : 5) / reps * 1e3;
                g_ximg = nullptr;
            }
            if (img) CK(cudaFree(img));
            printf("%-8s m=%-3u floor %6.1f us: ref %6.1f (%3.0f%%)  tma%s %6.1f (%3.0f%%)  images %6.1f\n", pj.name,
                   m, wbytes / read_gbs / 1e3, t[0], 100.0 * wbytes / (t[0] * 1e3) / read_gbs,
                   tma_fits(m, pj.k) ? "" : "(ref)", t[1], 100.0 * wbytes / (t[1] * 1e3) / read_gbs, t[2]);
        }
        for (auto w : ws) CK(cudaFree(w));
        CK(cudaFree(x));
        CK(cudaFree(out));
        if (brief) break;
    }
    if (quick || brief || speed) return 0;

    // ---- 4. 36 Qwen3-8B layers + LM head, small kernels between ----
    {
        const LabLayers layers;
        for (uint32_t l = 0; l < LabLayers::L; ++l) {
            weight_map(layers.wq[l], LabLayers::QKV, LabLayers::H);
            weight_map(layers.wo[l], LabLayers::H, LabLayers::H);
            weight_map(layers.wgu[l], 2 * LabLayers::FFN, LabLayers::H);
            weight_map(layers.wd[l], LabLayers::H, LabLayers::FFN);
        }
        weight_map(layers.head, LabLayers::V, LabLayers::H);
        const double floor_ms = LabLayers::floor_ms(read_gbs);
        for (uint32_t m : {1u, 8u, 16u, 32u, 64u, 128u}) {
            double t[2];
            for (int v = 0; v < 2; ++v)
                t[v] = time_graph(s, [&](cudaStream_t st) {
                    layers.enqueue(st, m, true, true,
                                   [&](cudaStream_t q, float* out, const bf16* x, const bf16* w, uint32_t n, uint32_t k) {
                                       if (v == 0) launch_ref<float>(true, q, out, x, w, m, n, k);
                                       else launch_tma<float>(true, q, out, x, w, m, n, k);
                                   });
                }, 5);
            printf("layers m=%-3u weight floor %.3f ms: ref %.3f ms (%.2fx)  tma %.3f ms (%.2fx)\n", m, floor_ms, t[0],
                   t[0] / floor_ms, t[1], t[1] / floor_ms);
        }
    }
    printf("lab done\n");
    return 0;
}
