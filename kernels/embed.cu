// Token embedding gather, row gather, and f32 values rounded to bf16. CPU twins:
// metrale-gpu-runtime/src/cpu/kernels/embed.rs.
//
// Launch: the gathers one block per output row (any block size that is a multiple of 32);
// round_bf16 any 1-D grid, each thread striding over the elements.
// An id outside the table fills its row with NaN and reports an INDEX fault (`mt_fault`); the
// CPU twin fails the launch.
#include "common.cuh"

// embedding_gather(out: f32 [rows, hidden], table: bf16 [table_rows, hidden], ids: u32 [rows],
// rows, hidden, vocab, row_start, table_rows): out[r] = table[ids[r] - row_start] widened to
// f32 where row_start <= ids[r] < row_start + table_rows, zeros elsewhere (a
// vocabulary-parallel rank's slice); an id past vocab is a fault.
extern "C" __global__ void embedding_gather(EMBEDDING_GATHER_PARAMS) {
    pdl_wait();  // a programmatic dependent (ops): the kernel ahead has finished
    pdl_trigger();
    const uint32_t r = blockIdx.x;
    if (r >= rows) return;
    float* o = out + (size_t)r * hidden;
    const uint32_t id = ids[r];
    if (id >= vocab) {
        mt_fault(MT_KERNEL_EMBEDDING_GATHER, MT_FAULT_INDEX);
        for (uint32_t i = threadIdx.x; i < hidden; i += blockDim.x) o[i] = __int_as_float(0x7fc00000);
        return;
    }
    if (id < row_start || id - row_start >= table_rows) {
        for (uint32_t i = threadIdx.x; i < hidden; i += blockDim.x) o[i] = 0.0f;
        return;
    }
    const bf16* src = table + (size_t)(id - row_start) * hidden;
    if (hidden % 8 == 0 && aligned16(src) && aligned16(o)) {
        for (uint32_t v = threadIdx.x; v < hidden / 8; v += blockDim.x) {
            float f[8];
            unpack8(load16(src + 8 * v), f);
            store16(o + 8 * v, make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]),
                                          __float_as_uint(f[2]), __float_as_uint(f[3])));
            store16(o + 8 * v + 4, make_uint4(__float_as_uint(f[4]), __float_as_uint(f[5]),
                                              __float_as_uint(f[6]), __float_as_uint(f[7])));
        }
    } else {
        for (uint32_t i = threadIdx.x; i < hidden; i += blockDim.x) o[i] = bf2f(src[i]);
    }
}

// gather_rows(out: bf16 [n, cols], x: bf16 [src_rows, cols], row_ids: u32 [n], n, cols,
// src_rows): out[i] = x[row_ids[i]].
extern "C" __global__ void gather_rows(GATHER_ROWS_PARAMS) {
    pdl_enter(n);  // a programmatic dependent (common.cuh)
    const uint32_t i = blockIdx.x;
    if (i >= n) return;
    bf16* o = out + (size_t)i * cols;
    const uint32_t r = row_ids[i];
    if (r >= src_rows) {
        mt_fault(MT_KERNEL_GATHER_ROWS, MT_FAULT_INDEX);
        for (uint32_t c = threadIdx.x; c < cols; c += blockDim.x) o[c] = bf16_nan();
        return;
    }
    const bf16* src = x + (size_t)r * cols;
    if (cols % 8 == 0 && aligned16(src) && aligned16(o)) {
        for (uint32_t v = threadIdx.x; v < cols / 8; v += blockDim.x) store16(o + 8 * v, load16(src + 8 * v));
    } else {
        for (uint32_t c = threadIdx.x; c < cols; c += blockDim.x) o[c] = src[c];
    }
}

// round_bf16(out: bf16 [n], x: f32 [n], n): out[i] = x[i] rounded to bf16, to nearest even
// (the tensor-parallel all-reduce's f32 sums written as the bf16 activation, rounded once).
// Launched plainly, not as a programmatic dependent: it follows a collective, which does not
// trigger early.
extern "C" __global__ void round_bf16(ROUND_BF16_PARAMS) {
    const uint32_t stride = gridDim.x * blockDim.x;
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) out[i] = f2bf(x[i]);
}
