#!/usr/bin/env bash
# The project's test command: format check, clippy with -D warnings (and on the library for
# aarch64 Linux, macOS on Apple silicon and Windows), the API docs with rustdoc's warnings as errors (broken or private
# intra-doc links), release tests. Clippy runs inside the release build of every target
# (scripts/ci-lib.sh), so that build is not repeated;
# rustdoc needs the dependencies' metadata in the dev profile (about 50 s cold on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/ci-lib.sh
source scripts/ci-lib.sh
# The library on three other targets, type-checked with clippy -D warnings (no linker or C
# compiler needed): aarch64 Linux, which runs the portable kernels, macOS on Apple silicon, whose
# libc lacks Linux's mmap and madvise flags, and Windows, which has no madvise.
cross_check() {
    local target
    for target in aarch64-unknown-linux-gnu aarch64-apple-darwin x86_64-pc-windows-gnu; do
        rustup target add "$target" >/dev/null
        echo "-- $target"
        cargo clippy --quiet --target "$target" -p candle-qmoe --all-targets -- -D warnings
    done
}
stage "fmt" cargo fmt --all -- --check
stage "clippy -D warnings + release build (all targets)" \
    with_clippy cargo build --release --workspace --all-targets
stage "library for aarch64 Linux, macOS and Windows (clippy -D warnings)" cross_check
stage "rustdoc -D warnings (API docs)" env RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --workspace
stage "release tests" with_clippy cargo test --release --workspace
stage "server end to end (openai client)" with_clippy bash scripts/test-server.sh
