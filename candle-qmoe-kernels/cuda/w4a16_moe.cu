// Fused top-k W4A16 routed-experts kernels for candle-qmoe.
//
// Weights come straight from the INT4 expert slabs of candle-qmoe's pack (see
// candle-qmoe/src/pack/layout.rs): rows of 16-byte chunks of 32 weights, each u32 word holding 8
// consecutive weights e0..e7 as nibbles q+8 in the order [e0,e2,e4,e6,e1,e3,e5,e7], so that
// `(w >> 4i) & 0x000f000f` is the pair (e_2i, e_2i+1); FP16 scales [rows, groups] row-major.
// Slab = [gate_up weights [2I,H] | down weights [H,I] | gate_up scales | down scales].
//
// All matrix work runs on the tensor cores (mma.sync m16n8k16, FP32 accumulation) with the
// weights as the A operand (16 weight rows) and the activations as the B operand (8 tokens):
//   * 16-byte chunks are copied global -> shared with cp.async (several stages in flight), then
//     `ldmatrix.x4` hands lane (g = lane/4, t = lane%4) word t of four chunks of row g;
//   * a word becomes four half2/bfloat162 pairs with the magic-number trick (lop3 + one fma,
//     exact: the values are the integers q in [-8, 7]);
//   * the K order inside one mma is permuted consistently for A and B: in step s of chunk j,
//     mma k-slot (2t, 2t+1) is column 32j + 8t + 4s + {0, 1} and k-slot (2t+8, 2t+9) is column
//     32j + 8t + 4s + {2, 3}, so the B fragment of lane (g, t) is one 16-byte load of columns
//     32j + 8t .. 32j + 8t + 7 of token g; every mma stays inside one chunk, hence inside one
//     scale group, and the FP16 group scale is applied in FP32 when a group ends.
//   * BF16 activations use bf16 mma, F16 use f16 mma; F32 activations are split into bf16
//     hi + lo parts (two mma) so they keep ~16 bits of precision.
//
// Kernels (one module, instantiated per activation type):
//   decode  (T <= 16 tokens): qmoe_decode_gate_up_*  grid (ceil(I/16), min(E, T*k)) x 128 threads
//                              qmoe_decode_down_*     grid (ceil(H/32), min(E, T*k)) x 128 threads
//     Each block finds "its" expert (the blockIdx.y-th distinct expert of the routing, computed
//     in shared memory from the top-k ids that stay on the device) and the tokens routed to it,
//     streams its weight rows once (4 warps split K) and writes the intermediate
//     h = silu(gate)·up (gate/up kernel) or per-pair outputs y (down kernel). The last down
//     block of a row range (an arrival counter, self-resetting) sums the k experts of every
//     token in the fixed order j = 0..k-1: deterministic, no float atomics, no host sync.
//   prefill (any T): qmoe_route (one block: counting sort of the T*k pairs by expert, tile list,
//     no limit on routed rows) -> qmoe_prefill_gate_up_* / qmoe_prefill_down_* (64 weight rows x
//     64 routed rows per block, 3-stage cp.async pipeline, 2 for F32) -> qmoe_combine_* (fixed-order
//     sum).
// Ids >= E mark pairs computed elsewhere (a residency manager's CPU share): they contribute 0.
// A token that repeats an expert gets the CPU path's result (each pair counted with its weight).
//
// Experts are located through an expert -> slot table (u32 per expert) so that a residency
// manager can remap experts without touching the kernels.

#ifdef QMOE_EMU
// Host emulation (candle-qmoe-kernels/emu): one OS thread per CUDA thread, see emu.h.
#include "../emu/emu.h"
#define QMOE_DYN_SMEM(name) uint8_t* name = emu::dyn_smem()
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>
#define QMOE_DYN_SMEM(name) extern __shared__ __align__(128) uint8_t name[]
#endif

// Tiles, shared-memory sizes and the MoeParams block, shared with the emulator and the Rust
// launcher (candle-qmoe-kernels/build.rs generates the Rust side from it).
#include "moe_geometry.h"

namespace qmoe {

constexpr int CHUNK_BYTES = QMOE_CHUNK_BYTES;
constexpr int STEP_CHUNKS = QMOE_STEP_CHUNKS;  // chunks per pipeline step
constexpr int W_PITCH = QMOE_W_PITCH;          // bytes per weight row in a stage (80)
constexpr int NTHREADS = QMOE_NTHREADS;
// The code below hard-codes these (32 weights per chunk, 16-row mma tiles, 32-word bitmaps).
static_assert(QMOE_CHUNK_COLS == 32 && CHUNK_BYTES * 2 == QMOE_CHUNK_COLS, "a chunk is 32 INT4 weights");
static_assert(QMOE_MAX_EXPERTS == 32 * 32 && QMOE_ROUTE_THREADS == QMOE_MAX_EXPERTS, "expert bitmap and route scan");
static_assert(QMOE_COMBINE_COLS == 4 * NTHREADS, "combine: four columns per thread");

template <class T> struct Act;
template <> struct Act<__nv_bfloat16> { static constexpr int ES = 2, PL = 1; static constexpr bool BF = true; };
template <> struct Act<__half> { static constexpr int ES = 2, PL = 1; static constexpr bool BF = false; };
template <> struct Act<float> { static constexpr int ES = 4, PL = 2; static constexpr bool BF = true; };

__host__ __device__ constexpr int round_up(int x, int m) { return (x + m - 1) / m * m; }

// Shared-memory row pitch (bytes) of `cols` activations: 16-byte B-fragment loads of a quarter
// warp (two tokens x four lanes) then hit eight distinct 16-byte bank groups.
__host__ __device__ constexpr int x_pitch(int cols, int es) {
    return round_up(cols * es, QMOE_X_ALIGN) + (es == 2 ? QMOE_X_PAD_16BIT : QMOE_X_PAD_32BIT);
}
static_assert(x_pitch(200, 2) == QMOE_X_PITCH(200, 2) && x_pitch(200, 4) == QMOE_X_PITCH(200, 4), "x_pitch");

#ifndef QMOE_EMU
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy; zero-fills the destination when `pred` is false.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool pred) {
    const int n = pred ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}
#else
using emu::cp_async16;
using emu::cp_async_commit;
using emu::cp_async_wait;
using emu::ldmatrix_x4;
#endif

// One u32 word of packed nibbles -> four pairs (e0,e1) (e2,e3) (e4,e5) (e6,e7) as q = n - 8.
template <bool BF> __device__ __forceinline__ void dequant(uint32_t w, uint32_t (&p)[4]);

#ifdef QMOE_EMU
// The emulator checks the bit tricks below through emu::fma16x2 (exact float math).
#define QMOE_FMA_F16X2(d, a, b, c) d = emu::fma16x2<false>(a, b, c)
#define QMOE_FMA_BF16X2(d, a, b, c) d = emu::fma16x2<true>(a, b, c)
#else
#define QMOE_FMA_F16X2(d, a, b, c) asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c))
#define QMOE_FMA_BF16X2(d, a, b, c) asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c))
#endif

template <> __device__ __forceinline__ void dequant<false>(uint32_t w, uint32_t (&p)[4]) {
    // f16: 0x6400 | n = 1024 + n; 0x6400 | (n << 4) = 1024 + 16 n (exact).
    const uint32_t M = 0x64006400u;
    const uint32_t w8 = w >> 8;
    const uint32_t l0 = (w & 0x000f000fu) | M, h0 = (w & 0x00f000f0u) | M;
    const uint32_t l1 = (w8 & 0x000f000fu) | M, h1 = (w8 & 0x00f000f0u) | M;
    const uint32_t one = 0x3c003c00u, neg1032 = 0xe408e408u, sixteenth = 0x2c002c00u, neg72 = 0xd480d480u;
    QMOE_FMA_F16X2(p[0], l0, one, neg1032);
    QMOE_FMA_F16X2(p[1], h0, sixteenth, neg72);
    QMOE_FMA_F16X2(p[2], l1, one, neg1032);
    QMOE_FMA_F16X2(p[3], h1, sixteenth, neg72);
}

template <> __device__ __forceinline__ void dequant<true>(uint32_t w, uint32_t (&p)[4]) {
    // bf16: 0x4300 | n = 128 + n (exact; bf16 has 7 mantissa bits, so no 16 n variant).
    const uint32_t M = 0x43004300u, m = 0x000f000fu;
    const uint32_t one = 0x3f803f80u, neg136 = 0xc308c308u;
    const uint32_t v0 = (w & m) | M, v1 = ((w >> 4) & m) | M, v2 = ((w >> 8) & m) | M, v3 = ((w >> 12) & m) | M;
    QMOE_FMA_BF16X2(p[0], v0, one, neg136);
    QMOE_FMA_BF16X2(p[1], v1, one, neg136);
    QMOE_FMA_BF16X2(p[2], v2, one, neg136);
    QMOE_FMA_BF16X2(p[3], v3, one, neg136);
}

template <bool BF>
__device__ __forceinline__ void mma16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
#ifdef QMOE_EMU
    emu::mma16816<BF>(c, a0, a1, a2, a3, b0, b1);
#else
    if constexpr (BF) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
            "{%8, %9}, {%0, %1, %2, %3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
            "{%8, %9}, {%0, %1, %2, %3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
#endif
}

__device__ __forceinline__ uint32_t bf16x2_bits(__nv_bfloat162 v) { return *reinterpret_cast<uint32_t*>(&v); }

// (a, b) -> hi = bf16(a, b), lo = bf16(a - hi, b - hi): a + b keep ~16 significant bits.
__device__ __forceinline__ void split2(float a, float b, uint32_t& hi, uint32_t& lo) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    const __nv_bfloat162 l = __floats2bfloat162_rn(a - __low2float(h), b - __high2float(h));
    hi = bf16x2_bits(h);
    lo = bf16x2_bits(l);
}

// B fragment registers of one chunk for one token: columns col .. col + 7 of a shared row.
template <class T>
__device__ __forceinline__ void load_b(const uint8_t* row, int col, uint32_t (&b)[Act<T>::PL][4]) {
    if constexpr (Act<T>::ES == 2) {
        const uint4 v = *reinterpret_cast<const uint4*>(row + col * 2);
        b[0][0] = v.x; b[0][1] = v.y; b[0][2] = v.z; b[0][3] = v.w;
    } else {
        const float4 u = *reinterpret_cast<const float4*>(row + col * 4);
        const float4 v = *reinterpret_cast<const float4*>(row + col * 4 + 16);
        split2(u.x, u.y, b[0][0], b[1][0]);
        split2(u.z, u.w, b[0][1], b[1][1]);
        split2(v.x, v.y, b[0][2], b[1][2]);
        split2(v.z, v.w, b[0][3], b[1][3]);
    }
}

template <class T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ __nv_bfloat16 from_f32(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_f32(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ float from_f32(float v) { return v; }

__device__ __forceinline__ float silu_mul(float gate, float up) { return gate / (1.0f + expf(-gate)) * up; }

// The MMA work of one pipeline step (up to four chunks) of MT 16-row weight tiles against NT
// 8-token activation tiles. `a` holds the ldmatrix results, `xrow(nt)` the shared activation
// row of the lane's token in tile nt (nullptr: token absent, contributes zeros), `c0` the first
// chunk of the step, `c_end` the end of this warp's chunk range, `cpg` chunks per scale group.
// Group partial sums live in `grp` and are scaled into `acc` when a group (or the range) ends.
template <class T, int MT, int NT, class XRow, class Scale>
__device__ __forceinline__ void mma_step(const uint32_t (&a)[MT][2][4], XRow xrow, int col_base, int c0, int c_end,
                                         int cpg, Scale scale, float (&grp)[MT][NT][4], float (&acc)[MT][NT][4]) {
    constexpr int PL = Act<T>::PL;
    constexpr bool BF = Act<T>::BF;
    const int t = threadIdx.x & 3;
#pragma unroll
    for (int j = 0; j < STEP_CHUNKS; ++j) {
        const int c = c0 + j;
        if (c < c_end) {
            uint32_t b[NT][PL][4];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const uint8_t* r = xrow(nt);
                if (r != nullptr) {
                    load_b<T>(r, col_base + j * 32 + 8 * t, b[nt]);
                } else {
#pragma unroll
                    for (int pl = 0; pl < PL; ++pl)
#pragma unroll
                        for (int q = 0; q < 4; ++q) b[nt][pl][q] = 0u;
                }
            }
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                uint32_t q0[4], q1[4];
                dequant<BF>(a[mt][0][j], q0);
                dequant<BF>(a[mt][1][j], q1);
#pragma unroll
                for (int s = 0; s < 2; ++s)
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                        for (int pl = 0; pl < PL; ++pl)
                            mma16816<BF>(grp[mt][nt], q0[2 * s], q1[2 * s], q0[2 * s + 1], q1[2 * s + 1],
                                         b[nt][pl][2 * s], b[nt][pl][2 * s + 1]);
            }
            if ((c + 1) % cpg == 0 || c + 1 == c_end) {
                const int gi = c / cpg;
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    const float s0 = scale(mt, 0, gi), s1 = scale(mt, 1, gi);
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt) {
                        acc[mt][nt][0] += s0 * grp[mt][nt][0];
                        acc[mt][nt][1] += s0 * grp[mt][nt][1];
                        acc[mt][nt][2] += s1 * grp[mt][nt][2];
                        acc[mt][nt][3] += s1 * grp[mt][nt][3];
#pragma unroll
                        for (int r = 0; r < 4; ++r) grp[mt][nt][r] = 0.f;
                    }
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Decode
// ---------------------------------------------------------------------------------------------

// The first pair of pair i's token routed to the same expert (i itself unless the token repeats
// an expert): decode computes each (token, expert) once, so at most T pairs per expert, and the
// combine reads a repeated pair's output from its first occurrence.
__device__ __forceinline__ int first_pair(const MoeParams& p, int i) {
    const uint32_t e = p.ids[i];
    for (int j = i - static_cast<int>(i % p.top_k); j < i; ++j)
        if (p.ids[j] == e) return j;
    return i;
}

constexpr int DEC_WARPS = QMOE_DEC_WARPS;
constexpr int DEC_ROWS = QMOE_DEC_ROWS;  // weight rows per block: two 16-row tiles
constexpr int DEC_STAGES = QMOE_DEC_STAGES;
constexpr int DEC_STAGE_BYTES = QMOE_DEC_STAGE_BYTES;
constexpr int DEC_RING_BYTES = QMOE_DEC_RING_BYTES;
static_assert(DEC_ROWS == 32 && QMOE_DEC_GATE_UP_ROWS == 16 && DEC_WARPS * 32 == NTHREADS, "decode tiles");
static_assert(QMOE_DEC_MAX_TOKENS == 2 * 8, "decode: at most two 8-token mma tiles");

// MODE 0: gate/up + SiLU·up -> h. MODE 1: down -> y, then the last block per row range combines.
template <class T, int MODE, int NT>
__device__ __forceinline__ void decode_body(const MoeParams& p) {
    using Tr = Act<T>;
    constexpr int MAXN = NT * 8;
    QMOE_DYN_SMEM(smem);
    __shared__ uint32_t s_bits[32];
    __shared__ uint32_t s_pair[MAXN];
    __shared__ int s_nd, s_n, s_last;
    __shared__ uint32_t s_expert;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2;
    const int P = static_cast<int>(p.tokens * p.top_k);
    const int d = blockIdx.y;

    // 1. The distinct experts of the routing (a bitmap, E <= 1024) and this block's one.
    if (tid < 32) s_bits[tid] = 0u;
    __syncthreads();
    for (int i = tid; i < P; i += NTHREADS) {
        const uint32_t e = p.ids[i];
        if (e < p.num_experts) atomicOr(&s_bits[e >> 5], 1u << (e & 31));
    }
    __syncthreads();
    if (warp == 0) {
        const uint32_t word = s_bits[lane];
        const int cnt = __popc(word);
        int incl = cnt;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int v = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += v;
        }
        const int excl = incl - cnt;
        if (lane == 31) s_nd = incl;
        if (d >= excl && d < incl) {
            uint32_t w = word;
            for (int r = d - excl; r > 0; --r) w &= w - 1u;
            s_expert = static_cast<uint32_t>(lane * 32 + __ffs(w) - 1);
        }
    }
    __syncthreads();
    if (d >= s_nd) {
        // No expert at all (every id out of range, e.g. all computed elsewhere): the result is 0.
        if (MODE == 1 && s_nd == 0 && d == 0) {
            for (int idx = tid; idx < static_cast<int>(p.tokens) * DEC_ROWS; idx += NTHREADS) {
                const int tok = idx / DEC_ROWS, row = blockIdx.x * DEC_ROWS + (idx - tok * DEC_ROWS);
                if (row < static_cast<int>(p.hidden))
                    reinterpret_cast<T*>(p.out)[static_cast<unsigned long long>(tok) * p.hidden + row] = from_f32<T>(0.f);
            }
        }
        return;
    }
    const uint32_t e = s_expert;

    // 2. The routed pairs (token * k + j) of this expert, ascending, one per token.
    if (warp == 0) {
        int base = 0;
        for (int i0 = 0; i0 < P; i0 += 32) {
            const int i = i0 + lane;
            const bool m = i < P && p.ids[i] == e && first_pair(p, i) == i;
            const uint32_t bal = __ballot_sync(0xffffffffu, m);
            const int pos = base + __popc(bal & ((1u << lane) - 1u));
            if (m && pos < MAXN) s_pair[pos] = static_cast<uint32_t>(i);
            base += __popc(bal);
        }
        if (lane == 0) s_n = base < MAXN ? base : MAXN;
    }
    __syncthreads();
    const int n = s_n;

    // 3. Geometry of this block's weight rows.
    const int K = MODE == 0 ? static_cast<int>(p.hidden) : static_cast<int>(p.inter);
    const int kc = (K + 31) / 32;
    const int row_bytes = kc * CHUNK_BYTES;
    const int groups = (K + static_cast<int>(p.group) - 1) / static_cast<int>(p.group);
    const int cpg = static_cast<int>(p.group) / 32;
    const uint8_t* slab = p.slabs + static_cast<unsigned long long>(p.slot_of[e]) * p.slab_bytes;
    const uint8_t* wmat = slab + (MODE == 0 ? p.off_gu_w : p.off_dn_w);
    const __half* smat = reinterpret_cast<const __half*>(slab + (MODE == 0 ? p.off_gu_s : p.off_dn_s));
    const int blk = blockIdx.x;
    // Global weight row of block row r (0..31), -1 when outside the matrix.
    auto grow = [&](int r) -> int {
        if (MODE == 0) {
            const int i = blk * 16 + (r & 15);
            return i < static_cast<int>(p.inter) ? (r < 16 ? i : static_cast<int>(p.inter) + i) : -1;
        } else {
            const int row = blk * DEC_ROWS + r;
            return row < static_cast<int>(p.hidden) ? row : -1;
        }
    };

    __half* s_sc = reinterpret_cast<__half*>(smem + DEC_RING_BYTES);
    const int sc_bytes = round_up(DEC_ROWS * groups * 2, QMOE_SCALE_ALIGN);
    uint8_t* xs = smem + DEC_RING_BYTES + sc_bytes;
    const int pitch = x_pitch(K, Tr::ES);

    // 4. Activation rows of the n pairs -> shared (cp.async group 0).
    {
        const int segs = K * Tr::ES / 16;
        const uint8_t* src = reinterpret_cast<const uint8_t*>(MODE == 0 ? p.x : p.h);
        for (int idx = tid; idx < n * segs; idx += NTHREADS) {
            const int pos = idx / segs, sg = idx - pos * segs;
            const uint32_t pair = s_pair[pos];
            const unsigned long long srow = MODE == 0 ? pair / p.top_k : pair;
            cp_async16(xs + pos * pitch + sg * 16, src + (srow * K) * Tr::ES + sg * 16, true);
        }
        cp_async_commit();
        // Zero the padding columns K .. 32 * kc (their weights are q = 0; avoid 0 * garbage).
        const int pad_segs = (kc * 32 - K) * Tr::ES / 16;
        for (int idx = tid; idx < n * pad_segs; idx += NTHREADS) {
            const int pos = idx / pad_segs, sg = idx - pos * pad_segs;
            *reinterpret_cast<uint4*>(xs + pos * pitch + K * Tr::ES + sg * 16) = make_uint4(0u, 0u, 0u, 0u);
        }
    }

    // 5. This warp's chunk range (the 4 warps split K) and its weight stream: all stages in flight.
    const int share = (kc + STEP_CHUNKS * DEC_WARPS - 1) / (STEP_CHUNKS * DEC_WARPS) * STEP_CHUNKS;
    const int c_beg = min(warp * share, kc), c_end = min(c_beg + share, kc);
    const int nsteps = (c_end - c_beg + STEP_CHUNKS - 1) / STEP_CHUNKS;
    uint8_t* ring = smem + warp * DEC_STAGES * DEC_STAGE_BYTES;
    auto load_step = [&](int st) {
        if (st < nsteps) {
            uint8_t* stage = ring + (st % DEC_STAGES) * DEC_STAGE_BYTES;
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const int seg = lane + 32 * q;
                const int r = seg >> 2, ch = seg & 3;
                const int c = c_beg + st * STEP_CHUNKS + ch;
                const int gr = grow(r);
                const bool ok = gr >= 0 && c < c_end;
                const uint8_t* src = ok ? wmat + static_cast<size_t>(gr) * row_bytes + c * CHUNK_BYTES : wmat;
                cp_async16(stage + r * W_PITCH + ch * CHUNK_BYTES, src, ok);
            }
        }
        cp_async_commit();
    };
#pragma unroll
    for (int st = 0; st < DEC_STAGES; ++st) load_step(st);

    // 6. Scales of the block's rows (all groups) -> shared.
    for (int idx = tid; idx < DEC_ROWS * groups; idx += NTHREADS) {
        const int r = idx / groups, gi = idx - r * groups;
        const int gr = grow(r);
        s_sc[idx] = gr >= 0 ? smat[static_cast<size_t>(gr) * groups + gi] : __float2half(0.f);
    }
    cp_async_wait<DEC_STAGES>();  // the activation group
    __syncthreads();

    // 7. Main loop.
    float acc[2][NT][4], grp[2][NT][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int r = 0; r < 4; ++r) acc[mt][nt][r] = grp[mt][nt][r] = 0.f;

    auto xrow = [&](int nt) -> const uint8_t* {
        const int pos = nt * 8 + g;
        return pos < n ? xs + pos * pitch : nullptr;
    };
    auto scale = [&](int mt, int half, int gi) -> float {
        return __half2float(s_sc[(mt * 16 + g + 8 * half) * groups + gi]);
    };
    for (int st = 0; st < nsteps; ++st) {
        cp_async_wait<DEC_STAGES - 1>();
        __syncwarp();
        const uint8_t* stage = ring + (st % DEC_STAGES) * DEC_STAGE_BYTES;
        uint32_t a[2][2][4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf)
                ldmatrix_x4(a[mt][hf], stage + (mt * 16 + hf * 8 + (lane & 7)) * W_PITCH + (lane >> 3) * CHUNK_BYTES);
        const int c0 = c_beg + st * STEP_CHUNKS;
        mma_step<T, 2, NT>(a, xrow, c0 * 32, c0, c_end, cpg, scale, grp, acc);
        __syncwarp();
        load_step(st + DEC_STAGES);
    }

    // 8. Sum the four K slices in warp order (deterministic).
    __syncthreads();
    float* red = reinterpret_cast<float*>(smem);
    if (warp > 0) {
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int r = 0; r < 4; ++r)
                    red[((((warp - 1) * 2 + mt) * NT + nt) * 4 + r) * 32 + lane] = acc[mt][nt][r];
    }
    __syncthreads();
    const int t = lane & 3;
    if (warp == 0) {
#pragma unroll
        for (int w = 1; w < DEC_WARPS; ++w)
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int r = 0; r < 4; ++r)
                        acc[mt][nt][r] += red[((((w - 1) * 2 + mt) * NT + nt) * 4 + r) * 32 + lane];
        // 9. Epilogue: lane holds rows (g, g + 8) of each tile for tokens (2t, 2t + 1).
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf)
#pragma unroll
                for (int cc = 0; cc < 2; ++cc) {
                    const int pos = nt * 8 + 2 * t + cc;
                    if (pos >= n) continue;
                    const unsigned long long pair = s_pair[pos];
                    if (MODE == 0) {
                        const int i = blk * 16 + g + 8 * hf;
                        if (i < static_cast<int>(p.inter)) {
                            const float v = silu_mul(acc[0][nt][hf * 2 + cc], acc[1][nt][hf * 2 + cc]);
                            reinterpret_cast<T*>(p.h)[pair * p.inter + i] = from_f32<T>(v);
                        }
                    } else {
#pragma unroll
                        for (int mt = 0; mt < 2; ++mt) {
                            const int row = blk * DEC_ROWS + mt * 16 + g + 8 * hf;
                            if (row < static_cast<int>(p.hidden)) p.y[pair * p.hidden + row] = acc[mt][nt][hf * 2 + cc];
                        }
                    }
                }
    }
    if (MODE == 1) {
        // 10. The last block to finish this row range sums every token's k experts in order.
        __threadfence();
        __syncthreads();
        if (tid == 0) {
            __threadfence();  // order the block's y stores (seen through the barrier) before the arrival
            const unsigned prev = atomicAdd(&p.counters[blk], 1u);
            s_last = prev == static_cast<unsigned>(s_nd - 1);
        }
        __syncthreads();
        if (s_last) {
            __threadfence();
            const int T_ = static_cast<int>(p.tokens), k = static_cast<int>(p.top_k);
            for (int idx = tid; idx < T_ * DEC_ROWS; idx += NTHREADS) {
                const int tok = idx / DEC_ROWS, row = blk * DEC_ROWS + (idx - tok * DEC_ROWS);
                if (row >= static_cast<int>(p.hidden)) continue;
                float v = 0.f;
                for (int j = 0; j < k; ++j) {
                    const unsigned long long pair = static_cast<unsigned long long>(tok) * k + j;
                    if (p.ids[pair] < p.num_experts) {
                        const unsigned long long src = first_pair(p, static_cast<int>(pair));
                        v += p.route_w[pair] * __ldcg(&p.y[src * p.hidden + row]);
                    }
                }
                reinterpret_cast<T*>(p.out)[static_cast<unsigned long long>(tok) * p.hidden + row] = from_f32<T>(v);
            }
            if (tid == 0) p.counters[blk] = 0u;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Prefill
// ---------------------------------------------------------------------------------------------

constexpr int PRE_ROWS = QMOE_PRE_ROWS;    // weight rows per block
constexpr int PRE_PAIRS = QMOE_PRE_PAIRS;  // routed rows (tokens) per block / tile
constexpr int PRE_W_STAGE = QMOE_PRE_W_STAGE;
static_assert(PRE_ROWS == 64 && QMOE_PRE_GATE_UP_ROWS == 32 && PRE_PAIRS == 64, "prefill tiles");

// Pipeline stages: 3, or 2 for F32 activations (twice the bytes per stage), so that the F32
// kernels fit GPUs that allow about 99 KiB of shared memory per block.
template <class T> __host__ __device__ constexpr int pre_stages() { return QMOE_PRE_STAGES(Act<T>::ES); }
template <class T> __host__ __device__ constexpr int pre_x_pitch() { return x_pitch(QMOE_STEP_COLS, Act<T>::ES); }
template <class T> __host__ __device__ constexpr int pre_stage_bytes() { return QMOE_PRE_STAGE_BYTES(Act<T>::ES); }

// Single block (1024 threads): counting sort of the routed pairs by expert and the tile list.
__device__ __forceinline__ int block_excl_scan(int v, int* s_warp, int& total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int incl = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int u = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += u;
    }
    if (lane == 31) s_warp[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        const int wv = lane < nw ? s_warp[lane] : 0;
        int wi = wv;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int u = __shfl_up_sync(0xffffffffu, wi, o);
            if (lane >= o) wi += u;
        }
        s_warp[lane] = wi - wv;  // exclusive prefix of warp totals
        if (lane == 31) s_warp[32] = wi;
    }
    __syncthreads();
    const int res = s_warp[warp] + incl - v;
    total = s_warp[32];
    __syncthreads();
    return res;
}

__device__ __forceinline__ void route_body(const MoeParams& p) {
    __shared__ uint32_t s_cnt[QMOE_MAX_EXPERTS];
    __shared__ uint32_t s_off[QMOE_MAX_EXPERTS];
    __shared__ int s_warp[33];
    const int tid = threadIdx.x;
    const int P = static_cast<int>(p.tokens * p.top_k), E = static_cast<int>(p.num_experts);
    for (int e = tid; e < E; e += blockDim.x) s_cnt[e] = 0u;
    __syncthreads();
    for (int i = tid; i < P; i += blockDim.x) {
        const uint32_t e = p.ids[i];
        if (e < p.num_experts) p.rank[i] = atomicAdd(&s_cnt[e], 1u);
    }
    __syncthreads();
    const int cnt = tid < E ? static_cast<int>(s_cnt[tid]) : 0;
    const int ntile = (cnt + PRE_PAIRS - 1) / PRE_PAIRS;
    int total_rows = 0, total_tiles = 0;
    const int off = block_excl_scan(cnt, s_warp, total_rows);
    const int toff = block_excl_scan(ntile, s_warp, total_tiles);
    if (tid < E) {
        s_off[tid] = static_cast<uint32_t>(off);
        for (int m = 0; m < ntile; ++m) {
            const int tix = toff + m;
            if (tix < static_cast<int>(p.max_tiles)) {
                p.tiles[3 * tix] = static_cast<uint32_t>(tid);
                p.tiles[3 * tix + 1] = static_cast<uint32_t>(off + m * PRE_PAIRS);
                p.tiles[3 * tix + 2] = static_cast<uint32_t>(min(PRE_PAIRS, cnt - m * PRE_PAIRS));
            }
        }
    }
    if (tid == 0) p.num_tiles[0] = static_cast<uint32_t>(min(total_tiles, static_cast<int>(p.max_tiles)));
    __syncthreads();
    for (int i = tid; i < P; i += blockDim.x) {
        const uint32_t e = p.ids[i];
        if (e < p.num_experts) p.sorted[s_off[e] + p.rank[i]] = static_cast<uint32_t>(i);
    }
}

// MODE 0: gate/up + SiLU·up -> h. MODE 1: down -> y. Block (row block x, tile y), 4 warps 2 x 2.
template <class T, int MODE>
__device__ __forceinline__ void prefill_body(const MoeParams& p) {
    using Tr = Act<T>;
    constexpr int NT = 4;  // 32 routed rows per warp
    constexpr int XP = pre_x_pitch<T>();
    constexpr int STAGE = pre_stage_bytes<T>();
    constexpr int STAGES = pre_stages<T>();
    QMOE_DYN_SMEM(smem);
    __shared__ uint32_t s_pair[PRE_PAIRS];

    const int tile = blockIdx.y;
    if (tile >= static_cast<int>(p.num_tiles[0])) return;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int wr = warp & 1, wc = warp >> 1;
    const uint32_t e = p.tiles[3 * tile];
    const int start = static_cast<int>(p.tiles[3 * tile + 1]);
    const int rows = static_cast<int>(p.tiles[3 * tile + 2]);
    if (tid < PRE_PAIRS) s_pair[tid] = tid < rows ? p.sorted[start + tid] : 0u;

    const int K = MODE == 0 ? static_cast<int>(p.hidden) : static_cast<int>(p.inter);
    const int kc = (K + 31) / 32;
    const int row_bytes = kc * CHUNK_BYTES;
    const int groups = (K + static_cast<int>(p.group) - 1) / static_cast<int>(p.group);
    const int cpg = static_cast<int>(p.group) / 32;
    const uint8_t* slab = p.slabs + static_cast<unsigned long long>(p.slot_of[e]) * p.slab_bytes;
    const uint8_t* wmat = slab + (MODE == 0 ? p.off_gu_w : p.off_dn_w);
    const __half* smat = reinterpret_cast<const __half*>(slab + (MODE == 0 ? p.off_gu_s : p.off_dn_s));
    const int blk = blockIdx.x;
    auto grow = [&](int r) -> int {
        if (MODE == 0) {
            const int i = blk * 32 + (r & 31);
            return i < static_cast<int>(p.inter) ? (r < 32 ? i : static_cast<int>(p.inter) + i) : -1;
        } else {
            const int row = blk * PRE_ROWS + r;
            return row < static_cast<int>(p.hidden) ? row : -1;
        }
    };
    // Shared row of m-tile mt of this warp.
    auto mrow = [&](int mt) -> int { return MODE == 0 ? mt * 32 + wr * 16 : wr * 32 + mt * 16; };
    __half* s_sc = reinterpret_cast<__half*>(smem + STAGES * STAGE);
    const uint8_t* xsrc = reinterpret_cast<const uint8_t*>(MODE == 0 ? p.x : p.h);
    __syncthreads();  // s_pair

    const int nsteps = (kc + STEP_CHUNKS - 1) / STEP_CHUNKS;
    auto load_stage = [&](int st) {
        if (st < nsteps) {
            uint8_t* ws = smem + (st % STAGES) * STAGE;
            uint8_t* xs = ws + PRE_W_STAGE;
            const int c0 = st * STEP_CHUNKS;
#pragma unroll
            for (int q = 0; q < PRE_ROWS * STEP_CHUNKS / NTHREADS; ++q) {
                const int seg = tid + NTHREADS * q;
                const int r = seg >> 2, ch = seg & 3;
                const int c = c0 + ch;
                const int gr = grow(r);
                const bool ok = gr >= 0 && c < kc;
                const uint8_t* src = ok ? wmat + static_cast<size_t>(gr) * row_bytes + c * CHUNK_BYTES : wmat;
                cp_async16(ws + r * W_PITCH + ch * CHUNK_BYTES, src, ok);
            }
            constexpr int SPR = STEP_CHUNKS * 32 * Tr::ES / 16;  // 16-byte segments per row
            constexpr int EPS = 16 / Tr::ES;                     // elements per segment
#pragma unroll
            for (int q = 0; q < PRE_PAIRS * SPR / NTHREADS; ++q) {
                const int seg = tid + NTHREADS * q;
                const int m = seg / SPR, sg = seg - m * SPR;
                const int col = c0 * 32 + sg * EPS;
                const bool ok = m < rows && col < K;
                const unsigned long long pair = s_pair[m];
                const unsigned long long srow = MODE == 0 ? pair / p.top_k : pair;
                const uint8_t* src = ok ? xsrc + (srow * K + col) * Tr::ES : xsrc;
                cp_async16(xs + m * XP + sg * 16, src, ok);
            }
        }
        cp_async_commit();
    };
#pragma unroll
    for (int st = 0; st < STAGES - 1; ++st) load_stage(st);
    for (int idx = tid; idx < PRE_ROWS * groups; idx += NTHREADS) {
        const int r = idx / groups, gi = idx - r * groups;
        const int gr = grow(r);
        s_sc[idx] = gr >= 0 ? smat[static_cast<size_t>(gr) * groups + gi] : __float2half(0.f);
    }

    float acc[2][NT][4], grp[2][NT][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int r = 0; r < 4; ++r) acc[mt][nt][r] = grp[mt][nt][r] = 0.f;
    auto scale = [&](int mt, int half, int gi) -> float {
        return __half2float(s_sc[(mrow(mt) + g + 8 * half) * groups + gi]);
    };

    for (int st = 0; st < nsteps; ++st) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        load_stage(st + STAGES - 1);
        const uint8_t* ws = smem + (st % STAGES) * STAGE;
        const uint8_t* xs = ws + PRE_W_STAGE;
        uint32_t a[2][2][4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf)
                ldmatrix_x4(a[mt][hf], ws + (mrow(mt) + hf * 8 + (lane & 7)) * W_PITCH + (lane >> 3) * CHUNK_BYTES);
        auto xrow = [&](int nt) -> const uint8_t* { return xs + (wc * 32 + nt * 8 + g) * XP; };
        mma_step<T, 2, NT>(a, xrow, 0, st * STEP_CHUNKS, kc, cpg, scale, grp, acc);
    }

    // Epilogue: lane holds rows (g, g + 8) of each tile for routed rows (2t, 2t + 1).
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf)
#pragma unroll
            for (int cc = 0; cc < 2; ++cc) {
                const int pos = wc * 32 + nt * 8 + 2 * t + cc;
                if (pos >= rows) continue;
                const unsigned long long pair = s_pair[pos];
                if (MODE == 0) {
                    const int i = blk * 32 + wr * 16 + g + 8 * hf;
                    if (i < static_cast<int>(p.inter)) {
                        const float v = silu_mul(acc[0][nt][hf * 2 + cc], acc[1][nt][hf * 2 + cc]);
                        reinterpret_cast<T*>(p.h)[pair * p.inter + i] = from_f32<T>(v);
                    }
                } else {
#pragma unroll
                    for (int mt = 0; mt < 2; ++mt) {
                        const int row = blk * PRE_ROWS + wr * 32 + mt * 16 + g + 8 * hf;
                        if (row < static_cast<int>(p.hidden)) p.y[pair * p.hidden + row] = acc[mt][nt][hf * 2 + cc];
                    }
                }
            }
}

// out[t, :] = sum_j w[t, j] * y[t * k + j, :], j ascending. Grid (ceil(H / 512), T) x 128.
template <class T>
__device__ __forceinline__ void combine_body(const MoeParams& p) {
    const int tok = blockIdx.y;
    const int col = (blockIdx.x * NTHREADS + threadIdx.x) * 4;
    if (col >= static_cast<int>(p.hidden)) return;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int j = 0; j < static_cast<int>(p.top_k); ++j) {
        const unsigned long long pair = static_cast<unsigned long long>(tok) * p.top_k + j;
        if (p.ids[pair] >= p.num_experts) continue;
        const float w = p.route_w[pair];
        const float4 v = __ldg(reinterpret_cast<const float4*>(p.y + pair * p.hidden + col));
        acc.x += w * v.x;
        acc.y += w * v.y;
        acc.z += w * v.z;
        acc.w += w * v.w;
    }
    T* o = reinterpret_cast<T*>(p.out) + static_cast<unsigned long long>(tok) * p.hidden + col;
    o[0] = from_f32<T>(acc.x);
    o[1] = from_f32<T>(acc.y);
    o[2] = from_f32<T>(acc.z);
    o[3] = from_f32<T>(acc.w);
}

}  // namespace qmoe

#define QMOE_DECODE(NAME, T, MODE, NT)                                                                \
    extern "C" __global__ void __launch_bounds__(qmoe::NTHREADS) NAME(const MoeParams p) {            \
        qmoe::decode_body<T, MODE, NT>(p);                                                           \
    }
#define QMOE_PREFILL(NAME, T, MODE)                                                                   \
    extern "C" __global__ void __launch_bounds__(qmoe::NTHREADS) NAME(const MoeParams p) {            \
        qmoe::prefill_body<T, MODE>(p);                                                              \
    }
#define QMOE_COMBINE(NAME, T)                                                                         \
    extern "C" __global__ void __launch_bounds__(qmoe::NTHREADS) NAME(const MoeParams p) {            \
        qmoe::combine_body<T>(p);                                                                    \
    }

QMOE_DECODE(qmoe_decode_gate_up_bf16_nt1, __nv_bfloat16, 0, 1)
QMOE_DECODE(qmoe_decode_gate_up_bf16_nt2, __nv_bfloat16, 0, 2)
QMOE_DECODE(qmoe_decode_gate_up_f16_nt1, __half, 0, 1)
QMOE_DECODE(qmoe_decode_gate_up_f16_nt2, __half, 0, 2)
QMOE_DECODE(qmoe_decode_gate_up_f32_nt1, float, 0, 1)
QMOE_DECODE(qmoe_decode_gate_up_f32_nt2, float, 0, 2)
QMOE_DECODE(qmoe_decode_down_bf16_nt1, __nv_bfloat16, 1, 1)
QMOE_DECODE(qmoe_decode_down_bf16_nt2, __nv_bfloat16, 1, 2)
QMOE_DECODE(qmoe_decode_down_f16_nt1, __half, 1, 1)
QMOE_DECODE(qmoe_decode_down_f16_nt2, __half, 1, 2)
QMOE_DECODE(qmoe_decode_down_f32_nt1, float, 1, 1)
QMOE_DECODE(qmoe_decode_down_f32_nt2, float, 1, 2)

QMOE_PREFILL(qmoe_prefill_gate_up_bf16, __nv_bfloat16, 0)
QMOE_PREFILL(qmoe_prefill_gate_up_f16, __half, 0)
QMOE_PREFILL(qmoe_prefill_gate_up_f32, float, 0)
QMOE_PREFILL(qmoe_prefill_down_bf16, __nv_bfloat16, 1)
QMOE_PREFILL(qmoe_prefill_down_f16, __half, 1)
QMOE_PREFILL(qmoe_prefill_down_f32, float, 1)

QMOE_COMBINE(qmoe_combine_bf16, __nv_bfloat16)
QMOE_COMBINE(qmoe_combine_f16, __half)
QMOE_COMBINE(qmoe_combine_f32, float)

extern "C" __global__ void __launch_bounds__(QMOE_ROUTE_THREADS) qmoe_route(const MoeParams p) { qmoe::route_body(p); }
