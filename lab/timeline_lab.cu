// Timeline lab: where a `linear_stream_wide` launch's time goes. A copy of the engine's
// linear_wide_impl (extracted by script from kernels/gemm.cu, with timestamps added) records, per
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

template <typename OutT, int NT, int STAGE_CH, int STAGES, bool VEC>
MT_DEVICE void timed_wide_impl(OutT* out, const bf16* x, const bf16* w, uint32_t m, uint32_t n,
                                uint32_t k, unsigned char* smem, unsigned long long* ts) {
    STAMP(0);
    constexpr uint32_t BN = 64 * NT;
    constexpr uint32_t STAGE_VECS = STAGE_CH * (BN + LIN_W_ROWS) * 4;
    cg::cluster_group cluster = cg::this_cluster();
    const uint32_t tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
    const uint32_t seg = cluster.block_rank(), tile = blockIdx.x / LIN_SEGS;
    const uint32_t row_blocks = (m + LIN_W_ROWS - 1) / LIN_W_ROWS;
    const uint32_t n0 = (tile / row_blocks) * BN, m0 = (tile % row_blocks) * LIN_W_ROWS;
    const uint32_t rows = m0 < m ? min(LIN_W_ROWS, m - m0) : 0;
    const uint32_t row_tiles = (rows + 15) / 16;
    const uint32_t chunks = (k + LIN_KC - 1) / LIN_KC;
    const uint32_t seg_chunks = (chunks + LIN_SEGS - 1) / LIN_SEGS;
    const uint32_t nsegs = seg_chunks > 0 ? (chunks + seg_chunks - 1) / seg_chunks : 0;
    const uint32_t c_begin = min(chunks, seg * seg_chunks);
    const uint32_t c_end = min(chunks, c_begin + seg_chunks);
    const uint32_t steps = (c_end - c_begin + STAGE_CH - 1) / STAGE_CH;
    uint4* ring = reinterpret_cast<uint4*>(smem);

    auto issue_w = [&](uint32_t j) {
        if (j < steps)
            wide_issue<BN, STAGE_CH, VEC>(ring + (j % STAGES) * STAGE_VECS, w, n, k, n0, BN, 0,
                                      c_begin + j * STAGE_CH, c_end);
    };
    auto issue_x = [&](uint32_t j) {
        if (j < steps)
            wide_issue<BN, STAGE_CH, VEC>(ring + (j % STAGES) * STAGE_VECS, x, m, k, m0,
                                          row_tiles * 16, BN, c_begin + j * STAGE_CH, c_end);
        cp_async_commit();  // an empty group past the end keeps the group count uniform
    };

    // The weight is never written by the kernel ahead on the stream: its first stages are
    // queued before the wait, x (that kernel's output) after it.
#pragma unroll
    for (int p = 0; p < STAGES - 1; ++p) issue_w(p);
    pdl_wait();
    pdl_trigger();
    STAMP(1);
#pragma unroll
    for (int p = 0; p < STAGES - 1; ++p) issue_x(p);

    float acc[4][NT][4];
#pragma unroll
    for (int rt = 0; rt < 4; ++rt)
#pragma unroll
        for (int t = 0; t < NT; ++t)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[rt][t][i] = 0.0f;

    for (uint32_t j = 0; j < steps; ++j) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();  // stage j is complete for everyone, and stage j - 1 is read
        issue_w(j + STAGES - 1);
        issue_x(j + STAGES - 1);
        const uint4* st = ring + (j % STAGES) * STAGE_VECS;
#pragma unroll
        for (int ch = 0; ch < STAGE_CH; ++ch) {
            if (c_begin + j * STAGE_CH + ch >= c_end) break;
            uint4 wb[NT];
#pragma unroll
            for (int t = 0; t < NT; ++t) wb[t] = st[wide_slot<BN>(ch, warp * 8 * NT + t * 8 + g, q)];
#pragma unroll
            for (int rt = 0; rt < 4; ++rt) {
                if ((uint32_t)rt >= row_tiles) break;
                const uint4 ra = st[wide_slot<BN>(ch, BN + rt * 16 + g, q)];
                const uint4 rb = st[wide_slot<BN>(ch, BN + rt * 16 + g + 8, q)];
#pragma unroll
                for (int t = 0; t < NT; ++t) mma_chunk(acc[rt][t], ra, rb, wb[t]);
            }
        }
    }
    STAMP(2);
    cp_async_wait<0>();
    __syncthreads();  // the ring is free: the partials take its place

    // Partials: [warp][row tile][column tile][lane] float4, the MMA accumulator layout.
    float4* part = reinterpret_cast<float4*>(smem);
#pragma unroll
    for (int rt = 0; rt < 4; ++rt)
#pragma unroll
        for (int t = 0; t < NT; ++t)
            part[((warp * 4 + rt) * NT + t) * 32 + lane] =
                make_float4(acc[rt][t][0], acc[rt][t][1], acc[rt][t][2], acc[rt][t][3]);
    cluster_publish_arrive();
    cluster_wait();
    STAMP(3);
    // This block's share of the tile: float4 `f` of the partial layout, summed over the
    // segments in order.
    constexpr uint32_t PART_VECS = LIN_STREAM_WARPS * 4 * NT * 32;
    for (uint32_t f = seg * (PART_VECS / LIN_SEGS) + tid; f < (seg + 1) * (PART_VECS / LIN_SEGS);
         f += blockDim.x) {
        const uint32_t ln = f % 32, t = (f / 32) % NT, rt = (f / (32 * NT)) % 4, wp = f / (128 * NT);
        if (rt >= row_tiles) continue;
        float4 total = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        for (uint32_t sg = 0; sg < nsegs; ++sg) {
            const float4 v = cluster.map_shared_rank(part, sg)[f];
            total.x += v.x;
            total.y += v.y;
            total.z += v.z;
            total.w += v.w;
        }
        const float vals[4] = {total.x, total.y, total.z, total.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const uint32_t row = m0 + rt * 16 + ln / 4 + (i >= 2 ? 8 : 0);
            const uint32_t col = n0 + wp * 8 * NT + t * 8 + (ln % 4) * 2 + (i & 1);
            if (row < m && col < n) store_out(out, (size_t)row * n + col, vals[i]);
        }
    }
    cluster_leave_barrier();  // no block leaves while another still reads its partials
    STAMP(4);
}


extern "C" __global__ void __cluster_dims__(LIN_SEGS, 1, 1) __launch_bounds__(LIN_STREAM_WARPS * 32, 3)
    timed_wide(float* out, const bf16* x, const bf16* w, uint32_t m, uint32_t n, uint32_t k, unsigned long long* ts) {
    extern __shared__ __align__(16) unsigned char sm[];
    timed_wide_impl<float, LIN_W_NT, LIN_W_STAGE_CH, LIN_W_STAGES, true>(out, x, w, m, n, k, sm, ts);
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
                cudaLaunchConfig_t cfg = {};
                cfg.gridDim = dim3(blocks);
                cfg.blockDim = dim3(LIN_STREAM_WARPS * 32);
                cfg.dynamicSmemBytes = SMEM;
                cfg.stream = s;
                CK(cudaEventRecord(a, s));
                CK(cudaLaunchKernelExC(&cfg, (const void*)timed_wide, args));
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
