#!/usr/bin/env bash
# CI for the `cuda` feature on a machine without a GPU (docs/architecture.md §8):
#   * sets up the CUDA 13.0 toolchain from PyPI wheels (cached) and the libcuda stub,
#   * builds every target with the feature on, clippy -D warnings inside that build
#     (scripts/ci-lib.sh; candle's and our kernels compile to PTX with nvcc; release only, so
#     candle-kernels' nvcc work is done once),
#   * runs the tests: the GPU tests report themselves as ignored ("SKIPPED: no CUDA device"),
#     the PTX checks and every CPU test run and must pass,
#   * runs the kernel source under the host emulator (scripts/kernel-emu.sh --quick), then a few
#     small cases under ThreadSanitizer and AddressSanitizer (--sanitize): shared-memory races
#     and out-of-bounds accesses. The emulator needs only the CUDA headers, so it runs while
#     cargo builds; its log is printed when it is waited for.
# The non-cuda build and tests are scripts/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/ci-lib.sh
source scripts/ci-lib.sh
# shellcheck source=scripts/cuda-env.sh
stage "CUDA 13.0 toolchain (PyPI wheels, cached)" source scripts/cuda-env.sh
mkdir -p target
emu_log=target/kernel-emu.log
emu_start=$SECONDS
# In its own process group (setsid), so a failed stage can stop it with every g++ and emulator
# process it started.
setsid -w bash -c 'bash scripts/kernel-emu.sh --quick && bash scripts/kernel-emu.sh --sanitize' \
    >"$emu_log" 2>&1 &
emu=$!
trap 'kill -- -"$emu" 2>/dev/null || true' EXIT
stage "clippy -D warnings + release build (all targets, cuda)" \
    with_clippy cargo build --release --workspace --all-targets --features cuda
stage "release tests (cuda)" with_clippy cargo test --release --workspace --features cuda
emulator() {
    local rc=0
    wait "$emu" || rc=$?
    trap - EXIT
    cat "$emu_log"
    echo "kernel emulator (--quick, then --sanitize) finished $((SECONDS - emu_start)) s after it started"
    return "$rc"
}
stage "kernel emulator and sanitizers (started with the build)" emulator
