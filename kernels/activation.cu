// The SwiGLU gate. CPU twin: metrale-gpu-runtime/src/cpu/kernels/activation.rs.
//
// Launch: grid (rows, any number of blocks per row), any block size; the blocks of a row split
// its columns (8-wide vectors on the vector path) round-robin. Elementwise, so the geometry
// never changes a result.
#include "common.cuh"

// Columns 8v..8v+7 of silu(gate) * up, rounded to bf16 and packed (16-byte aligned rows).
MT_DEVICE uint4 silu_mul8(const bf16* g, const bf16* u, uint32_t v) {
    return silu_mul_packed8(load16(g + 8 * v), load16(u + 8 * v));
}

// silu_mul(out: bf16 [rows, ffn], gate_up: bf16 [rows, 2 * ffn], rows, ffn):
// out = silu(gate) * up with silu(x) = x / (1 + exp(-x)) in f32.
extern "C" __global__ void silu_mul(SILU_MUL_PARAMS) {
    pdl_enter(rows);  // launched as a programmatic dependent (common.cuh)
    const uint32_t r = blockIdx.x;
    if (r >= rows) return;
    const bf16* g = gate_up + (size_t)r * 2 * ffn;
    const bf16* u = g + ffn;
    bf16* o = out + (size_t)r * ffn;
    const uint32_t first = blockIdx.y * blockDim.x + threadIdx.x, stride = gridDim.y * blockDim.x;
    if (ffn % 8 == 0 && aligned16(g) && aligned16(o)) {
        for (uint32_t v = first; v < ffn / 8; v += stride) store16(o + 8 * v, silu_mul8(g, u, v));
    } else {
        for (uint32_t i = first; i < ffn; i += stride) o[i] = f2bf(siluf_acc(bf2f(g[i])) * bf2f(u[i]));
    }
}

// silu_mul_staged(img: stage images of [rows, ffn], act: bf16 [rows, ffn] or NULL, gate_up: bf16
// [rows, 2 * ffn], rows, ffn): `silu_mul` written as `linear_tma`'s stage images
// (kernels/common.cuh), for the down projection to read without `permute_k32_tiles` (prefill
// sizes) or to bulk-copy (`linear_stream_tma`, decode sizes); and, where `act`
// is given, as rows too (what `linear_stream_tma` reads where it cannot use the images). Image
// rows past `rows` (and k past ffn, when ffn % 64 != 0) are not written: the launcher stages only
// ffn % 64 == 0. Needs ffn % 8 == 0 (else a SHAPE fault) and 16-byte aligned gate_up and act
// (else an ALIGNMENT fault); same grid as `silu_mul`.
extern "C" __global__ void silu_mul_staged(SILU_MUL_STAGED_PARAMS) {
    pdl_enter(rows);  // launched as a programmatic dependent, like `silu_mul`
    const uint32_t r = blockIdx.x;
    if (r >= rows) return;
    if (ffn % 8 != 0) {
        mt_fault(MT_KERNEL_SILU_MUL_STAGED, MT_FAULT_SHAPE);
        return;
    }
    const bf16* g = gate_up + (size_t)r * 2 * ffn;
    const bf16* u = g + ffn;
    if (!aligned16(g) || (act != nullptr && !aligned16(act))) {
        mt_fault(MT_KERNEL_SILU_MUL_STAGED, MT_FAULT_ALIGNMENT);
        return;
    }
    unsigned char* im = reinterpret_cast<unsigned char*>(img);
    bf16* o = act != nullptr ? act + (size_t)r * ffn : nullptr;
    const uint32_t steps = ((ffn + 31) / 32 + 1) / 2;
    const uint32_t first = blockIdx.y * blockDim.x + threadIdx.x, stride = gridDim.y * blockDim.x;
    for (uint32_t v = first; v < ffn / 8; v += stride) {
        const uint4 h = silu_mul8(g, u, v);
        store_k32_unit(im, r, v / 4, v % 4, steps, h);
        if (o != nullptr) store16(o + 8 * v, h);
    }
}
