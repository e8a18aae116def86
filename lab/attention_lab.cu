// The decode attention lab: `paged_attention` from two cubins (a baseline and a candidate,
// usually the committed kernel and a working copy of kernels/attention.cu), checked bitwise
// against each other on mixed contexts, block sizes and bad rows (naming the items that differ),
// then timed alone per batch at contexts 385 and 1025 with the KV pools rotated past L2, like
// `gpu_kernels --ignored measure_attention_against_its_kv_floor`.
//
// attention_lab BASE.cubin[:KERNEL] CANDIDATE.cubin[:KERNEL] [quick|onegrid|profile [ROWS [POS]]]
// (lab/build.sh builds it; the cubins come from `cargo xtask kernels`,
// target/kernels/attention.cubin). KERNEL defaults to paged_attention; paged_attention_flat is
// launched as its launcher does (persistent blocks, as many as are resident), or with `onegrid`
// one block per item (the quick checks only), which tells a fault of the loop over items from
// one of an item's arithmetic.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

typedef __nv_bfloat16 bf16;
#include "lab_util.cuh"

struct Shape {
    const char* name;
    uint32_t hq, hkv, d;
    bool gated;
    uint32_t resident;  // clusters of 8 resident at once (ops_attention.rs, ATTENTION_CLUSTERS)
};

static uint32_t padded(uint32_t d) { return d <= 32 ? 32 : d <= 64 ? 64 : d <= 128 ? 128 : 256; }
static uint32_t heads_per_block(uint32_t hq, uint32_t hkv) {
    const uint32_t g = hq / hkv;
    for (uint32_t b = 8; b > 1; --b)
        if (g % b == 0) return b;
    return 1;
}
static uint32_t shared_bytes(uint32_t d, uint32_t hb) {
    const uint32_t dp = padded(d);
    return 4 * 2 * (8 + 2 * 16) * (dp + 8) * 2 + (4 + 2) * hb * dp * 4;
}

// One launch's inputs on the device.
struct Launch {
    bf16 *out, *qkv, *k, *v;
    uint32_t *tables, *row_seq, *pos;
    uint32_t rows, row_stride, q_stride, block_size, max_blocks, num_seqs, num_slots;
};

static uint32_t flat_shared_bytes(uint32_t d, uint32_t hb) {
    const uint32_t dp = padded(d);
    return 4 * (2 * 2 * 16 + 2 * 8) * (dp + 8) * 2 + (4 + 8) * hb * dp * 4;
}

// Lab switch: the flat kernel gets one block per item (no persistence).
static bool g_flat_one_per_item = false;

// A kernel and how it is launched.
struct Kern {
    cudaKernel_t k;
    bool flat;
};

static void launch(const Kern& kern, const Shape& s, const Launch& l, cudaStream_t st) {
    const uint32_t hb = heads_per_block(s.hq, s.hkv);
    const uint32_t items = l.rows * (s.hq / hb);
    uint32_t resident = s.resident, per = 8, smem = shared_bytes(s.d, hb);
    if (kern.flat) {
        smem = flat_shared_bytes(s.d, hb);
        int blocks = 0, sms = 0;
        CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, (const void*)kern.k, 128, smem));
        CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
        resident = g_flat_one_per_item ? items : (uint32_t)(blocks * sms);
        per = 1;
    }
    const uint32_t waves = std::max(1u, (items + resident * 64 - 1) / (resident * 64));
    const uint32_t clusters = std::max(1u, std::min(items, resident * waves));
    float scale = 1.0f / sqrtf((float)s.d);
    uint32_t hq = s.hq, hkv = s.hkv, d = s.d, gated = s.gated;
    void* args[] = {(void*)&l.out,       (void*)&l.qkv,       (void*)&l.k,          (void*)&l.v,
                    (void*)&l.tables,    (void*)&l.row_seq,   (void*)&l.pos,        (void*)&l.rows,
                    (void*)&l.row_stride, (void*)&l.q_stride, (void*)&hq,           (void*)&hkv,
                    (void*)&d,           (void*)&l.block_size, (void*)&l.max_blocks, (void*)&l.num_seqs,
                    (void*)&l.num_slots, (void*)&scale,       (void*)&gated};
    launch_ex((const void*)kern.k, dim3(per * clusters), dim3(128), smem, false, st, args);
}

template <typename T>
static T* upload(const std::vector<T>& h) {
    T* p;
    CK(cudaMalloc(&p, h.size() * sizeof(T)));
    CK(cudaMemcpy(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
    return p;
}

// Rows of random contexts over shuffled blocks (and one row past its table: NaN in both), the
// two kernels' outputs compared byte for byte.
static bool check(const Kern& base, const Kern& cand, const Shape& s, uint32_t rows, uint32_t block_size,
                  uint32_t seed) {
    std::mt19937 rng(seed);
    const uint32_t max_ctx = 2100, max_blocks = (max_ctx + block_size - 1) / block_size;
    const uint32_t num_seqs = rows, nblocks = num_seqs * max_blocks, num_slots = nblocks * block_size;
    std::vector<uint32_t> perm(nblocks);
    for (uint32_t i = 0; i < nblocks; ++i) perm[i] = i;
    std::shuffle(perm.begin(), perm.end(), rng);
    std::vector<uint32_t> row_seq(rows), pos(rows);
    for (uint32_t r = 0; r < rows; ++r) {
        row_seq[r] = (r * 7) % num_seqs;
        pos[r] = rng() % max_ctx;
    }
    pos[rows / 2] = max_ctx + 40;  // past its table: NaN
    const uint32_t q_stride = s.gated ? 2 * s.d : s.d;
    const uint32_t row_stride = s.hq * q_stride + 2 * s.hkv * s.d;
    const size_t pool = (size_t)num_slots * s.hkv * s.d;
    Launch l;
    CK(cudaMalloc(&l.k, pool * 2));
    CK(cudaMalloc(&l.v, pool * 2));
    CK(cudaMalloc(&l.qkv, (size_t)rows * row_stride * 2));
    fill_bf16<<<512, 256>>>(l.k, pool, seed * 3 + 1, 2.0f);
    fill_bf16<<<512, 256>>>(l.v, pool, seed * 3 + 2, 2.0f);
    fill_bf16<<<512, 256>>>(l.qkv, (size_t)rows * row_stride, seed * 3 + 3, 2.0f);
    l.tables = upload(perm);
    l.row_seq = upload(row_seq);
    l.pos = upload(pos);
    l.rows = rows;
    l.row_stride = row_stride;
    l.q_stride = q_stride;
    l.block_size = block_size;
    l.max_blocks = max_blocks;
    l.num_seqs = num_seqs;
    l.num_slots = num_slots;
    const size_t out_elems = (size_t)rows * s.hq * s.d;
    std::vector<uint16_t> got[2];
    for (int which = 0; which < 2; ++which) {
        CK(cudaMalloc(&l.out, out_elems * 2));
        CK(cudaMemset(l.out, 0xA5, out_elems * 2));
        launch(which == 0 ? base : cand, s, l, 0);
        CK(cudaDeviceSynchronize());
        got[which].resize(out_elems);
        CK(cudaMemcpy(got[which].data(), l.out, out_elems * 2, cudaMemcpyDeviceToHost));
        CK(cudaFree(l.out));
    }
    size_t diff = 0, first = 0;
    for (size_t i = 0; i < out_elems; ++i)
        if (got[0][i] != got[1][i] && diff++ == 0) first = i;
    size_t nan_row = 0;
    for (size_t i = (size_t)(rows / 2) * s.hq * s.d; i < (size_t)(rows / 2 + 1) * s.hq * s.d; ++i)
        nan_row += (got[1][i] & 0x7FFF) > 0x7F80;
    printf("check %-10s rows %3u block %2u: %zu of %zu outputs differ, bad row NaN %s\n", s.name, rows, block_size,
           diff, out_elems, nan_row == (size_t)s.hq * s.d ? "yes" : "NO");
    if (diff) {
        printf("  first diff at %zu: %04x vs %04x\n", first, got[0][first], got[1][first]);
        const uint32_t hb = heads_per_block(s.hq, s.hkv), per_item = hb * s.d;
        printf("  differing items:");
        int shown = 0;
        for (size_t it = 0; it < out_elems / per_item && shown < 40; ++it) {
            size_t n = 0;
            for (size_t i = it * per_item; i < (it + 1) * per_item; ++i) n += got[0][i] != got[1][i];
            if (n) {
                printf(" %zu(ctx %u)", it, pos[it / (s.hq / hb)] + 1);
                ++shown;
            }
        }
        printf("\n");
    }
    CK(cudaFree(l.k));
    CK(cudaFree(l.v));
    CK(cudaFree(l.qkv));
    CK(cudaFree(l.tables));
    CK(cudaFree(l.row_seq));
    CK(cudaFree(l.pos));
    return diff == 0 && nan_row == (size_t)s.hq * s.d;
}

// us per launch of `kern` at `rows` rows of context 1025 (block size 16, sequential tables),
// cycling through enough copies of the pools that L2 holds none of them.
static void time_both(const Kern& base, const Kern& cand, const Shape& s, uint32_t rows, cudaStream_t st,
                      uint32_t position = 1024) {
    const uint32_t block = 16, max_blocks = (position + 1 + block - 1) / block;
    const uint32_t num_slots = rows * max_blocks * block;
    const size_t pool = (size_t)num_slots * s.hkv * s.d;
    const int copies = (int)std::min<size_t>(64, std::max<size_t>(1, ((size_t)320 << 20) / (4 * pool) + 1));
    const uint32_t q_stride = s.gated ? 2 * s.d : s.d;
    const uint32_t row_stride = s.hq * q_stride + 2 * s.hkv * s.d;
    std::vector<uint32_t> tables(rows * max_blocks), row_seq(rows), pos(rows, position);
    for (uint32_t i = 0; i < tables.size(); ++i) tables[i] = i;
    for (uint32_t r = 0; r < rows; ++r) row_seq[r] = r;
    std::vector<Launch> ls(copies);
    bf16 *qkv, *out;
    CK(cudaMalloc(&qkv, (size_t)rows * row_stride * 2));
    CK(cudaMalloc(&out, (size_t)rows * s.hq * s.d * 2));
    fill_bf16<<<512, 256>>>(qkv, (size_t)rows * row_stride, 7, 2.0f);
    uint32_t* t = upload(tables);
    uint32_t* rs = upload(row_seq);
    uint32_t* ps = upload(pos);
    for (int c = 0; c < copies; ++c) {
        Launch& l = ls[c];
        CK(cudaMalloc(&l.k, pool * 2));
        CK(cudaMalloc(&l.v, pool * 2));
        fill_bf16<<<512, 256>>>(l.k, pool, 2 * c + 11, 2.0f);
        fill_bf16<<<512, 256>>>(l.v, pool, 2 * c + 12, 2.0f);
        l.out = out;
        l.qkv = qkv;
        l.tables = t;
        l.row_seq = rs;
        l.pos = ps;
        l.rows = rows;
        l.row_stride = row_stride;
        l.q_stride = q_stride;
        l.block_size = block;
        l.max_blocks = max_blocks;
        l.num_seqs = rows;
        l.num_slots = num_slots;
    }
    CK(cudaDeviceSynchronize());
    const int per_graph = std::max(copies, 20);
    double us[2];
    for (int which = 0; which < 2; ++which) {
        const Kern& k = which == 0 ? base : cand;
        const double ms = time_graph(
            st, [&](cudaStream_t s2) {
                for (int i = 0; i < per_graph; ++i) launch(k, s, ls[i % copies], s2);
            },
            20);
        us[which] = 1000.0 * ms / per_graph;
    }
    const double floor_us = 2.0 * rows * (position + 1) * s.hkv * s.d * 2 / 4.2e6;  // bytes over 4.2 TB/s
    printf("time  %-10s ctx %4u batch %3u: base %7.2f us  candidate %7.2f us  (%.3fx)  kv floor at 4.2 TB/s %6.2f us\n", s.name,
           position + 1, rows, us[0], us[1], us[1] / us[0], floor_us);
    for (auto& l : ls) {
        CK(cudaFree(l.k));
        CK(cudaFree(l.v));
    }
    CK(cudaFree(qkv));
    CK(cudaFree(out));
    CK(cudaFree(t));
    CK(cudaFree(rs));
    CK(cudaFree(ps));
}

static Kern load(const char* arg) {
    std::string path(arg), name("paged_attention");
    const size_t colon = path.find(':');
    if (colon != std::string::npos) {
        name = path.substr(colon + 1);
        path = path.substr(0, colon);
    }
    cudaLibrary_t lib;
    CK(cudaLibraryLoadFromFile(&lib, path.c_str(), nullptr, nullptr, 0, nullptr, nullptr, 0));
    Kern k;
    CK(cudaLibraryGetKernel(&k.k, lib, name.c_str()));
    CK(cudaFuncSetAttribute((const void*)k.k, cudaFuncAttributeMaxDynamicSharedMemorySize, 224 * 1024));
    k.flat = name.find("flat") != std::string::npos;
    return k;
}

int main(int argc, char** argv) {
    if (argc < 3) {
        printf("usage: attention_lab BASE.cubin CANDIDATE.cubin [quick]\n");
        return 2;
    }
    const Kern base = load(argv[1]), cand = load(argv[2]);
    const bool quick = argc > 3 && (strcmp(argv[3], "quick") == 0 || strcmp(argv[3], "onegrid") == 0);
    g_flat_one_per_item = argc > 3 && strcmp(argv[3], "onegrid") == 0;
    const Shape shapes[] = {{"qwen3-8b", 32, 8, 128, false, 30}, {"qwen3.5-9b", 16, 4, 256, true, 15},
                            {"gqa-hd64", 16, 2, 64, false, 30}, {"hd32", 8, 8, 32, false, 30}};
    if (argc > 3 && strcmp(argv[3], "profile") == 0) {
        // For a profiler: the candidate alone on Qwen3-8B heads (`profile [ROWS [POSITION]]`,
        // default 32 rows at position 1024: the timing's setup).
        const uint32_t rows = argc > 4 ? (uint32_t)atoi(argv[4]) : 32;
        const uint32_t position = argc > 5 ? (uint32_t)atoi(argv[5]) : 1024;
        cudaStream_t st;
        CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
        time_both(cand, cand, shapes[0], rows, st, position);
        return 0;
    }
    bool ok = true;
    uint32_t seed = 1;
    for (const Shape& s : shapes)
        for (uint32_t rows : {1u, 5u, 37u, 130u})
            for (uint32_t block : {16u, 8u, 32u}) ok = check(base, cand, s, rows, block, seed++) && ok;
    printf("bitwise: %s\n", ok ? "all equal" : "DIFFERENCES");
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    for (const Shape& s : {shapes[0], shapes[1]})
        for (uint32_t position : {384u, 1024u})
            for (uint32_t rows : quick ? std::vector<uint32_t>{1, 32} : std::vector<uint32_t>{1, 4, 8, 16, 32, 64, 128})
                time_both(base, cand, s, rows, st, position);
    // The same bytes as batch 32 at context 1025 in half the items, each twice as long.
    time_both(base, cand, shapes[0], 16, st, 2048);
    time_both(base, cand, shapes[0], 8, st, 4096);
    return ok ? 0 : 1;
}
