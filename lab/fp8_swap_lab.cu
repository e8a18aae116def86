// FP8 swap lab: `linear_stream_fp8` at m <= 16, whose launches of the checkpoints' shapes run
// `linear_fp8_swapped` (the weight as the MMA's A operand, units of 16 weight rows), against the
// same kernel's direct path with the weight as the B operand (`linear_direct_impl`, units of 8
// weight rows, x and zeros moved into A's registers every chunk), the path it replaced there.
// Each output is the same dot product over the same k sets per MMA, transposed: the lab checks
// the bits agree (poisoned outputs) and times both per Qwen3-8B projection (CUDA graphs of 20
// launches, the weight rotated past L2). Build: nvcc as lab/build.sh does.
#include "../kernels/gemm.cu"

#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <vector>

#include "lab_util.cuh"

// The direct path with the weight as the MMA's B operand, for every m.
__global__ void __launch_bounds__(LIN_STREAM_WARPS * 32, 2) lab_fp8_b_operand(LINEAR_FP8_PARAMS) {
    const DirectWFp8<FP8_BLOCK / LIN_KC> wf{w, scales, scale_row_shift, (k + FP8_BLOCK - 1) / FP8_BLOCK};
    linear_direct_dispatch<bf16, LIN_FP8_B, LIN_FP8_B_RB>(out, x, wf, m, n, k, MT_KERNEL_LINEAR_STREAM_FP8);
}

// `fp8_swap_lab [N]`: every projection, or only those of N output columns (one launch of each
// kernel first, for a profiler: `ncu -k regex:linear_stream_fp8 -c 1 fp8_swap_lab 24576`).
int main(int argc, char** argv) {
    const uint32_t shapes[][2] = {{6144, 4096}, {4096, 4096}, {24576, 4096}, {4096, 12288}};
    const uint32_t only = argc > 1 ? (uint32_t)atoi(argv[1]) : 0;
    const uint32_t ms[] = {1, 4, 8, 16};
    const int copies = 4, grid = 264;
    cudaStream_t s;
    CK(cudaStreamCreate(&s));
    bool all_equal = true;
    for (auto& sh : shapes) {
        if (only != 0 && sh[0] != only) continue;
        const uint32_t n = sh[0], k = sh[1], kb = (k + 127) / 128;
        const size_t wbytes = (size_t)n * k, sbytes = (size_t)((n + 127) / 128) * kb;
        uint8_t* w;
        float* sc;
        bf16 *x, *o1, *o2;
        CK(cudaMalloc(&w, wbytes * copies));
        CK(cudaMalloc(&sc, sbytes * 4 * copies));
        CK(cudaMalloc(&x, (size_t)16 * k * 2));
        CK(cudaMalloc(&o1, (size_t)16 * n * 2));
        CK(cudaMalloc(&o2, (size_t)16 * n * 2));
        fill_u8<<<1024, 256>>>(w, wbytes * copies, n + k);
        fill_scales<<<64, 256>>>(sc, sbytes * copies, n);
        fill_bf16<<<256, 256>>>(x, (size_t)16 * k, 7, 1.0f);
        CK(cudaDeviceSynchronize());
        for (uint32_t m : ms) {
            CK(cudaMemset(o1, 0xFF, (size_t)16 * n * 2));
            CK(cudaMemset(o2, 0xFE, (size_t)16 * n * 2));
            uint32_t shift = 7;
            linear_stream_fp8<<<grid, 256, 0, s>>>(o1, x, w, sc, m, n, k, shift);
            lab_fp8_b_operand<<<grid, 256, 0, s>>>(o2, x, w, sc, m, n, k, shift);
            CK(cudaStreamSynchronize(s));
            std::vector<uint16_t> h1((size_t)m * n), h2((size_t)m * n);
            CK(cudaMemcpy(h1.data(), o1, h1.size() * 2, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(h2.data(), o2, h2.size() * 2, cudaMemcpyDeviceToHost));
            size_t diff = 0;
            for (size_t i = 0; i < h1.size(); ++i) diff += h1[i] != h2[i];
            all_equal &= diff == 0;
            auto rec = [&](bool swap) {
                return [&, swap](cudaStream_t st) {
                    for (int it = 0; it < 20; ++it) {
                        const int c = it % copies;
                        if (swap)
                            lab_fp8_b_operand<<<grid, 256, 0, st>>>(o2, x, w + c * wbytes, sc + c * sbytes, m, n, k, shift);
                        else
                            linear_stream_fp8<<<grid, 256, 0, st>>>(o1, x, w + c * wbytes, sc + c * sbytes, m, n, k,
                                                                     shift);
                    }
                };
            };
            const double t1 = time_graph(s, rec(false), 10) * 1000.0 / 20, t2 = time_graph(s, rec(true), 10) * 1000.0 / 20;
            printf("n=%5u k=%5u m=%u: %zu of %zu outputs differ; linear_stream_fp8 %.2f us (%.2f TB/s), weight as B "
                   "%.2f us (%.2f TB/s)\n",
                   n, k, m, diff, h1.size(), t1, wbytes / t1 / 1e6, t2, wbytes / t2 / 1e6);
        }
        CK(cudaFree(w));
        CK(cudaFree(sc));
        CK(cudaFree(x));
        CK(cudaFree(o1));
        CK(cudaFree(o2));
    }
    printf(all_equal ? "bitwise: equal everywhere\n" : "bitwise: DIFFERENT\n");
    return all_equal ? 0 : 1;
}
