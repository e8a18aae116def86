// Helpers shared by every kernel family: bf16 conversion, 16-byte vectors of 8 bf16, alignment
// tests and deterministic warp / block reductions.
//
// Invariants:
// - Every reduction here combines values in an order fixed by the thread layout alone, so a
//   kernel built on them gives bitwise the same result run to run.
// - A kernel takes the 16-byte vector path only when every pointer it vectorises is 16-byte
//   aligned and the dimension it strides is a multiple of 8; otherwise it falls back to scalar
//   accesses computing the same function.
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

#include "abi.cuh"  // bf16, the shared constants, the parameter structs' macros, mt_fault

#define MT_DEVICE __device__ __forceinline__

MT_DEVICE bool aligned16(const void* p) {
    return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}
MT_DEVICE bool aligned8(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 7) == 0; }

MT_DEVICE float bf2f(bf16 x) { return __bfloat162float(x); }

MT_DEVICE bf16 f2bf(float x) { return __float2bfloat16_rn(x); }

// A bf16 NaN, for outputs of rows whose inputs were out of range.
MT_DEVICE bf16 bf16_nan() { return __ushort_as_bfloat16((unsigned short)0x7FFF); }

// Eight bf16 held in one 16-byte vector, unpacked to f32.
MT_DEVICE void unpack8(uint4 v, float (&out)[8]) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        out[2 * i] = __uint_as_float(w[i] << 16);
        out[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
    }
}

// Eight f32 rounded to bf16 (nearest even) and packed into one 16-byte vector.
MT_DEVICE uint4 pack8(const float (&in)[8]) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const uint32_t lo = __bfloat16_as_ushort(f2bf(in[2 * i]));
        const uint32_t hi = __bfloat16_as_ushort(f2bf(in[2 * i + 1]));
        w[i] = lo | (hi << 16);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
}

MT_DEVICE uint4 load16(const void* p) { return *reinterpret_cast<const uint4*>(p); }

MT_DEVICE void store16(void* p, uint4 v) { *reinterpret_cast<uint4*>(p) = v; }

// Sum over the 32 lanes of a warp. The xor butterfly leaves bitwise the same value in every lane
// (each step adds a pair in both lanes, and IEEE addition commutes).
MT_DEVICE float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

MT_DEVICE float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over a block of at most 1024 threads (a multiple of 32); every thread gets the result.
// `scratch` holds at least 32 floats. Ends with a barrier, so `scratch` may be reused after it.
MT_DEVICE float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < warps ? scratch[lane] : 0.0f;
    t = warp_sum(t);
    __syncthreads();
    return t;
}

// The stage images `linear_tma` reads x from (`permute_k32_tiles`, kernels/gemm.cu, and the
// `_staged` producers): byte offset of 16-byte unit t (0..3, `k32_pairs` order) of chunk c (32
// k) of row `row`, for `steps` two-chunk stages per 128-row tile.
MT_DEVICE size_t img_offset(uint32_t row, uint32_t c, uint32_t t, uint32_t steps) {
    const uint32_t r = row % 128, cc = c % 2;
    return ((size_t)(row / 128) * steps + c / 2) * 16384 + r * 128 + (((cc * 4 + t) ^ (r % 8)) << 4);
}

// Chunk c of row `row` (v[u]: k 8u..8u+7 of the chunk) into the stage images: unit t holds the
// chunk's 4-byte pairs t, t + 4, t + 8, t + 12.
MT_DEVICE void store_k32_pairs(unsigned char* img, uint32_t row, uint32_t c, uint32_t steps, const uint4 (&v)[4]) {
    const uint4 o[4] = {make_uint4(v[0].x, v[1].x, v[2].x, v[3].x), make_uint4(v[0].y, v[1].y, v[2].y, v[3].y),
                        make_uint4(v[0].z, v[1].z, v[2].z, v[3].z), make_uint4(v[0].w, v[1].w, v[2].w, v[3].w)};
#pragma unroll
    for (uint32_t t = 0; t < 4; ++t) *reinterpret_cast<uint4*>(img + img_offset(row, c, t, steps)) = o[t];
}

// Byte offset of element `col` of row `row` in the stage images: its 4-byte pair p (k 2p, 2p + 1
// of its chunk) sits in unit p % 4 at position p / 4.
MT_DEVICE size_t img_elem_offset(uint32_t row, uint32_t col, uint32_t steps) {
    const uint32_t p = (col % 32) / 2;
    return img_offset(row, col / 32, p % 4, steps) + (p / 4) * 4 + (col % 2) * 2;
}

// Natural unit q (k 8q..8q+7) of chunk c of row `row` into the stage images: its pairs are
// position q of units 0..3.
MT_DEVICE void store_k32_unit(unsigned char* img, uint32_t row, uint32_t c, uint32_t q, uint32_t steps, uint4 v) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (uint32_t t = 0; t < 4; ++t) *reinterpret_cast<uint32_t*>(img + img_offset(row, c, t, steps) + q * 4) = w[t];
}

// 16-byte asynchronous copy global -> shared (cp.async.cg, L2 only); `src_bytes` < 16 zero-fills
// the rest (0: nothing is read, `src` need only be a valid address).
MT_DEVICE void cp_async16(void* dst, const void* src, uint32_t src_bytes) {
    const uint32_t s = (uint32_t)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src), "r"(src_bytes));
}

// `cp_async16` with an L2 eviction policy (`l2_evict_first_policy`): data read once, so the
// lines it brings in go first and what the next kernels will read stays.
MT_DEVICE void cp_async16_hint(void* dst, const void* src, uint32_t src_bytes, uint64_t policy) {
    const uint32_t s = (uint32_t)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(s), "l"(src), "r"(src_bytes),
                 "l"(policy));
}

// An L2 policy under which every access's lines are evicted first.
MT_DEVICE uint64_t l2_evict_first_policy() {
    uint64_t p;
    // Not volatile: the policy is a constant, so the compiler may compute it once for a loop.
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(p));
    return p;
}

// N-byte (4 or 8) asynchronous copy global -> shared address `dst` (cp.async.ca: copies under 16
// bytes go through L1); `src_bytes` < N zero-fills the rest.
template <int N>
MT_DEVICE void cp_async_ca(uint32_t dst, const void* src, uint32_t src_bytes) {
    static_assert(N == 4 || N == 8, "cp.async.ca copies 4, 8 or 16 bytes");
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(dst), "l"(src), "n"(N), "r"(src_bytes));
}

MT_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Wait until at most N of this thread's committed groups are pending.
template <int N>
MT_DEVICE void cp_async_wait() {
    // The clobber keeps the compiler from hoisting shared-memory reads above the wait.
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Bytes of dynamic shared memory the launch gave this block.
MT_DEVICE uint32_t dynamic_smem_bytes() {
    uint32_t n;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(n));
    return n;
}

MT_DEVICE float sigmoidf_acc(float x) { return 1.0f / (1.0f + expf(-x)); }

MT_DEVICE float siluf_acc(float x) { return x / (1.0f + expf(-x)); }

// silu(gate) * up of 8 packed bf16 gate and up values, in f32, rounded to bf16 and packed: the
// SwiGLU's arithmetic wherever it is computed (`silu_mul`, `linear_tma_swiglu`).
MT_DEVICE uint4 silu_mul_packed8(uint4 gate, uint4 up) {
    float gf[8], uf[8], of[8];
    unpack8(gate, gf);
    unpack8(up, uf);
#pragma unroll
    for (int j = 0; j < 8; ++j) of[j] = siluf_acc(gf[j]) * uf[j];
    return pack8(of);
}

// The norm weight as applied: `w`, or `1 + w` for the zero-centred convention.
MT_DEVICE float norm_weight(bf16 w, bool unit_offset) {
    return unit_offset ? 1.0f + bf2f(w) : bf2f(w);
}

// Programmatic dependent launch (sm_90). A kernel launched with the programmatic-serialization
// attribute may start before the kernel ahead of it on the stream has finished; `pdl_wait`
// blocks until that kernel has completed and its memory is visible, so it must come before the
// first access to anything an earlier kernel writes or reads. `pdl_trigger` lets the next
// kernel (if launched with the attribute) start; kernels here call it after their own `pdl_wait`
// (so at most one kernel runs ahead of its wait), except the small kernels ahead of a decode
// projection at 9..64 rows (`pdl_enter`). Both are no-ops in a kernel launched without the
// attribute.
MT_DEVICE void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

MT_DEVICE void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// The entry of the cache store ahead of decode attention (`kv_store`, `qk_norm_rope_kv_store`)
// over `rows` rows: it waits, then, at one or two rows, lets the attention start, whose blocks
// read the step's inputs (item records, block-table entries) before their own wait. At more rows
// it triggers only when it ends: the attention's clusters, placed beside this kernel's many
// blocks, run slower than the time an early start saves.
#define STORE_EARLY_ROWS 2
MT_DEVICE void pdl_enter_store(uint32_t rows) {
    pdl_wait();
    if (rows <= STORE_EARLY_ROWS) pdl_trigger();
}

// The entry of a small kernel ahead of a projection (norms, `silu_mul`, `gather_rows`,
// `gated_rms_norm`) over `rows` rows: at 9..64 rows (where `linear_stream_tma` serves the
// projections) it lets the projection start before it waits, so the projection's first weight
// loads (issued before its own wait) overlap this kernel and the one ahead; elsewhere it waits,
// then triggers. At 1..8 rows an early start lets the narrow projection's persistent blocks take
// the multiprocessors this kernel and the ones ahead still need, which slows the whole step;
// above 64 rows it saves nothing measurable.
MT_DEVICE void pdl_enter(uint32_t rows) {
    const bool early = rows > 8 && rows <= 64;
    if (early) pdl_trigger();
    pdl_wait();
    if (!early) pdl_trigger();
}

// Arrive at the cluster barrier after writing shared memory the cluster's other blocks read once
// they have waited: a release fence restricted to this block's shared memory, then a relaxed
// arrival. (A release arrival compiles to MEMBAR.ALL.GPU, which also waits for every global
// store the thread has in flight; the restricted fence is MEMBAR.ALL.CTA.)
MT_DEVICE void cluster_publish_arrive() {
    asm volatile("fence.release.sync_restrict::shared::cta.cluster;\n" ::: "memory");
    asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
}

// The other half of a cluster barrier: wait until every block of the cluster has arrived
// (acquire: what they published is visible).
MT_DEVICE void cluster_wait() { asm volatile("barrier.cluster.wait.acquire;\n" ::: "memory"); }

// The last cluster barrier of a kernel that read other blocks' shared memory: arrive relaxed
// (the remote reads it must follow have returned their values; a release arrival would also
// wait for the thread's global stores to reach memory, which lengthens the decode GEMM's closing
// phase by about half), then wait.
MT_DEVICE void cluster_leave_barrier() {
    asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
    cluster_wait();
}

// Warpgroup MMA ordering: fence before the first wgmma reading registers or shared memory
// written since, commit the issued ones as a group, wait until none is in flight.
MT_DEVICE void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
MT_DEVICE void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
MT_DEVICE void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
MT_DEVICE void wg_wait1() { asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory"); }
// Pin registers an MMA in flight writes to this point of the program: the compiler moves no
// read or write of them across it (after a wait, their reads stay after the wait).
template <int N>
MT_DEVICE void wg_pin(float (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int M, int N>
MT_DEVICE void wg_pin(uint32_t (&r)[M][N]) {
#pragma unroll
    for (int i = 0; i < M; ++i)
#pragma unroll
        for (int j = 0; j < N; ++j) asm volatile("" : "+r"(r[i][j])::"memory");
}

// The 64 f32 accumulator operands of an m64n128 wgmma, %0 .. %63 (read and written).
#define WG_ACC64_REGS                                                                    \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "             \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "   \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "   \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define WG_ACC4(d, i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define WG_ACC16(d, i) WG_ACC4(d, i), WG_ACC4(d, i + 4), WG_ACC4(d, i + 8), WG_ACC4(d, i + 12)
#define WG_ACC64(d) WG_ACC16(d, 0), WG_ACC16(d, 16), WG_ACC16(d, 32), WG_ACC16(d, 48)

// mbarrier helpers (shared::cta; `bar` a shared-memory address): init with the arrivals a phase
// takes, arrive (release), and wait until the phase of parity `parity` completes (acquire).
MT_DEVICE void mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
MT_DEVICE void mbar_wait(uint32_t bar, uint32_t parity) {
    asm volatile(
        "{\n.reg .pred done;\nWAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT_%=;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}
MT_DEVICE void mbar_arrive(uint32_t bar) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}

// Arrive on `bar` once every cp.async this thread has issued so far has landed (the barrier's
// count includes the arriving threads: .noinc).
MT_DEVICE void cp_async_mbar_arrive(uint32_t bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

// Arrive at `bar` and add `bytes` to the transfer count its phase waits for.
MT_DEVICE void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}\n" ::"r"(bar), "r"(bytes)
                 : "memory");
}

// A bulk copy of `bytes` (a multiple of 16; both addresses 16-byte aligned) global -> shared,
// completing on `bar`'s byte count.
MT_DEVICE void bulk_g2s(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}

// Orders this thread's generic-proxy shared-memory accesses before later async-proxy ones (a
// wgmma's reads, a bulk copy's writes).
MT_DEVICE void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
