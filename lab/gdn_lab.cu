// The delta-rule decode lab: `gated_delta_streamed` against `gated_delta_recurrent` (both compiled
// in from kernels/gdn.cu) on Qwen3.5-9B's linear heads (16 key / 32 value heads of 128): checked
// bitwise (outputs and states) on a step with padding, a slot past the pool and multi-row
// sequences, then timed alone per batch with the state pools rotated past L2, beside the copy
// floor (the states read and written once).
//
// gdn_lab [quick]  (lab/build.sh builds it). quick: the checks and batch 64 only. Timed twice:
// launches alone, and each behind a stand-in for gdn_prepare with both launched as programmatic
// dependents, as a step launches them.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gdn.cu"
#include "lab_util.cuh"

static const uint32_t HK = 16, DK = 128, HV = 32, DV = 128;
static const uint32_t KD = HK * DK, CD = 2 * KD + HV * DV;
static const size_t HEAD_FLOATS = (size_t)DK * DV, SLOT_FLOATS = HV * HEAD_FLOATS;

struct Step {
    float *out, *state, *qk, *gates;
    bf16* conv;
    uint32_t *seq_start, *seq_slot;
    uint32_t rows, num_seqs, num_slots;
};

template <typename T>
static T* upload(const std::vector<T>& v) {
    T* d;
    CK(cudaMalloc(&d, v.size() * sizeof(T)));
    CK(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
    return d;
}

// The step's inputs for sequences of `lens` rows (slot per sequence in `slots`), random.
static Step make_step(const std::vector<uint32_t>& lens, const std::vector<uint32_t>& slots, uint32_t num_slots,
                      uint32_t seed) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    Step st{};
    st.num_seqs = (uint32_t)lens.size();
    st.num_slots = num_slots;
    std::vector<uint32_t> start(1, 0);
    for (uint32_t l : lens) start.push_back(start.back() + l);
    st.rows = start.back();
    std::vector<float> qk((size_t)st.rows * 2 * KD), gates((size_t)st.rows * 2 * HV);
    for (auto& x : qk) x = u(rng) * 0.09f;
    for (uint32_t r = 0; r < st.rows; ++r)
        for (uint32_t j = 0; j < HV; ++j) {
            gates[(size_t)r * 2 * HV + j] = 0.5f + 0.5f * u(rng);
            gates[(size_t)r * 2 * HV + HV + j] = -0.05f * (1.0f + u(rng));
        }
    std::vector<bf16> conv((size_t)st.rows * CD);
    for (auto& x : conv) x = __float2bfloat16_rn(u(rng));
    st.qk = upload(qk);
    st.gates = upload(gates);
    st.conv = upload(conv);
    st.seq_start = upload(start);
    st.seq_slot = upload(slots);
    CK(cudaMalloc(&st.out, (size_t)st.rows * HV * DV * 4));
    CK(cudaMalloc(&st.state, (size_t)num_slots * SLOT_FLOATS * 4));
    std::vector<float> s0((size_t)num_slots * SLOT_FLOATS);
    for (auto& x : s0) x = u(rng);
    CK(cudaMemcpy(st.state, s0.data(), s0.size() * 4, cudaMemcpyHostToDevice));
    return st;
}

static uint32_t g_sms = 132;

// A stand-in for gdn_prepare, the kernel ahead of the rule in a step: a block per row that waits
// for the kernel ahead, lets the next start, and writes one word.
__global__ void stand_in(uint32_t* sink) {
    pdl_wait();
    pdl_trigger();
    if (threadIdx.x == 0) sink[blockIdx.x] = blockIdx.x;
}
static uint32_t* g_sink;
static bool g_pdl = false;

static uint32_t stream_smem(uint32_t bufs) { return GDN_STREAM_BARS + bufs * (uint32_t)HEAD_FLOATS * 4; }

static uint32_t stream_grid(uint32_t bufs, uint32_t items) {
    int per_sm = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, gated_delta_streamed, 32 * DV / 16, stream_smem(bufs)));
    return std::min<uint32_t>(items, per_sm * g_sms);
}

// One launch: bufs 0 = gated_delta_recurrent's grid (2-warp blocks), else the streamed kernel.
static void launch(const Step& st, float* state, uint32_t bufs, cudaStream_t s) {
    if (g_pdl) {
        void* sargs[] = {&g_sink};
        launch_ex((const void*)stand_in, dim3(st.rows), dim3(128), 0, true, s, sargs);
    }
    uint32_t slot_stride = (uint32_t)SLOT_FLOATS, hk = HK, dk = DK, hv = HV, dv = DV;
    float* out = st.out;
    void* args[] = {&out,         &state,        (void*)&st.qk,   (void*)&st.conv, (void*)&st.gates,
                    (void*)&st.seq_start, (void*)&st.seq_slot, (void*)&st.rows, (void*)&st.num_seqs,
                    (void*)&st.num_slots, &slot_stride, &hk, &dk, &hv, &dv};
    if (bufs == 0) {
        launch_ex((const void*)gated_delta_recurrent, dim3(st.num_seqs, HV * (DV / 16 / 2)), dim3(64), 0, g_pdl, s,
                  args);
    } else {
        launch_ex((const void*)gated_delta_streamed, dim3(stream_grid(bufs, st.num_seqs * HV)), dim3(32 * DV / 16),
                  stream_smem(bufs), g_pdl, s, args);
    }
}

static bool check(uint32_t bufs) {
    // 40 sequences: mostly one row, some two or three, two padding, one slot past the pool.
    std::vector<uint32_t> lens, slots;
    const uint32_t num_slots = 48;
    for (uint32_t i = 0; i < 40; ++i) {
        lens.push_back(i % 7 == 3 ? 3 : i % 5 == 1 ? 2 : 1);
        slots.push_back(i == 6 || i == 21 ? GDN_NO_SLOT : i == 30 ? 1000 : (i * 7) % num_slots);
    }
    Step st = make_step(lens, slots, num_slots, 7 + bufs);
    const size_t sb = (size_t)num_slots * SLOT_FLOATS * 4, ob = (size_t)st.rows * HV * DV * 4;
    float* state_b;
    CK(cudaMalloc(&state_b, sb));
    CK(cudaMemcpy(state_b, st.state, sb, cudaMemcpyDeviceToDevice));
    std::vector<float> out_a(ob / 4), out_b(ob / 4), sa(sb / 4), sbv(sb / 4);
    CK(cudaMemset(st.out, 0xFF, ob));
    launch(st, st.state, 0, 0);
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(out_a.data(), st.out, ob, cudaMemcpyDeviceToHost));
    CK(cudaMemset(st.out, 0xFF, ob));
    launch(st, state_b, bufs, 0);
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(out_b.data(), st.out, ob, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(sa.data(), st.state, sb, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(sbv.data(), state_b, sb, cudaMemcpyDeviceToHost));
    size_t od = 0, sd = 0, nan = 0;
    for (size_t i = 0; i < out_a.size(); ++i) {
        od += memcmp(&out_a[i], &out_b[i], 4) != 0;
        nan += out_a[i] != out_a[i];
    }
    for (size_t i = 0; i < sa.size(); ++i) sd += memcmp(&sa[i], &sbv[i], 4) != 0;
    printf("check bufs %u: %zu of %zu outputs differ (%zu NaN, the bad slot's), %zu of %zu state floats differ\n", bufs,
           od, out_a.size(), nan, sd, sa.size());
    return od == 0 && sd == 0;
}

int main(int argc, char** argv) {
    const bool quick = argc > 1 && std::string(argv[1]) == "quick";
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    g_sms = prop.multiProcessorCount;
    for (uint32_t b = 1; b <= 3; ++b)
        CK(cudaFuncSetAttribute(gated_delta_streamed, cudaFuncAttributeMaxDynamicSharedMemorySize, stream_smem(b)));
    bool ok = true;
    for (uint32_t b = 1; b <= 3; ++b) ok &= check(b);
    printf("checks %s\n", ok ? "pass" : "FAIL");
    cudaStream_t stream;
    CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    // Copy rate: one 512 MiB device-to-device copy.
    double copy_gbs;
    {
        const size_t n = 512ull << 20;
        void *a, *b;
        CK(cudaMalloc(&a, n));
        CK(cudaMalloc(&b, n));
        const double ms = time_graph(stream, [&](cudaStream_t s) { CK(cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice, s)); }, 10);
        copy_gbs = 2.0 * n / ms / 1e6;
        CK(cudaFree(a));
        CK(cudaFree(b));
    }
    printf("copy rate %.0f GB/s\n", copy_gbs);
    CK(cudaMalloc(&g_sink, 4096 * 4));
    std::vector<uint32_t> batches = quick ? std::vector<uint32_t>{64} : std::vector<uint32_t>{1, 4, 8, 16, 32, 64, 128};
    for (int pdl = 0; pdl < 2; ++pdl) {
    g_pdl = pdl;
    printf("%s\n", pdl ? "each launch behind a stand-in gdn_prepare, programmatic" : "launches alone");
    printf("%6s %9s %9s %9s %9s %9s\n", "seqs", "floor", "recur", "bufs1", "bufs2", "bufs3");
    for (uint32_t n : batches) {
        // Pools enough that a graph of launches rotates through 256 MiB of states.
        const uint32_t pools = std::max<uint32_t>(1, (uint32_t)((256ull << 20) / (n * SLOT_FLOATS * 4)));
        std::vector<uint32_t> lens(n, 1), slots(n);
        for (uint32_t i = 0; i < n; ++i) slots[i] = i;
        Step st = make_step(lens, slots, n, 11);
        std::vector<float*> states(pools);
        for (auto& p : states) {
            CK(cudaMalloc(&p, (size_t)n * SLOT_FLOATS * 4));
            CK(cudaMemcpy(p, st.state, (size_t)n * SLOT_FLOATS * 4, cudaMemcpyDeviceToDevice));
        }
        const uint32_t launches = std::max<uint32_t>(pools, 8);
        const double floor_us = 2.0 * n * SLOT_FLOATS * 4 / copy_gbs / 1e3;
        printf("%6u %9.1f", n, floor_us);
        for (uint32_t bufs = 0; bufs <= 3; ++bufs) {
            const double ms = time_graph(
                stream,
                [&](cudaStream_t s) {
                    for (uint32_t l = 0; l < launches; ++l) launch(st, states[l % pools], bufs, s);
                },
                20);
            printf(" %9.1f", ms * 1e3 / launches);
        }
        printf("\n");
        for (auto p : states) CK(cudaFree(p));
    }
    }
    return ok ? 0 : 1;
}
