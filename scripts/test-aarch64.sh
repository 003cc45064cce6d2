#!/usr/bin/env bash
# The release tests of the whole workspace built for aarch64 Linux and run on this x86_64
# machine under qemu's user-mode emulation: the portable kernels (no x86 SIMD) against the same
# f64 references and transformers goldens as on x86. Installs what it lacks: the Rust target,
# and (Debian or Ubuntu, as root) gcc-aarch64-linux-gnu and qemu-user. Arguments go to
# `cargo test`, e.g. `bash scripts/test-aarch64.sh --test model_parity`. About 20 minutes on 2
# cores (the build, then every test emulated); not part of scripts/test.sh, which type-checks
# the library for aarch64 instead.
#
# The emulated CPU is a Cortex-A72 (ARMv8.0, no FP16 arithmetic; QEMU_CPU overrides it). On a
# CPU with FP16 arithmetic (qemu's `max`, Apple M-series, Graviton 2 and later) Candle's F16
# matmul (gemm-f16) multiplies and accumulates in F16, and the F16 leg of
# multi_sequence::batched_sequences_match_solo_on_the_fixtures differs from solo by 0.27 (the
# test allows 0.05; 0.0048 with F32 accumulation). On the Cortex-A72 Candle's Q4K CPU matmul
# dies of SIGILL (its NEON path runs `sdot`, which ARMv8.0 lacks, without asking the CPU), so
# routed_experts' ggml_experts_copied_compute_the_same, which runs it, is skipped; and so are
# three tests that start the example binaries as child processes, which qemu-user cannot run.
set -euo pipefail
cd "$(dirname "$0")/.."
target=aarch64-unknown-linux-gnu
if ! command -v aarch64-linux-gnu-gcc >/dev/null || ! command -v qemu-aarch64 >/dev/null; then
    if [[ $(id -u) != 0 ]] || ! command -v apt-get >/dev/null; then
        echo "error: needs aarch64-linux-gnu-gcc and qemu-aarch64" \
            "(Debian: apt-get install gcc-aarch64-linux-gnu qemu-user)" >&2
        exit 1
    fi
    apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q gcc-aarch64-linux-gnu qemu-user >/dev/null
fi
rustup target add "$target" >/dev/null
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L /usr/aarch64-linux-gnu"
export QEMU_CPU=${QEMU_CPU:-cortex-a72}
cargo test --release --target "$target" --workspace "$@" -- \
    --skip ggml_experts_copied_compute_the_same \
    --skip cpu_peak_rss_is_inside_the_plan \
    --skip parity_exits_with_its_verdict \
    --skip quantize_writes_its_pack_into_the_folder_it_creates \
    --skip generate_ends_quietly_when_its_reader_goes_away \
    --skip contradictory_flags_are_refused \
    --skip a_vanishing_top_p_keeps_the_top_token
