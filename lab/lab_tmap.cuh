// What the labs with tensor maps share: `encode_weight_map`, `linear_tma`'s map of a bf16 [n, k]
// weight (boxes of 64 k by 128 rows, 128-byte swizzle) as the engine's CUDA backend encodes it,
// `encode_fp8_weight_map`, the FP8 kernels' map of an e4m3 [n, k] weight (boxes of 64 bytes by
// 128 rows, 64-byte swizzle), `tma_rows` and `takes_images` (how `linear_stream_tma` holds x),
// and `read_ceiling_gbs`, the rate of a read-only stream of 2 GiB (the labs' floor).
#pragma once

#include <cuda.h>

#include "lab_util.cuh"

typedef CUresult (*EncodeTiled)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// A 2-D map of the [n, k] matrix at `w` with `elem` bytes an element, boxes of 64 elements by
// 128 rows, swizzled by the box row's bytes.
static CUtensorMap encode_map_2d(const void* w, uint32_t n, uint32_t k, CUtensorMapDataType type, uint32_t elem,
                                 CUtensorMapSwizzle swizzle) {
    static EncodeTiled enc = nullptr;
    if (!enc) {
        cudaDriverEntryPointQueryResult q;
        CK(cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", (void**)&enc, cudaEnableDefault, &q));
    }
    CUtensorMap map;
    cuuint64_t dims[2] = {k, n}, strides[1] = {(cuuint64_t)k * elem};
    cuuint32_t box[2] = {64, 128}, es[2] = {1, 1};
    CUresult r = enc(&map, type, 2, (void*)w, dims, strides, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                     CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
        printf("cuTensorMapEncodeTiled failed: %d\n", (int)r);
        exit(1);
    }
    return map;
}

static CUtensorMap encode_weight_map(const bf16* w, uint32_t n, uint32_t k) {
    return encode_map_2d(w, n, k, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, CU_TENSOR_MAP_SWIZZLE_128B);
}

static CUtensorMap encode_fp8_weight_map(const uint8_t* w, uint32_t n, uint32_t k) {
    return encode_map_2d(w, n, k, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, CU_TENSOR_MAP_SWIZZLE_64B);
}

// The device copy of `map` (the caller frees it).
static void* upload_map(const CUtensorMap& map) {
    void* dev;
    CK(cudaMalloc(&dev, 128));
    CK(cudaMemcpy(dev, &map, 128, cudaMemcpyHostToDevice));
    return dev;
}

// x's rows a `linear_stream_tma` block holds for m rows by k inputs and the row blocks that
// makes (ops_gemm::linear_stream_tma_rows; 0: none fit).
static uint32_t tma_rows(uint32_t m, uint32_t k, uint32_t* blocks) {
    const uint32_t steps = (((k + 31) / 32 + 7) / 8 + 1) / 2;
    auto room = [&](uint32_t rows) {
        return (uint64_t)steps * rows * 128 + rows * 1024 + LIN_DEC_MIN_STAGES * 16384 <= LIN_DEC_SPACE;
    };
    uint32_t rows = 8;
    while (rows < m && rows < LIN_DEC_ROWS) rows *= 2;
    while (rows > 8 && !room(rows)) rows /= 2;
    if (!room(rows)) return 0;
    *blocks = (m + rows - 1) / rows;
    return rows;
}

// Whether `linear_stream_tma` takes x from stage images at k inputs (k % 64 == 0, segments of
// whole stages).
static bool takes_images(uint32_t k) { return k % 64 == 0 && ((k / 32 + 7) / 8) % 2 == 0; }

__global__ void lab_read_kernel(const uint4* p, size_t n, uint32_t* sink) {
    uint32_t acc = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint4 v = __ldg(p + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x12345678u) *sink = acc;
}

static double read_ceiling_gbs(cudaStream_t s) {
    const size_t bytes = 2ull << 30;
    void* a;
    CK(cudaMalloc(&a, bytes));
    CK(cudaMemset(a, 0x3C, bytes));
    uint32_t* sink;
    CK(cudaMalloc(&sink, 4));
    const double ms = time_graph(s, [&](cudaStream_t st) { lab_read_kernel<<<132 * 8, 512, 0, st>>>((const uint4*)a, bytes / 16, sink); }, 7);
    CK(cudaFree(a));
    CK(cudaFree(sink));
    return bytes / ms / 1e6;
}
