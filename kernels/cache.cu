// Writing a step's keys and values into the paged KV cache. CPU twin:
// metrale-gpu-runtime/src/cpu/kernels/cache.rs.
//
// Launch: one block per row (any block size). Cache layout per layer:
// [num_slots, num_kv_heads, head_dim] bf16. A slot of u32::MAX is a padding row and writes
// nothing; a slot past `num_slots` writes nothing and reports an INDEX fault, k or v not
// fitting the row a SHAPE fault (the CPU twin fails both launches). With kv_fp8 the pools hold
// e4m3 bytes, each kv_e4m3(value, k_scale or v_scale) (kv_fp8.cuh).
#include "common.cuh"
#include "kv_fp8.cuh"

// kv_store(k_cache, v_cache: bf16 [num_slots, num_kv_heads, head_dim], qkv: bf16 [rows,
// row_stride], slot_mapping: u32 [rows], rows, row_stride, k_offset, v_offset, num_kv_heads,
// head_dim, num_slots).
extern "C" __global__ void kv_store(KV_STORE_PARAMS) {
    // A programmatic dependent (ops): the kernel ahead has finished. The attention after it
    // starts early at one or two rows only (pdl_enter_store).
    pdl_enter_store(rows);
    const uint32_t r = blockIdx.x;
    if (r >= rows) return;
    const uint32_t slot = slot_mapping[r];
    if (slot == 0xFFFFFFFFu) return;
    if (slot >= num_slots) {
        mt_fault(MT_KERNEL_KV_STORE, MT_FAULT_INDEX);
        return;
    }
    const uint32_t width = num_kv_heads * head_dim;
    if (k_offset + width > row_stride || v_offset + width > row_stride) {
        mt_fault(MT_KERNEL_KV_STORE, MT_FAULT_SHAPE);
        return;
    }
    const bf16* ks = qkv + (size_t)r * row_stride + k_offset;
    const bf16* vs = qkv + (size_t)r * row_stride + v_offset;
    if (kv_fp8 != 0) {
        uint8_t* kd = reinterpret_cast<uint8_t*>(k_cache) + (size_t)slot * width;
        uint8_t* vd = reinterpret_cast<uint8_t*>(v_cache) + (size_t)slot * width;
        const KvScale kq = kv_scale(k_scale), vq = kv_scale(v_scale);
        // Eight elements a thread and iteration: a byte loop's stores may alias its loads, so
        // its iterations ran one after another, a memory latency each.
        if (width % 8 == 0 && aligned16(ks) && aligned16(vs) && aligned8(kd) && aligned8(vd)) {
            for (uint32_t v = threadIdx.x; v < width / 8; v += blockDim.x) {
                const uint4 a = load16(ks + 8 * v);
                const uint4 b = load16(vs + 8 * v);
                *reinterpret_cast<uint2*>(kd + 8 * v) = kv_e4m3x8(a, kq);
                *reinterpret_cast<uint2*>(vd + 8 * v) = kv_e4m3x8(b, vq);
            }
        } else {
            for (uint32_t i = threadIdx.x; i < width; i += blockDim.x) {
                kd[i] = kv_e4m3(bf2f(ks[i]), kq);
                vd[i] = kv_e4m3(bf2f(vs[i]), vq);
            }
        }
        return;
    }
    bf16* kd = k_cache + (size_t)slot * width;
    bf16* vd = v_cache + (size_t)slot * width;
    if (width % 8 == 0 && aligned16(ks) && aligned16(vs) && aligned16(kd) && aligned16(vd)) {
        for (uint32_t v = threadIdx.x; v < width / 8; v += blockDim.x) {
            const uint4 a = load16(ks + 8 * v);
            const uint4 b = load16(vs + 8 * v);
            store16(kd + 8 * v, a);
            store16(vd + 8 * v, b);
        }
    } else {
        for (uint32_t i = threadIdx.x; i < width; i += blockDim.x) {
            kd[i] = ks[i];
            vd[i] = vs[i];
        }
    }
}
