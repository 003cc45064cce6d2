#!/usr/bin/env bash
# Runs the CUDA kernel source on the CPU under the host emulator (candle-qmoe-kernels/emu): the
# real w4a16_moe.cu, compiled by g++ with QMOE_EMU, on small random problems of both paths and
# all activation types, against a float64 reference computed from the slab bytes. cp.async
# copies land only at their cp.async.wait_group, so pipeline-accounting mistakes show too.
# Proves indexing and arithmetic without a GPU; races and speed still need the GPU check.
#   scripts/kernel-emu.sh [--quick]
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/cuda-env.sh
source scripts/cuda-env.sh # CUDA headers (cuda_fp16.h, cuda_bf16.h) only
mkdir -p target/kernel-emu
g++ -std=c++20 -O2 -pthread -Wall -Wno-unknown-pragmas -I"$CUDA_HOME/include" \
    candle-qmoe-kernels/emu/main.cpp -o target/kernel-emu/emu
target/kernel-emu/emu "$@"
