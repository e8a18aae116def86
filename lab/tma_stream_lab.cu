// The decode GEMM's weight stream without the GEMM: how fast can blocks pull a projection's weight
// through the tensor memory accelerator in `linear_stream_tma`'s order, and in other orders, with
// no arithmetic and no cluster sums? Separates what the access pattern and the multiprocessor
// count cost from what the kernel's consumers and cluster barriers cost.
//
// Patterns, each a persistent grid with a ring of STAGES 16 KiB stages a block, one thread
// queueing copies and one waiting for them:
// - tma8xG: `linear_stream_tma`'s order on G groups of 8 blocks (G = 15 is what the H200 makes
//   resident of the kernel's clusters): block b takes k segment b % 8 of tiles b / 8, + G, ...;
//   a stage is a box of 64 k by 128 weight rows (128 bytes of each of 128 rows).
// - rows8xG: the same units, but a stage is 16 rows by the segment's 512 k (1 KiB contiguous
//   from each row, 16 one-dimensional bulk copies).
// - units132: every multiprocessor, (tile, segment) units dealt round robin, boxes as tma8xG.
//
// tma_stream_lab  (lab/build.sh builds it). Prints GB/s per pattern for Qwen3-8B's projections
// beside a read-only stream's rate.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <vector>

typedef __nv_bfloat16 bf16;
#include "common.cuh"
#include "lab_tmap.cuh"

#define STAGES 6
#define STAGE_BYTES 16384

enum Pattern : uint32_t { TMA8, ROWS8, UNITS };

// A stage's copies for unit (tile t, segment seg), step j of its steps.
__device__ void issue_stage(Pattern pat, const CUtensorMap* map, const bf16* w, uint32_t k, uint32_t t, uint32_t seg,
                            uint32_t j, uint32_t dst, uint32_t bar) {
    const uint32_t seg_k = k / 8;
    mbar_expect_tx(bar, STAGE_BYTES);
    if (pat == ROWS8) {
        // 16 rows of the tile, the segment's whole k range each (seg_k * 2 bytes = 1 KiB).
        for (uint32_t r = 0; r < 16; ++r) {
            const bf16* src = w + (size_t)(t * 128 + j * 16 + r) * k + seg * seg_k;
            bulk_g2s(dst + r * seg_k * 2, src, seg_k * 2, bar);
        }
    } else {
        const uint32_t c0 = seg * seg_k + j * 64, r0 = t * 128;
        asm volatile(
            "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
            "l"(map), "r"(c0), "r"(r0), "r"(bar)
            : "memory");
    }
}

__global__ void __launch_bounds__(64) stream_kernel(Pattern pat, const __grid_constant__ CUtensorMap map,
                                                    const bf16* w, uint32_t n, uint32_t k, uint32_t groups,
                                                    uint32_t* sink) {
    extern __shared__ __align__(1024) unsigned char smem[];
    __shared__ __align__(8) uint64_t bars[2 * STAGES];
    const uint32_t tiles = n / 128, seg_k = k / 8;
    // Units this block takes: (tile, segment) pairs and the steps of each.
    uint32_t first, stride, count, steps;
    if (pat == UNITS) {
        first = blockIdx.x;
        stride = gridDim.x;
        count = first < tiles * 8 ? (tiles * 8 - first + stride - 1) / stride : 0;
    } else {
        const uint32_t g = blockIdx.x / 8;
        first = g * 8 + blockIdx.x % 8;  // unit = tile * 8 + seg
        stride = groups * 8;
        count = g < tiles ? (tiles - g + groups - 1) / groups : 0;
    }
    steps = pat == ROWS8 ? 8 : seg_k / 64;
    const uint32_t total = count * steps;
    // 1 KiB aligned, as the 128-byte swizzle wants.
    const uint32_t raw = (uint32_t)__cvta_generic_to_shared(smem), base = (raw + 1023) & ~1023u;
    unsigned char* sbase = smem + (base - raw);
    const uint32_t full = (uint32_t)__cvta_generic_to_shared(bars), empty = full + STAGES * 8;
    if (threadIdx.x == 0) {
        for (uint32_t s = 0; s < STAGES; ++s) {
            mbar_init(full + 8 * s, 1);
            mbar_init(empty + 8 * s, 1);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    auto unit_of = [&](uint32_t g, uint32_t& t, uint32_t& seg, uint32_t& j) {
        const uint32_t u = first + (g / steps) * stride;
        t = u / 8;
        seg = u % 8;
        j = g % steps;
    };
    if (threadIdx.x == 0) {
        for (uint32_t g = 0; g < total; ++g) {
            const uint32_t slot = g % STAGES;
            if (g >= STAGES) mbar_wait(empty + 8 * slot, ((g / STAGES) - 1) & 1);
            uint32_t t, seg, j;
            unit_of(g, t, seg, j);
            issue_stage(pat, &map, w, k, t, seg, j, base + slot * STAGE_BYTES, full + 8 * slot);
        }
    } else if (threadIdx.x == 32) {
        uint32_t acc = 0;
        for (uint32_t g = 0; g < total; ++g) {
            const uint32_t slot = g % STAGES;
            mbar_wait(full + 8 * slot, (g / STAGES) & 1);
            acc ^= *reinterpret_cast<const uint32_t*>(sbase + slot * STAGE_BYTES + (g % 64) * 4);
            mbar_arrive(empty + 8 * slot);
        }
        if (acc == 0x12345678u) *sink = acc;
    }
}

int main() {
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const double ceiling = read_ceiling_gbs(s);
    printf("read-only stream %.0f GB/s, %d multiprocessors\n", ceiling, sms);
    CK(cudaFuncSetAttribute(stream_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, STAGES * STAGE_BYTES + 1024));
    uint32_t* sink;
    CK(cudaMalloc(&sink, 4));
    struct Proj {
        const char* name;
        uint32_t n, k;
    };
    const Proj projs[] = {{"qkv 6144x4096", 6144, 4096}, {"o 4096x4096", 4096, 4096}, {"gate_up 24576x4096", 24576, 4096}};
    for (const Proj& p : projs) {
        const size_t bytes = (size_t)p.n * p.k * 2;
        const int copies = (int)std::max<size_t>(2, (size_t)(512ull << 20) / bytes);
        std::vector<bf16*> ws(copies);
        std::vector<CUtensorMap> maps(copies);
        for (int c = 0; c < copies; ++c) {
            CK(cudaMalloc(&ws[c], bytes));
            fill_bf16<<<1024, 256, 0, s>>>(ws[c], (size_t)p.n * p.k, c + 1, 0.5f);
            maps[c] = encode_weight_map(ws[c], p.n, p.k);
        }
        CK(cudaStreamSynchronize(s));
        struct Var {
            const char* name;
            Pattern pat;
            uint32_t groups, blocks;
        };
        const Var vars[] = {{"tma8x15", TMA8, 15, 120},   {"tma8x16", TMA8, 16, 128}, {"rows8x15", ROWS8, 15, 120},
                            {"rows8x16", ROWS8, 16, 128}, {"units132", UNITS, 0, (uint32_t)sms}};
        printf("%-20s", p.name);
        for (const Var& v : vars) {
            const double ms = time_graph(
                s,
                [&](cudaStream_t st) {
                    for (int c = 0; c < copies; ++c)
                        stream_kernel<<<v.blocks, 64, STAGES * STAGE_BYTES + 1024, st>>>(v.pat, maps[c], ws[c], p.n, p.k,
                                                                                  v.groups, sink);
                },
                10);
            printf("  %s %6.0f GB/s (%4.1f us)", v.name, bytes * copies / ms / 1e6, ms * 1e3 / copies);
        }
        printf("\n");
        for (bf16* w : ws) CK(cudaFree(w));
    }
    return 0;
}
