// What the labs share: CK (exit on a CUDA error, naming the call), fill_bf16 (uniform values
// in [-scale, scale) from a hash of the index and seed), fill_u8 and fill_scales (a block-FP8
// weight's bytes and scales), launch_ex (a launch, optionally as a
// programmatic dependent) and time_graph (the median time of a captured graph's replay).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

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

// Random e4m3 bytes (no NaN codes) from a hash of the index and seed.
__global__ void fill_u8(uint8_t* p, size_t n, uint64_t seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint64_t h = (i + 1) * 0x9E3779B97F4A7C15ull ^ (seed * 0xD1B54A32D192ED03ull);
        h ^= h >> 29;
        h *= 0xBF58476D1CE4E5B9ull;
        h ^= h >> 32;
        uint8_t v = (uint8_t)h;
        if ((v & 0x7F) == 0x7F) v ^= 1;  // no NaN codes
        p[i] = v;
    }
}

// Block scales in [0.0005, 0.001) from a hash of the index and seed.
__global__ void fill_scales(float* p, size_t n, uint64_t seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        p[i] = 0.0005f * (1.0f + (float)(((i + 1) * 2654435761ull ^ seed) % 1000) / 1000.0f);
}

static double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

// Launch `fn` with `args`, as a programmatic dependent when `pdl`.
static void launch_ex(const void* fn, dim3 grid, dim3 block, int smem, bool pdl, cudaStream_t s, void** args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = s;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = pdl ? attr : nullptr;
    cfg.numAttrs = pdl ? 1 : 0;
    CK(cudaLaunchKernelExC(&cfg, fn, args));
}

// Median ms of one replay of a graph made by `record(stream)`.
static double time_graph(cudaStream_t s, const std::function<void(cudaStream_t)>& record, int iters) {
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    record(s);
    CK(cudaStreamEndCapture(s, &g));
    CK(cudaGraphInstantiate(&ge, g, 0));
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    std::vector<double> t;
    for (int i = 0; i < iters + 2; ++i) {
        CK(cudaEventRecord(a, s));
        CK(cudaGraphLaunch(ge, s));
        CK(cudaEventRecord(b, s));
        CK(cudaEventSynchronize(b));
        float ms;
        CK(cudaEventElapsedTime(&ms, a, b));
        if (i >= 2) t.push_back(ms);
    }
    CK(cudaGetLastError());
    CK(cudaGraphExecDestroy(ge));
    CK(cudaGraphDestroy(g));
    CK(cudaEventDestroy(a));
    CK(cudaEventDestroy(b));
    return median(t);
}

// An e4m3 byte's value (the NaN codes, which the fills never draw, read as 480).
static double e4m3_value(uint8_t b) {
    const int s = b >> 7, e = (b >> 3) & 15, mant = b & 7;
    const double v = e == 0 ? std::ldexp(mant / 8.0, -6) : std::ldexp(1.0 + mant / 8.0, e - 7);
    return s ? -v : v;
}

static double bf16_value(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// The exact product of rows 0..m of bf16 x [m, k] with a block-FP8 weight (bytes w [n, k], f32
// scales s [n / 128][k / 128]), over the first 256 output columns, and each row's largest
// magnitude there: what the FP8 labs measure their kernels' errors against.
struct Fp8Exact {
    uint32_t cols;
    std::vector<double> ref;  // [m][cols]
    std::vector<double> big;  // [m]
};

static Fp8Exact fp8_exact(const std::vector<uint8_t>& w, const std::vector<float>& s, const std::vector<uint16_t>& x,
                          uint32_t m, uint32_t n, uint32_t k) {
    double e4m3[256];
    for (int b = 0; b < 256; ++b) e4m3[b] = e4m3_value((uint8_t)b);
    const uint32_t kb = (k + 127) / 128;
    Fp8Exact r{std::min(256u, n), {}, std::vector<double>(m, 0.0)};
    r.ref.resize((size_t)m * r.cols);
    for (uint32_t row = 0; row < m; ++row)
        for (uint32_t c = 0; c < r.cols; ++c) {
            double acc = 0;
            for (uint32_t i = 0; i < k; ++i)
                acc += e4m3[w[(size_t)c * k + i]] * s[(c >> 7) * kb + i / 128] * bf16_value(x[(size_t)row * k + i]);
            r.ref[(size_t)row * r.cols + c] = acc;
            r.big[row] = std::max(r.big[row], std::fabs(acc));
        }
    return r;
}

// The largest error of `got(row, col)` against `r`, relative to the row's largest output.
template <typename Got>
static double fp8_max_error(const Fp8Exact& r, Got got) {
    double e = 0;
    for (size_t row = 0; row < r.big.size(); ++row)
        for (uint32_t c = 0; c < r.cols; ++c)
            e = std::max(e, std::fabs(got(row, c) - r.ref[row * r.cols + c]) / r.big[row]);
    return e;
}
