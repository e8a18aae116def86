// Timeline lab: where a `linear_stream_wide` launch's time goes. A copy of the engine's
// linear_wide_impl (generated from kernels/gemm.cu, with timestamps added) records, per
// block, %globaltimer (ns) and clock64 at entry, after the wait, after the k loop, after the
// first cluster barrier and at exit; the host prints the launch's span, how block starts spread
// (waves), and the median phases. One launch at a time, weights hot in L2 or cold.
#include "../kernels/gemm.cu"

#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "lab_util.cuh"

#define STAMP(i)                                                                           \
    do {                                                                                   \
        if (threadIdx.x == 0) {                                                            \
            unsigned long long t_;                                                         \
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_));                         \
            ts[(size_t)blockIdx.x * 10 + (i)] = t_;                                        \
            ts[(size_t)blockIdx.x * 10 + 5 + (i)] = clock64();                             \
        }                                                                                  \
    } while (0)

// timed_wide_impl: linear_wide_impl with the stamps, written by lab/timeline_gen.py (lab/build.sh
// runs it) into target/gemm-lab, so the copy never drifts from kernels/gemm.cu.
#include "timeline_wide.cuh"

extern "C" __global__ void __cluster_dims__(LIN_SEGS, 1, 1) __launch_bounds__(LIN_STREAM_WARPS * 32, 3)
    timed_wide(float* out, const bf16* x, const bf16* w, uint32_t m, uint32_t n, uint32_t k, unsigned long long* ts) {
    extern __shared__ __align__(16) unsigned char sm[];
    timed_wide_impl<float, LIN_W_NT, LIN_W_STAGE_CH, LIN_W_STAGES, true>(out, x, w, m, n, k, sm, blockIdx.x / LIN_SEGS, ts);
}

int main() {
    const int SMEM = LIN_W_STAGES * LIN_W_STAGE_CH * 192 * 64;
    CK(cudaFuncSetAttribute((const void*)timed_wide, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM));
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    struct Shape { const char* name; uint32_t n, k, m; };
    for (Shape sh : {Shape{"o", 4096, 4096, 32}, Shape{"qkv", 6144, 4096, 32}, Shape{"down", 4096, 12288, 32},
                     Shape{"gate_up", 24576, 4096, 32}, Shape{"o", 4096, 4096, 64}, Shape{"gate_up", 24576, 4096, 64}}) {
        uint32_t n = sh.n, k = sh.k, m = sh.m;
        const int R = 16;
        std::vector<bf16*> ws(R);
        for (int i = 0; i < R; ++i) {
            CK(cudaMalloc(&ws[i], (size_t)n * k * 2));
            fill_bf16<<<1024, 256>>>(ws[i], (size_t)n * k, i + 1, 0.01f);
        }
        bf16* x;
        float* out;
        CK(cudaMalloc(&x, (size_t)m * k * 2));
        CK(cudaMalloc(&out, (size_t)m * n * 4));
        fill_bf16<<<64, 256>>>(x, (size_t)m * k, 99, 1.0f);
        const uint32_t blocks = LIN_SEGS * ((n + 127) / 128) * ((m + 63) / 64);
        unsigned long long* ts;
        CK(cudaMalloc(&ts, (size_t)blocks * 10 * 8));
        CK(cudaDeviceSynchronize());
        cudaEvent_t a, b;
        CK(cudaEventCreate(&a));
        CK(cudaEventCreate(&b));
        for (int hot = 0; hot < 2; ++hot) {
            std::vector<double> span_ev;
            std::vector<unsigned long long> h((size_t)blocks * 10);
            for (int it = 0; it < 6; ++it) {
                const bf16* w = ws[hot ? 0 : it % R];
                void* args[] = {&out, &x, (void*)&w, &m, &n, &k, &ts};
                CK(cudaEventRecord(a, s));
                launch_ex((const void*)timed_wide, dim3(blocks), dim3(LIN_STREAM_WARPS * 32), SMEM, false, s, args);
                CK(cudaEventRecord(b, s));
                CK(cudaEventSynchronize(b));
                float ms;
                CK(cudaEventElapsedTime(&ms, a, b));
                span_ev.push_back(ms * 1e3);
            }
            CK(cudaMemcpy(h.data(), ts, h.size() * 8, cudaMemcpyDeviceToHost));
            unsigned long long t0 = ~0ull, t1 = 0;
            for (uint32_t i = 0; i < blocks; ++i) { t0 = std::min(t0, h[i * 10]); t1 = std::max(t1, h[i * 10 + 4]); }
            std::vector<double> life, ph[4], starts;
            for (uint32_t i = 0; i < blocks; ++i) {
                const unsigned long long* c = &h[i * 10 + 5];
                life.push_back((c[4] - c[0]) / 1.98e3);
                for (int p = 0; p < 4; ++p) ph[p].push_back((c[p + 1] - c[p]) / 1.98e3);
                starts.push_back((h[i * 10] - t0) / 1e3);
            }
            auto med = [](std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; };
            auto pct = [](std::vector<double> v, double p) { std::sort(v.begin(), v.end()); return v[(size_t)(p * (v.size() - 1))]; };
            std::sort(span_ev.begin(), span_ev.end());
            printf("%-8s m=%-3u %s: %u blocks, event %.1f us, blocks' span %.1f us; block life median %.2f (p10 %.2f p90 %.2f) us = "
                   "wait %.2f + loop %.2f + partials %.2f + sum %.2f; starts p50 %.1f p90 %.1f max %.1f us\n",
                   sh.name, m, hot ? "hot " : "cold", blocks, span_ev[span_ev.size() / 2], (t1 - t0) / 1e3, med(life),
                   pct(life, 0.1), pct(life, 0.9), med(ph[0]), med(ph[1]), med(ph[2]), med(ph[3]), pct(starts, 0.5),
                   pct(starts, 0.9), pct(starts, 1.0));
        }
        for (auto w : ws) CK(cudaFree(w));
        CK(cudaFree(x));
        CK(cudaFree(out));
        CK(cudaFree(ts));
    }
    return 0;
}
