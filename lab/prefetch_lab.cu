// Prefetch lab: does warming L2 with the next projection's weight, during a latency-bound
// kernel that leaves device memory idle (a stand-in spinning for a fixed time, like decode
// attention at batch 1), make the projection after it faster? The projection is the engine's
// m <= 16 kernel (`linear_stream`) on a Qwen3-8B o_proj (4096 x 4096), 20 weights rotated past
// L2. Variants: `l2_prefetch` (below; lab only) as a programmatic kernel
// before the stand-in; the prefetch issued inside the stand-in (bulk, or one
// `prefetch.global.L2` per 128-byte line). `prefetch_lab prefetch` runs these.
// Without arguments: the decode projections cold (device memory) and hot (the same weight every
// launch), m = 1 .. 128; only `o` (33.5 MB) fits the 50 MB L2, so only its hot column reads L2.
#include "../kernels/gemm.cu"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <vector>

#include "lab_util.cuh"

// Dynamic shared memory of `linear_stream_wide` (ops_gemm/geometry.rs).
static const int WIDE_SMEM = LIN_W_STAGES * LIN_W_STAGE_CH * 192 * 64;

// Bytes each `cp.async.bulk.prefetch.L2` of `l2_prefetch` asks for.
#define L2_PREFETCH_CHUNK (32u * 1024u)

// l2_prefetch(src: [bytes], bytes: u64): asks the L2 cache to fetch bytes [src, src + bytes)
// (rounded down to 16) from device memory; writes nothing and changes no result. Launched as a
// programmatic dependent of a kernel that leaves the memory system idle (attention, the
// recurrence, the norms), so the weight the kernel after it streams is read from L2 rather than
// device memory. `src` is 16-byte aligned. Any grid: thread t of the grid takes chunks t,
// t + threads, ... The prefetches are issued before `pdl_wait` (nothing here is written by an
// earlier kernel); the wait keeps the stream's order for the kernel after this one.
__global__ void l2_prefetch(const uint8_t* __restrict__ src, uint64_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const uint64_t end = bytes & ~(uint64_t)15;
    const uint64_t threads = (uint64_t)gridDim.x * blockDim.x;
    for (uint64_t off = ((uint64_t)blockIdx.x * blockDim.x + threadIdx.x) * L2_PREFETCH_CHUNK; off < end;
         off += threads * L2_PREFETCH_CHUNK) {
        const uint32_t len = (uint32_t)min((uint64_t)L2_PREFETCH_CHUNK, end - off);
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(src + off), "r"(len) : "memory");
    }
#endif
    pdl_wait();
    pdl_trigger();
}

// Spin for `ns` nanoseconds in every block; mode 1: first issue bulk prefetches of this block's
// slice of [src, src + bytes); mode 2: one prefetch.global.L2 per 128-byte line.
__global__ void spin(uint64_t ns, const uint8_t* src, uint64_t bytes, int mode) {
    pdl_wait();
    if (mode == 1) {
        const uint64_t threads = (uint64_t)gridDim.x * blockDim.x;
        for (uint64_t off = (blockIdx.x * (uint64_t)blockDim.x + threadIdx.x) * 32768; off < bytes;
             off += threads * 32768) {
            const uint32_t len = (uint32_t)min((uint64_t)32768, bytes - off);
            asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(src + off), "r"(len) : "memory");
        }
    } else if (mode == 2) {
        const uint64_t threads = (uint64_t)gridDim.x * blockDim.x;
        for (uint64_t off = (blockIdx.x * (uint64_t)blockDim.x + threadIdx.x) * 128; off < bytes; off += threads * 128)
            asm volatile("prefetch.global.L2 [%0];\n" ::"l"(src + off));
    }
    uint64_t t0;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    for (;;) {
        uint64_t t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        if (t - t0 >= ns) break;
    }
}

// One decode projection of the engine's launcher (ops_gemm::linear_path), as a programmatic
// dependent: the m <= 16 kernels (`linear_stream_b4` from 6144 columns) when `narrow`, else the
// wide cluster kernel.
static void launch_projection(cudaStream_t s, bool narrow, bf16* out, const bf16* x, const bf16* w, uint32_t m,
                              uint32_t n, uint32_t k) {
    void* args[] = {&out, (void*)&x, (void*)&w, &m, &n, &k};
    if (narrow)
        launch_ex(n >= 6144 ? (const void*)linear_stream_b4 : (const void*)linear_stream,
                  dim3((n + 7) / 8 * ((m + 15) / 16)), dim3(256), 0, true, s, args);
    else
        launch_ex((const void*)linear_stream_wide, dim3(LIN_SEGS * ((n + 127) / 128) * ((m + 63) / 64)),
                  dim3(LIN_STREAM_WARPS * 32), WIDE_SMEM, true, s, args);
}

// The decode projections from device memory (weights rotated past L2) against the same weight
// every launch (read from L2): how much of each launch is bytes, how much is the kernel's own
// latency.
static void hot_cold(cudaStream_t s) {
    struct Shape { const char* name; uint32_t n, k; };
    printf("projection, m: cold us (device memory) / hot us (L2) / floor us at 4.45 TB/s\n");
    for (Shape sh : {Shape{"qkv", 6144, 4096}, Shape{"o", 4096, 4096}, Shape{"gate_up", 24576, 4096},
                     Shape{"down", 4096, 12288}, Shape{"lm_head", 151936, 4096}}) {
        uint32_t n = sh.n, k = sh.k;
        const int R = (int)std::max<uint64_t>(4, 600000000ull / ((uint64_t)n * k * 2));
        std::vector<bf16*> ws(R);
        for (int i = 0; i < R; ++i) {
            CK(cudaMalloc(&ws[i], (size_t)n * k * 2));
            fill_bf16<<<1024, 256>>>(ws[i], (size_t)n * k, i + 1, 0.01f);
        }
        bf16 *x, *out;
        CK(cudaMalloc(&x, (size_t)128 * k * 2));  // out: bf16 [128, n]
        CK(cudaMalloc(&out, (size_t)128 * n * 2));
        fill_bf16<<<64, 256>>>(x, (size_t)128 * k, 99, 1.0f);
        CK(cudaDeviceSynchronize());
        printf("%-8s", sh.name);
        for (uint32_t mm : {1u, 8u, 16u, 32u, 64u, 128u, 1032u, 1064u}) {
            // 1000 + m: the m <= 16 kernel (b4) at m rows.
            uint32_t m = mm > 1000 ? mm - 1000 : mm;
            const bool narrow = mm > 1000 || m <= 16;
            auto gemv = [&](cudaStream_t st, int i) { launch_projection(st, narrow, out, x, ws[i], m, n, k); };
            const double cold = time_graph(s, [&](cudaStream_t st) { for (int i = 0; i < 20; ++i) gemv(st, i % R); }, 20) * 1e3 / 20;
            const double hot = time_graph(s, [&](cudaStream_t st) { for (int i = 0; i < 20; ++i) gemv(st, 0); }, 20) * 1e3 / 20;
            printf(" | %sm%-3u %6.1f / %6.1f", mm > 1000 ? "b4 " : "", m, cold, hot);
        }
        printf(" | floor %.1f\n", (double)n * k * 2 / 4.45e6);
        for (auto w : ws) CK(cudaFree(w));
        CK(cudaFree(x));
        CK(cudaFree(out));
    }
}

int main(int argc, char** argv) {
    CK(cudaFuncSetAttribute((const void*)linear_stream_wide, cudaFuncAttributeMaxDynamicSharedMemorySize, WIDE_SMEM));
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    if (argc < 2 || strcmp(argv[1], "prefetch") != 0) {
        hot_cold(s);
        return 0;
    }
    const int R = 20;
    struct Shape { const char* name; uint32_t n, k, m; };
    for (Shape sh : {Shape{"o", 4096, 4096, 1}, Shape{"qkv", 6144, 4096, 1}, Shape{"o", 4096, 4096, 32}}) {
        uint32_t n = sh.n, k = sh.k, m = sh.m;
        std::vector<bf16*> ws(R);
        for (auto& w : ws) {
            CK(cudaMalloc(&w, (size_t)n * k * 2));
            fill_bf16<<<1024, 256>>>(w, (size_t)n * k, (size_t)(&w - ws.data()) + 1, 0.01f);
        }
        bf16* x;
        CK(cudaMalloc(&x, (size_t)m * k * 2));
        fill_bf16<<<64, 256>>>(x, (size_t)m * k, 99, 1.0f);
        bf16* out;
        CK(cudaMalloc(&out, (size_t)m * n * 2));
        CK(cudaDeviceSynchronize());
        const uint64_t bytes = (uint64_t)n * k * 2;
        auto gemv = [&](cudaStream_t st, int i) { launch_projection(st, m <= 16, out, x, ws[i], m, n, k); };
        auto spin_k = [&](cudaStream_t st, uint64_t ns, int i, int mode, uint64_t pbytes) {
            const uint8_t* src = (const uint8_t*)ws[i];
            void* args[] = {&ns, (void*)&src, &pbytes, &mode};
            launch_ex((const void*)spin, dim3(264), dim3(128), 0, false, st, args);
        };
        auto pf_k = [&](cudaStream_t st, int i, uint64_t pbytes) {
            const uint8_t* src = (const uint8_t*)ws[i];
            const uint32_t blocks = (uint32_t)std::min<uint64_t>(132, std::max<uint64_t>(1, (pbytes / 32768 + 31) / 32));
            void* args[] = {(void*)&src, &pbytes};
            launch_ex((const void*)l2_prefetch, dim3(blocks), dim3(32), 0, true, st, args);
        };
        printf("== %s %ux%u m=%u (%.1f MB)\n", sh.name, n, k, m, bytes / 1e6);
        const double alone = time_graph(s, [&](cudaStream_t st) { for (int i = 0; i < R; ++i) gemv(st, i); }, 20) * 1e3 / R;
        const double hot = time_graph(s, [&](cudaStream_t st) { for (int i = 0; i < R; ++i) gemv(st, 0); }, 20) * 1e3 / R;
        printf("  projection alone %.2f us, same weight every time (L2) %.2f us\n", alone, hot);
        for (uint64_t ns : {0ull, 8000ull, 20000ull}) {
            const double v0 = time_graph(s, [&](cudaStream_t st) { for (int i = 0; i < R; ++i) { spin_k(st, ns, i, 0, 0); gemv(st, i); } }, 20) * 1e3 / R;
            const double v1 = time_graph(s, [&](cudaStream_t st) { for (int i = 0; i < R; ++i) { pf_k(st, i, bytes); spin_k(st, ns, i, 0, 0); gemv(st, i); } }, 20) * 1e3 / R;
            const double v1b = time_graph(s, [&](cudaStream_t st) { for (int i = 0; i < R; ++i) { pf_k(st, (i + 7) % R, bytes); spin_k(st, ns, i, 0, 0); gemv(st, i); } }, 20) * 1e3 / R;
            const double v2 = time_graph(s, [&](cudaStream_t st) { for (int i = 0; i < R; ++i) { spin_k(st, ns, i, 1, bytes); gemv(st, i); } }, 20) * 1e3 / R;
            const double v3 = time_graph(s, [&](cudaStream_t st) { for (int i = 0; i < R; ++i) { spin_k(st, ns, i, 2, bytes); gemv(st, i); } }, 20) * 1e3 / R;
            const double v4 = time_graph(s, [&](cudaStream_t st) { for (int i = 0; i < R; ++i) { spin_k(st, ns, i, 1, bytes / 2); gemv(st, i); } }, 20) * 1e3 / R;
            printf("  spin %5.1f us: none %.2f | l2_prefetch kernel %.2f (wrong weight %.2f) | in-kernel bulk %.2f | in-kernel lines %.2f | bulk half %.2f  (us per spin+projection)\n",
                   ns / 1e3, v0, v1, v1b, v2, v3, v4);
        }
        for (auto w : ws) CK(cudaFree(w));
        CK(cudaFree(x));
        CK(cudaFree(out));
    }
    return 0;
}
