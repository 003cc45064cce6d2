#!/usr/bin/env bash
# CI for the `cuda` feature on a machine without a GPU (DESIGN.md §5):
#   * sets up the CUDA 13.0 toolchain from PyPI wheels (cached) and the libcuda stub,
#   * clippy with -D warnings on every target with the feature on,
#   * builds every target (candle's and our kernels compile to PTX/objects with nvcc; release
#     only, so candle-kernels' nvcc work is done once),
#   * runs the tests: the GPU tests report themselves as ignored ("SKIPPED: no CUDA device"),
#     the PTX checks and every CPU test run and must pass,
#   * runs the kernel source under the host emulator (scripts/kernel-emu.sh --quick), then a few
#     small cases under ThreadSanitizer and AddressSanitizer (--sanitize): shared-memory races
#     and out-of-bounds accesses.
# The non-cuda build and tests are scripts/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/cuda-env.sh
source scripts/cuda-env.sh
start=$SECONDS
cargo clippy --release --workspace --all-targets --features cuda -- -D warnings
echo "test-cuda: clippy done after $((SECONDS - start)) s"
cargo build --release --workspace --all-targets --features cuda
echo "test-cuda: build done after $((SECONDS - start)) s"
cargo test --release --workspace --features cuda
echo "test-cuda: tests done after $((SECONDS - start)) s"
bash scripts/kernel-emu.sh --quick
echo "test-cuda: emulated kernels done after $((SECONDS - start)) s"
bash scripts/kernel-emu.sh --sanitize
echo "test-cuda: sanitized emulated kernels done after $((SECONDS - start)) s"
