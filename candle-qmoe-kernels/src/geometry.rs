//! Launch geometry and the parameter block of the kernels, generated from
//! `cuda/moe_geometry.h` (the header `w4a16_moe.cu` and the host emulator include) by
//! `build.rs`: one constant per `QMOE_` define (without the prefix) and [`MoeParams`] with the
//! header's field names. The shared-memory sizes below mirror the header's function-like macros;
//! the build checks them, every constant and every field offset against the C compiler's view
//! of the header.

include!(concat!(env!("OUT_DIR"), "/geometry.rs"));

/// Shared-memory pitch (bytes) of a row of `cols` activations of `es` bytes (`QMOE_X_PITCH`).
pub const fn x_pitch(cols: usize, es: usize) -> usize {
    let pad = if es == 2 { X_PAD_16BIT } else { X_PAD_32BIT };
    (cols * es).div_ceil(X_ALIGN) * X_ALIGN + pad
}

/// Bytes of the FP16 scales of `rows` weight rows of `k_dim` columns (`QMOE_SCALE_BYTES`).
pub const fn scale_bytes(rows: usize, k_dim: usize, group: usize) -> usize {
    (rows * k_dim.div_ceil(group) * 2).div_ceil(SCALE_ALIGN) * SCALE_ALIGN
}

/// Dynamic shared memory of a decode kernel reading rows of `k_dim` columns for `tokens`
/// (≤ [`DEC_MAX_TOKENS`]) activation rows of `es` bytes (`QMOE_DEC_SMEM`).
pub const fn decode_smem(k_dim: usize, tokens: usize, es: usize, group: usize) -> usize {
    DEC_RING_BYTES + scale_bytes(DEC_ROWS, k_dim, group) + tokens * x_pitch(k_dim, es)
}

/// Pipeline stages of the prefill kernels for activations of `es` bytes (`QMOE_PRE_STAGES`).
pub const fn prefill_stages(es: usize) -> usize {
    if es == 4 {
        PRE_STAGES_32BIT
    } else {
        PRE_STAGES_16BIT
    }
}

/// Dynamic shared memory of a prefill kernel reading rows of `k_dim` columns (`QMOE_PRE_SMEM`).
pub const fn prefill_smem(k_dim: usize, es: usize, group: usize) -> usize {
    let stage = PRE_W_STAGE + PRE_PAIRS * x_pitch(STEP_COLS, es);
    prefill_stages(es) * stage + scale_bytes(PRE_ROWS, k_dim, group)
}

// What the C compiler makes of the header: constants, `MoeParams` offsets, sizes on samples.
include!(concat!(env!("OUT_DIR"), "/geometry_check.rs"));
