// RMSNorm over the f32 residual stream, plain or fused with the residual add. CPU twins:
// metrale-gpu-runtime/src/cpu/kernels/norm.rs.
//
// Launch: one block per row, a multiple of 32 threads (the launcher uses 512, `NORM_THREADS` in
// ops_rows.rs: one 8-wide vector a thread for a 4096-wide row).
// out = bf16(x * s * w') with s = 1 / sqrt(mean(x^2) + eps) and w' = w, or 1 + w when
// unit_offset != 0, all in f32. The sum of squares is reduced in an order fixed by the block
// size, so results are deterministic and independent of `rows`.
#include "common.cuh"

// Sum of squares of one f32 row; every thread of the block gets the result.
MT_DEVICE float row_sumsq(const float* x, uint32_t cols, bool vec, float* scratch) {
    float ss = 0.0f;
    if (vec) {
        for (uint32_t v = threadIdx.x; v < cols / 4; v += blockDim.x) {
            const float4 a = *reinterpret_cast<const float4*>(x + 4 * v);
            ss += a.x * a.x;
            ss += a.y * a.y;
            ss += a.z * a.z;
            ss += a.w * a.w;
        }
    } else {
        for (uint32_t i = threadIdx.x; i < cols; i += blockDim.x) ss += x[i] * x[i];
    }
    return block_sum(ss, scratch);
}

// Columns 8v..8v+7 of the normalized row from x's (xv) and w's (wraw) eight, written to `out`
// and/or the stage images.
MT_DEVICE void normalize8(bf16* out, const float (&xv)[8], uint4 wraw, uint32_t v, uint32_t cols, float s,
                          bool unit, unsigned char* img, uint32_t row) {
    float wf[8];
    unpack8(wraw, wf);
    float o[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) o[j] = xv[j] * s * (unit ? 1.0f + wf[j] : wf[j]);
    const uint4 p = pack8(o);
    if (out != nullptr) store16(out + 8 * v, p);
    if (img != nullptr) store_k32_unit(img, row, v / 4, v % 4, ((cols + 31) / 32 + 1) / 2, p);
}

// out = bf16(x * s * w'), 8 columns per thread step on the vector path; with `img`, also (or,
// with a null `out`, only) row `row` of `linear_tma`'s stage images (kernels/common.cuh;
// vector path only).
MT_DEVICE void normalize_row(bf16* out, const float* x, const bf16* w, uint32_t cols, float s,
                             bool unit, bool vec, unsigned char* img = nullptr, uint32_t row = 0) {
    if (vec) {
        for (uint32_t v = threadIdx.x; v < cols / 8; v += blockDim.x) {
            const float4 a = *reinterpret_cast<const float4*>(x + 8 * v);
            const float4 b = *reinterpret_cast<const float4*>(x + 8 * v + 4);
            const float xv[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
            normalize8(out, xv, load16(w + 8 * v), v, cols, s, unit, img, row);
        }
    } else {
        for (uint32_t i = threadIdx.x; i < cols; i += blockDim.x)
            out[i] = f2bf(x[i] * s * norm_weight(w[i], unit));
    }
}

// rms_norm(out: bf16 [rows, cols], x: f32 [rows, cols], w: bf16 [cols], rows, cols, eps,
// unit_offset).
extern "C" __global__ void rms_norm(RMS_NORM_PARAMS) {
    __shared__ float scratch[32];
    pdl_enter(rows);  // launched as a programmatic dependent (common.cuh)
    const uint32_t r = blockIdx.x;
    if (r >= rows) return;
    const float* xr = x + (size_t)r * cols;
    bf16* o = out + (size_t)r * cols;
    const bool vec = cols % 8 == 0 && aligned16(xr) && aligned16(o) && aligned16(w);
    const float ss = row_sumsq(xr, cols, vec, scratch);
    const float s = 1.0f / sqrtf(ss / (float)cols + eps);
    normalize_row(o, xr, w, cols, s, unit_offset != 0, vec);
}

// Columns 8v..8v+7 of the residual row `xr` plus the delta row `d`, stored back and left in
// `x`, their squares added to `ss` in `row_sumsq`'s float4 order (a, then b).
MT_DEVICE void add8(float* xr, const bf16* d, uint32_t v, float (&x)[8], float& ss) {
    float4 a = *reinterpret_cast<const float4*>(xr + 8 * v);
    float4 b = *reinterpret_cast<const float4*>(xr + 8 * v + 4);
    float df[8];
    unpack8(load16(d + 8 * v), df);
    a.x += df[0]; a.y += df[1]; a.z += df[2]; a.w += df[3];
    b.x += df[4]; b.y += df[5]; b.z += df[6]; b.w += df[7];
    *reinterpret_cast<float4*>(xr + 8 * v) = a;
    *reinterpret_cast<float4*>(xr + 8 * v + 4) = b;
    ss += a.x * a.x; ss += a.y * a.y; ss += a.z * a.z; ss += a.w * a.w;
    ss += b.x * b.x; ss += b.y * b.y; ss += b.z * b.z; ss += b.w * b.w;
    x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w;
    x[4] = b.x; x[5] = b.y; x[6] = b.z; x[7] = b.w;
}

// add_rms_norm's body; with `img`, the normalized row also goes to the stage images.
// `regs`: `wv` holds w's vectors threadIdx.x + j * blockDim.x (j < NORM_REG_VECS), loaded before
// the wait, and every vector of the row is one of them (the aligned path): the row then stays in
// registers and the normalize step reads nothing, with the same arithmetic in the same order.
#define NORM_REG_VECS 4
MT_DEVICE void add_rms_norm_row(float* residual, const bf16* delta, const bf16* w, bf16* out, unsigned char* img,
                                uint32_t rows, uint32_t cols, float eps, uint32_t unit_offset,
                                const uint4 (&wv)[NORM_REG_VECS], bool regs) {
    __shared__ float scratch[32];
    const uint32_t r = blockIdx.x;
    if (r >= rows) return;
    if (regs) {  // the caller checked the aligned path and cols / 8 <= NORM_REG_VECS * blockDim.x
        float* xr = residual + (size_t)r * cols;
        const bf16* d = delta + (size_t)r * cols;
        bf16* o = out != nullptr ? out + (size_t)r * cols : nullptr;  // null: only the images
        float xs[NORM_REG_VECS][8];
        float ss = 0.0f;
#pragma unroll
        for (int j = 0; j < NORM_REG_VECS; ++j) {
            const uint32_t v = threadIdx.x + j * blockDim.x;
            if (v >= cols / 8) break;
            add8(xr, d, v, xs[j], ss);
        }
        ss = block_sum(ss, scratch);
        const float s = 1.0f / sqrtf(ss / (float)cols + eps);
#pragma unroll
        for (int j = 0; j < NORM_REG_VECS; ++j) {
            const uint32_t v = threadIdx.x + j * blockDim.x;
            if (v >= cols / 8) break;
            normalize8(o, xs[j], wv[j], v, cols, s, unit_offset != 0, img, r);
        }
        return;
    }
    float* xr = residual + (size_t)r * cols;
    const bf16* d = delta + (size_t)r * cols;
    bf16* o = out + (size_t)r * cols;
    const bool vec = cols % 8 == 0 && aligned16(xr) && aligned16(d) && aligned16(o) && aligned16(w);
    if (img != nullptr && !vec) {  // the launcher stages only aligned rows of 8k columns
        mt_fault(MT_KERNEL_ADD_RMS_NORM_STAGED, MT_FAULT_ALIGNMENT);
        return;
    }
    float ss = 0.0f;
    if (vec) {
        for (uint32_t v = threadIdx.x; v < cols / 8; v += blockDim.x) {
            float x8[8];
            add8(xr, d, v, x8, ss);
        }
    } else {
        for (uint32_t i = threadIdx.x; i < cols; i += blockDim.x) {
            const float v = xr[i] + bf2f(d[i]);
            xr[i] = v;
            ss += v * v;
        }
    }
    ss = block_sum(ss, scratch);
    const float s = 1.0f / sqrtf(ss / (float)cols + eps);
    normalize_row(o, xr, w, cols, s, unit_offset != 0, vec, img, r);
}

// The norm weight's vectors of this thread into `wv`, before the wait (no kernel writes a
// weight), when the row is on the aligned path and fits NORM_REG_VECS vectors a thread (every
// row's operands are aligned when the bases are and cols % 8 == 0). Whether it did.
MT_DEVICE bool add_rms_norm_preload(uint4 (&wv)[NORM_REG_VECS], const float* residual, const bf16* delta,
                                    const bf16* w, const bf16* out, uint32_t cols) {
    const bool vec = cols % 8 == 0 && aligned16(residual) && aligned16(delta) && aligned16(out) && aligned16(w);
    if (!vec || cols / 8 > NORM_REG_VECS * blockDim.x) return false;
#pragma unroll
    for (int j = 0; j < NORM_REG_VECS; ++j) {
        const uint32_t v = threadIdx.x + j * blockDim.x;
        wv[j] = v < cols / 8 ? load16(w + 8 * v) : make_uint4(0, 0, 0, 0);
    }
    return true;
}

// add_rms_norm(residual: f32 [rows, cols] (in/out), delta: bf16 [rows, cols], w: bf16 [cols],
// out: bf16 [rows, cols], rows, cols, eps, unit_offset): residual += delta, then
// out = rms_norm(residual). Each thread rereads only the residual elements it wrote itself.
extern "C" __global__ void add_rms_norm(ADD_RMS_NORM_PARAMS) {
    uint4 wv[NORM_REG_VECS];
    const bool regs = add_rms_norm_preload(wv, residual, delta, w, out, cols);
    pdl_enter(rows);  // launched as a programmatic dependent (common.cuh)
    add_rms_norm_row(residual, delta, w, out, nullptr, rows, cols, eps, unit_offset, wv, regs);
}

// add_rms_norm_staged(residual, delta, w, out, img: stage images of [rows, cols], rows, cols,
// eps, unit_offset): `add_rms_norm`, the normalized rows written to `out` and also as
// `linear_tma`'s stage images (kernels/common.cuh), so the projection after it reads them
// without `permute_k32_tiles` (prefill sizes) or copies its segments of them whole
// (`linear_stream_tma`, decode sizes). Image rows past `rows` (and k past cols, when
// cols % 64 != 0) are not written: the launcher stages only cols % 64 == 0 with 16-byte aligned
// operands.
extern "C" __global__ void add_rms_norm_staged(ADD_RMS_NORM_STAGED_PARAMS) {
    uint4 wv[NORM_REG_VECS];
    const bool regs = add_rms_norm_preload(wv, residual, delta, w, out, cols);
    pdl_enter(rows);  // launched as a programmatic dependent, like `add_rms_norm`
    add_rms_norm_row(residual, delta, w, out, reinterpret_cast<unsigned char*>(img), rows, cols, eps,
                     unit_offset, wv, regs);
}
