//! CUDA sources of candle-qmoe's fused top-k W4A16 routed-experts kernels.
//!
//! With the `cuda` feature, `build.rs` compiles `cuda/w4a16_moe.cu` with nvcc into PTX for the
//! compute_80 (Ampere, Ada) and compute_90 (Hopper) virtual architectures and this crate embeds
//! both; `ptx_for` picks the one for a device. Without the feature the crate needs no CUDA
//! toolkit and exposes only the module name and the [`geometry`].
//!
//! The kernels are described at the top of the `.cu` file; their launch geometry and parameter
//! block live in `cuda/moe_geometry.h`, whose Rust side is [`geometry`] (with or without the
//! feature). The Rust launcher lives in `candle_qmoe::kernels::cuda`.

pub mod geometry;

/// Name under which the module is cached per device.
pub const MODULE_NAME: &str = "candle_qmoe_w4a16_moe";

/// The W4A16 MoE module as PTX for compute capability 8.x (`.target sm_80`).
#[cfg(feature = "cuda")]
pub const W4A16_MOE_SM80: &str = include_str!(concat!(env!("OUT_DIR"), "/w4a16_moe.sm80.ptx"));

/// The W4A16 MoE module as PTX for compute capability 9.x and newer (`.target sm_90`).
#[cfg(feature = "cuda")]
pub const W4A16_MOE_SM90: &str = include_str!(concat!(env!("OUT_DIR"), "/w4a16_moe.sm90.ptx"));

/// The PTX to load on a device of compute capability `major.minor`, or `None` below 8.0 (the
/// kernels need `mma.sync` with BF16 and `cp.async`).
#[cfg(feature = "cuda")]
pub fn ptx_for(major: i32, _minor: i32) -> Option<&'static str> {
    match major {
        ..=7 => None,
        8 => Some(W4A16_MOE_SM80),
        _ => Some(W4A16_MOE_SM90),
    }
}
