/* Launch geometry and parameter block of the W4A16 MoE kernels: the one source for
 * w4a16_moe.cu, the host emulator (emu/main.cpp) and the Rust launcher.
 *
 * Plain C (no CUDA types). candle-qmoe-kernels/build.rs turns every object-like
 * `#define QMOE_<NAME> <integer expression>` into `pub const <NAME>: usize` and the `MoeParams`
 * struct into a `#[repr(C)]` Rust struct with the same field names (pointers become u64), then
 * checks at compile time, against this header compiled by the host C compiler, every field's
 * offset and the shared-memory sizes of the function-like macros below.
 *
 * Object-like defines must be integer expressions of literals, other QMOE_ names and + - * / ( ),
 * each with a trailing comment (its Rust doc).
 */
#pragma once

#include <stdint.h>

/* Blocks and limits. */
#define QMOE_NTHREADS 128      /* threads per block of every kernel but qmoe_route */
#define QMOE_ROUTE_THREADS 1024 /* threads of qmoe_route's single block */
#define QMOE_MAX_EXPERTS 1024  /* most experts per layer (32 x 32-bit decode bitmap, route counts) */

/* Weights stream through shared memory in steps of STEP_CHUNKS chunks per row. */
#define QMOE_CHUNK_BYTES 16                                  /* a chunk: 32 INT4 weights */
#define QMOE_CHUNK_COLS 32                                   /* weight columns per chunk */
#define QMOE_STEP_CHUNKS 4                                   /* chunks per pipeline step */
#define QMOE_STEP_COLS (QMOE_STEP_CHUNKS * QMOE_CHUNK_COLS)  /* weight columns per step */
#define QMOE_W_PITCH (QMOE_STEP_CHUNKS * QMOE_CHUNK_BYTES + 16) /* bytes per weight row in a stage */
#define QMOE_X_ALIGN 128     /* activation rows in shared memory: pitch alignment (bytes) */
#define QMOE_X_PAD_16BIT 64  /* activation pitch pad for BF16/F16 (bank spread) */
#define QMOE_X_PAD_32BIT 16  /* activation pitch pad for F32 */
#define QMOE_SCALE_ALIGN 16  /* alignment of the scale rows in shared memory */

/* Decode (T <= DEC_MAX_TOKENS): 4 warps split K, each with its own 4-stage ring of DEC_ROWS
 * weight rows; a gate/up block covers DEC_GATE_UP_ROWS rows of gate and as many of up. */
#define QMOE_DEC_MAX_TOKENS 16                          /* most tokens of a decode call */
#define QMOE_DEC_WARPS 4                                /* warps of a decode block */
#define QMOE_DEC_ROWS 32                                /* weight rows per decode block */
#define QMOE_DEC_GATE_UP_ROWS (QMOE_DEC_ROWS / 2)       /* intermediate rows per gate/up block */
#define QMOE_DEC_STAGES 4                               /* pipeline stages per warp */
#define QMOE_DEC_STAGE_BYTES (QMOE_DEC_ROWS * QMOE_W_PITCH) /* bytes of one decode stage */
#define QMOE_DEC_RING_BYTES (QMOE_DEC_WARPS * QMOE_DEC_STAGES * QMOE_DEC_STAGE_BYTES) /* all rings */

/* Prefill: PRE_ROWS weight rows x PRE_PAIRS routed rows per block; 3 pipeline stages for 16-bit
 * activations, 2 for F32 (so that F32 fits GPUs with ~99 KiB of shared memory per block). */
#define QMOE_PRE_ROWS 64                          /* weight rows per prefill block */
#define QMOE_PRE_GATE_UP_ROWS (QMOE_PRE_ROWS / 2) /* intermediate rows per gate/up block */
#define QMOE_PRE_PAIRS 64                         /* routed rows per prefill tile */
#define QMOE_PRE_STAGES_16BIT 3                   /* pipeline stages for BF16/F16 */
#define QMOE_PRE_STAGES_32BIT 2                   /* pipeline stages for F32 */
#define QMOE_PRE_W_STAGE (QMOE_PRE_ROWS * QMOE_W_PITCH) /* weight bytes of one prefill stage */

#define QMOE_COMBINE_COLS (4 * QMOE_NTHREADS) /* output columns per combine block */

/* Shared-memory sizes (bytes) as functions of the problem. `es` is the activation element size
 * (2 or 4), `k_dim` the reduction length (H for gate/up, I for down). The launchers use the
 * dynamic sizes; the kernels lay out their shared memory from the same pieces. */
#define QMOE_ROUND_UP(x, m) (((x) + (m) - 1) / (m) * (m))
#define QMOE_X_PITCH(cols, es) \
    (QMOE_ROUND_UP((cols) * (es), QMOE_X_ALIGN) + ((es) == 2 ? QMOE_X_PAD_16BIT : QMOE_X_PAD_32BIT))
#define QMOE_SCALE_BYTES(rows, k_dim, group) \
    QMOE_ROUND_UP((rows) * (((k_dim) + (group) - 1) / (group)) * 2, QMOE_SCALE_ALIGN)
/* Decode kernel for `tokens` (<= DEC_MAX_TOKENS) activation rows. */
#define QMOE_DEC_SMEM(k_dim, tokens, es, group)                                        \
    (QMOE_DEC_RING_BYTES + QMOE_SCALE_BYTES(QMOE_DEC_ROWS, k_dim, group) + \
     (tokens) * QMOE_X_PITCH(k_dim, es))
#define QMOE_PRE_STAGES(es) ((es) == 4 ? QMOE_PRE_STAGES_32BIT : QMOE_PRE_STAGES_16BIT)
#define QMOE_PRE_STAGE_BYTES(es) (QMOE_PRE_W_STAGE + QMOE_PRE_PAIRS * QMOE_X_PITCH(QMOE_STEP_COLS, es))
#define QMOE_PRE_SMEM(k_dim, es, group) \
    (QMOE_PRE_STAGES(es) * QMOE_PRE_STAGE_BYTES(es) + QMOE_SCALE_BYTES(QMOE_PRE_ROWS, k_dim, group))

/* The kernels' one parameter (by value). Pointers are device addresses. */
typedef struct MoeParams {
    const uint8_t* slabs;    /* resident expert slabs, slot-major */
    const uint32_t* slot_of; /* [num_experts] expert -> slot */
    const void* x;           /* [tokens, hidden] activations */
    const uint32_t* ids;     /* [tokens * top_k] routed experts */
    const float* route_w;    /* [tokens * top_k] routing weights */
    void* h;                 /* [tokens * top_k, inter] silu(gate) * up (activation type) */
    float* y;                /* [tokens * top_k, hidden] per-pair expert outputs */
    void* out;               /* [tokens, hidden] result (activation type) */
    uint32_t* counters;      /* decode: [ceil(hidden / DEC_ROWS)] arrival counters, zero on entry */
    uint32_t* rank;          /* prefill scratch [tokens * top_k] */
    uint32_t* sorted;        /* prefill: pairs grouped by expert [tokens * top_k] */
    uint32_t* tiles;         /* prefill: (expert, start, rows) per tile [3 * max_tiles] */
    uint32_t* num_tiles;     /* prefill: number of tiles [1] */
    uint64_t slab_bytes;     /* bytes per slab (slot stride) */
    uint64_t off_gu_w;       /* slab offset of the gate/up weights */
    uint64_t off_dn_w;       /* slab offset of the down weights */
    uint64_t off_gu_s;       /* slab offset of the gate/up scales */
    uint64_t off_dn_s;       /* slab offset of the down scales */
    uint32_t tokens;         /* T */
    uint32_t top_k;          /* k */
    uint32_t num_experts;    /* E: ids >= E are skipped */
    uint32_t hidden;         /* H */
    uint32_t inter;          /* I */
    uint32_t group;          /* scale group size (a multiple of 32) */
    uint32_t max_tiles;      /* prefill: capacity of `tiles` */
    uint32_t pad;            /* explicit tail padding (keeps the size a multiple of 8) */
} MoeParams;
