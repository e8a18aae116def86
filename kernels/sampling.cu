// Greedy argmax over f32 logits. CPU twin: metrale-gpu-runtime/src/cpu/kernels/sampling.rs.
//
// Launch: one block per row, a multiple of 32 threads up to 1024 (the launcher uses 1024).
// The result is the lowest index of the row's maximum; NaN never wins (an all-NaN row gives 0),
// exactly as the CPU twin. The comparison is a total order on (value, index), so the result
// does not depend on the reduction's shape.
#include "common.cuh"

struct Best {
    float v;
    uint32_t i;
};

// Whether `a` beats `b`: a number beats NaN; a larger number wins; ties go to the lower index.
MT_DEVICE bool beats(Best a, Best b) {
    const bool an = isnan(a.v), bn = isnan(b.v);
    if (an != bn) return bn;
    if (!an && a.v != b.v) return a.v > b.v;
    return a.i < b.i;
}

MT_DEVICE Best warp_best(Best b) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        Best other;
        other.v = __shfl_xor_sync(0xffffffffu, b.v, o);
        other.i = __shfl_xor_sync(0xffffffffu, b.i, o);
        if (beats(other, b)) b = other;
    }
    return b;
}

// argmax(out: u32 [rows], logits: f32 [rows, vocab], rows, vocab).
extern "C" __global__ void argmax(ARGMAX_PARAMS) {
    pdl_wait();  // a programmatic dependent (ops): the kernel ahead has finished
    pdl_trigger();
    __shared__ float sv[32];
    __shared__ uint32_t si[32];
    const uint32_t r = blockIdx.x;
    if (r >= rows) return;
    const float* x = logits + (size_t)r * vocab;
    Best best;
    best.v = __int_as_float(0x7fc00000);
    best.i = 0xFFFFFFFFu;
    if (vocab % 4 == 0 && aligned16(x)) {
        for (uint32_t v = threadIdx.x; v < vocab / 4; v += blockDim.x) {
            const float4 a = *reinterpret_cast<const float4*>(x + 4 * v);
            const float e[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const Best c = {e[j], 4 * v + j};
                if (beats(c, best)) best = c;
            }
        }
    } else {
        for (uint32_t i = threadIdx.x; i < vocab; i += blockDim.x) {
            const Best c = {x[i], i};
            if (beats(c, best)) best = c;
        }
    }
    best = warp_best(best);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
        sv[warp] = best.v;
        si[warp] = best.i;
    }
    __syncthreads();
    if (warp == 0) {
        const int warps = (blockDim.x + 31) >> 5;
        Best b;
        b.v = lane < warps ? sv[lane] : __int_as_float(0x7fc00000);
        b.i = lane < warps ? si[lane] : 0xFFFFFFFFu;
        b = warp_best(b);
        if (lane == 0) out[r] = b.i == 0xFFFFFFFFu ? 0u : b.i;
    }
}
