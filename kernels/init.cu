// Reproducible pseudo-random fills from a counter-based hash. CPU twin:
// metrale-gpu-runtime/src/cpu/kernels/init.rs. CPU and CUDA agree bit for bit: the hash is
// integer arithmetic, the 24-bit fraction and 2u - 1 are exact in f32, and the two remaining
// roundings (* scale, + offset) are explicit round-to-nearest operations that the compiler may
// not fuse into an FMA.
//
// Launch: any 1-D grid; each thread strides over the buffer.
#include "common.cuh"

MT_DEVICE uint64_t splitmix(uint64_t index, uint64_t seed) {
    uint64_t z = (index * 0x9E3779B97F4A7C15ull) ^ (seed * 0xD1B54A32D192ED03ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// fill_uniform_bf16(out: bf16 [n], n: u64, seed: u64, offset: f32, scale: f32):
// out[i] = offset + uniform(i, seed, scale), uniform in [-scale, scale).
extern "C" __global__ void fill_uniform_bf16(FILL_UNIFORM_BF16_PARAMS) {
    const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float u = (float)(uint32_t)(splitmix(i, seed) >> 40) * (1.0f / 16777216.0f);
        const float centred = __fsub_rn(__fmul_rn(2.0f, u), 1.0f);
        out[i] = f2bf(__fadd_rn(offset, __fmul_rn(centred, scale)));
    }
}
