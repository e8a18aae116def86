// What the labs share: CK (exit on a CUDA error, naming the call) and fill_bf16 (uniform values
// in [-scale, scale) from a hash of the index and seed).
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CK(x)                                                                                   \
    do {                                                                                        \
        cudaError_t e_ = (x);                                                                   \
        if (e_ != cudaSuccess) {                                                                \
            printf("CUDA error %s at %s:%d: %s\n", cudaGetErrorString(e_), __FILE__, __LINE__, #x); \
            exit(1);                                                                            \
        }                                                                                       \
    } while (0)

__global__ void fill_bf16(bf16* p, size_t n, uint64_t seed, float scale) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint64_t h = (i + 1) * 0x9E3779B97F4A7C15ull ^ (seed * 0xD1B54A32D192ED03ull);
        h ^= h >> 31;
        h *= 0xBF58476D1CE4E5B9ull;
        h ^= h >> 29;
        const float u = (float)(h >> 40) / (float)(1ull << 24);  // [0, 1)
        p[i] = __float2bfloat16_rn((2.0f * u - 1.0f) * scale);
    }
}
