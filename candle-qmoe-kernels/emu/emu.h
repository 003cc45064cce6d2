// Host emulation of the CUDA features w4a16_moe.cu uses, to check the kernels' indexing,
// fragment layouts, tiling and combine logic on a machine without a GPU.
//
// Every CUDA thread of a block is an OS thread; blocks run one after another. `__shared__`
// variables become function-local statics (shared by the threads of the running block),
// `__syncthreads` / `__syncwarp` are barriers, and the warp collectives (shuffles, ballots,
// ldmatrix, mma.sync) exchange values through a per-warp buffer between two barriers, following
// the PTX fragment layouts. cp.async copies land only when their group is waited for. The
// emulator proves addressing and arithmetic; built with ThreadSanitizer it also finds shared-
// memory races between the threads of a block (a missing __syncthreads/__syncwarp), and with
// AddressSanitizer accesses outside the buffers and the dynamic shared memory (sized exactly).
// Cross-block ordering, the real memory model and the timing still need the GPU.
#pragma once

#include <atomic>
#include <barrier>
#include <deque>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>
#include <algorithm>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <vector_functions.h>
#include <vector_types.h>

#undef __global__
#undef __device__
#undef __host__
#undef __forceinline__
#undef __align__
#undef __shared__
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#define __shared__ static

using std::max;
using std::min;

namespace emu {

struct Dim3 {
    unsigned x = 0, y = 0, z = 0;
};

struct Warp {
    std::unique_ptr<std::barrier<>> bar;
    uint64_t buf[32][8];
};

struct Block {
    std::unique_ptr<std::barrier<>> bar;
    std::vector<std::unique_ptr<Warp>> warps;
    std::vector<uint8_t> smem;
};

inline thread_local Dim3 tl_thread, tl_block;
inline Dim3 g_block_dim, g_grid_dim;
inline Block* g_blk = nullptr;

inline uint8_t* dyn_smem() { return g_blk->smem.data(); }
inline Warp& warp() { return *g_blk->warps[tl_thread.x / 32]; }
inline unsigned lane() { return tl_thread.x % 32; }

inline void syncthreads() { g_blk->bar->arrive_and_wait(); }
inline void syncwarp() { warp().bar->arrive_and_wait(); }

// Writes `v` for this lane, lets every lane read all 32 values through `f`, then resets.
template <class F>
inline void exchange(uint64_t v, int slot, F f) {
    Warp& w = warp();
    w.buf[lane()][slot] = v;
    w.bar->arrive_and_wait();
    f(w.buf);
    w.bar->arrive_and_wait();
}

inline int shfl_up(int v, int delta) {
    int r = v;
    exchange(static_cast<uint32_t>(v), 0, [&](uint64_t (&b)[32][8]) {
        if (static_cast<int>(lane()) >= delta) r = static_cast<int>(static_cast<uint32_t>(b[lane() - delta][0]));
    });
    return r;
}

inline uint32_t ballot(bool pred) {
    uint32_t m = 0;
    exchange(pred ? 1 : 0, 0, [&](uint64_t (&b)[32][8]) {
        for (int l = 0; l < 32; ++l)
            if (b[l][0]) m |= 1u << l;
    });
    return m;
}

// cp.async: copies are queued per thread in commit groups and performed only when a
// cp.async.wait_group lets their group complete, so a read of shared memory before the matching
// wait sees the launcher's garbage fill instead of the data.
struct Copy {
    void* dst;
    const void* src;
    bool pred;
};
inline thread_local std::vector<Copy> tl_open;
inline thread_local std::vector<std::vector<Copy>> tl_groups;

inline void cp_async16(void* dst, const void* src, bool pred) { tl_open.push_back({dst, src, pred}); }
inline void cp_async_commit() {
    tl_groups.push_back(std::move(tl_open));
    tl_open.clear();
}
template <int N> inline void cp_async_wait() {
    while (tl_groups.size() > static_cast<size_t>(N)) {
        for (const Copy& c : tl_groups.front()) {
            if (c.pred) {
                std::memcpy(c.dst, c.src, 16);
            } else {
                std::memset(c.dst, 0, 16);
            }
        }
        tl_groups.erase(tl_groups.begin());
    }
}

// ldmatrix.x4: lane l gives the row address of matrix l / 8, row l % 8; lane (g, t) receives,
// for each matrix j, the 32-bit word t of row g.
inline void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
    exchange(reinterpret_cast<uint64_t>(p), 0, [&](uint64_t (&b)[32][8]) {
        const unsigned g = lane() / 4, t = lane() % 4;
        for (int j = 0; j < 4; ++j) {
            const uint32_t* row = reinterpret_cast<const uint32_t*>(b[8 * j + g][0]);
            r[j] = row[t];
        }
    });
}

template <bool BF> inline float to_f(uint16_t bits) {
    if constexpr (BF) {
        uint32_t u = static_cast<uint32_t>(bits) << 16;
        float f;
        std::memcpy(&f, &u, 4);
        return f;
    } else {
        __half h;
        std::memcpy(&h, &bits, 2);
        return __half2float(h);
    }
}
template <bool BF> inline uint16_t from_f(float v) {
    uint16_t bits;
    if constexpr (BF) {
        __nv_bfloat16 h = __float2bfloat16_rn(v);
        std::memcpy(&bits, &h, 2);
    } else {
        __half h = __float2half_rn(v);
        std::memcpy(&bits, &h, 2);
    }
    return bits;
}

// fma.rn.{f16,bf16}x2 on packed pairs (low half = first element).
template <bool BF> inline uint32_t fma16x2(uint32_t a, uint32_t b, uint32_t c) {
    uint32_t out = 0;
    for (int h = 0; h < 2; ++h) {
        const float x = to_f<BF>(a >> (16 * h)), y = to_f<BF>(b >> (16 * h)), z = to_f<BF>(c >> (16 * h));
        out |= static_cast<uint32_t>(from_f<BF>(std::fma(x, y, z))) << (16 * h);
    }
    return out;
}

// mma.sync.m16n8k16.row.col.f32.{bf16,f16}: A fragment (a0: row g, k 2t..; a1: row g+8, k 2t..;
// a2: row g, k 2t+8..; a3: row g+8, k 2t+8..), B fragment (b0: k 2t.., col g; b1: k 2t+8..,
// col g), C (c0, c1: row g, cols 2t, 2t+1; c2, c3: row g+8).
template <bool BF>
inline void mma16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1) {
    float A[16][16], B[16][8];
    Warp& w = warp();
    const unsigned l = lane();
    w.buf[l][0] = a0;
    w.buf[l][1] = a1;
    w.buf[l][2] = a2;
    w.buf[l][3] = a3;
    w.buf[l][4] = b0;
    w.buf[l][5] = b1;
    w.bar->arrive_and_wait();
    for (int ln = 0; ln < 32; ++ln) {
        const int g = ln / 4, t = ln % 4;
        auto lo = [&](int s) { return to_f<BF>(static_cast<uint16_t>(w.buf[ln][s])); };
        auto hi = [&](int s) { return to_f<BF>(static_cast<uint16_t>(w.buf[ln][s] >> 16)); };
        A[g][2 * t] = lo(0), A[g][2 * t + 1] = hi(0);
        A[g + 8][2 * t] = lo(1), A[g + 8][2 * t + 1] = hi(1);
        A[g][2 * t + 8] = lo(2), A[g][2 * t + 9] = hi(2);
        A[g + 8][2 * t + 8] = lo(3), A[g + 8][2 * t + 9] = hi(3);
        B[2 * t][g] = lo(4), B[2 * t + 1][g] = hi(4);
        B[2 * t + 8][g] = lo(5), B[2 * t + 9][g] = hi(5);
    }
    w.bar->arrive_and_wait();
    const int g = l / 4, t = l % 4;
    for (int r = 0; r < 4; ++r) {
        const int row = g + 8 * (r / 2), col = 2 * t + (r % 2);
        float acc = c[r];
        for (int k = 0; k < 16; ++k) acc += A[row][k] * B[k][col];
        c[r] = acc;
    }
}

// Runs `kernel` over `grid` blocks of `threads` threads with `smem` bytes of dynamic shared
// memory, one block at a time.
inline void launch(void (*kernel)(const void*), const void* params, Dim3 grid, unsigned threads, size_t smem) {
    g_grid_dim = grid;
    g_block_dim = Dim3{threads, 1, 1};
    for (unsigned by = 0; by < grid.y; ++by)
        for (unsigned bx = 0; bx < grid.x; ++bx) {
            Block blk;
            blk.bar = std::make_unique<std::barrier<>>(threads);
            for (unsigned w = 0; w < (threads + 31) / 32; ++w) {
                auto wp = std::make_unique<Warp>();
                wp->bar = std::make_unique<std::barrier<>>(32);
                blk.warps.push_back(std::move(wp));
            }
            // Garbage, not zeros: the kernels must not read shared memory they did not write.
            blk.smem.assign(std::max<size_t>(smem, 1), 0xA5);
            g_blk = &blk;
            std::vector<std::thread> ts;
            ts.reserve(threads);
            for (unsigned t = 0; t < threads; ++t)
                ts.emplace_back([=] {
                    tl_thread = Dim3{t, 0, 0};
                    tl_block = Dim3{bx, by, 0};
                    tl_open.clear();
                    tl_groups.clear();
                    kernel(params);
                });
            for (auto& th : ts) th.join();
            g_blk = nullptr;
        }
}

}  // namespace emu

#define threadIdx (::emu::tl_thread)
#define blockIdx (::emu::tl_block)
#define blockDim (::emu::g_block_dim)
#define gridDim (::emu::g_grid_dim)

inline void __syncthreads() { emu::syncthreads(); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::syncwarp(); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline int __shfl_up_sync(unsigned, int v, int d) { return emu::shfl_up(v, d); }
inline unsigned __ballot_sync(unsigned, bool p) { return emu::ballot(p); }
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __ffs(unsigned v) { return __builtin_ffs(static_cast<int>(v)); }
inline unsigned atomicOr(unsigned* p, unsigned v) { return __atomic_fetch_or(p, v, __ATOMIC_SEQ_CST); }
inline unsigned atomicAdd(unsigned* p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
template <class T> inline T __ldcg(const T* p) { return *p; }
template <class T> inline T __ldg(const T* p) { return *p; }
