#!/usr/bin/env bash
# The project's test command: format check, clippy with -D warnings, the API docs with
# rustdoc's warnings as errors (broken or private intra-doc links), release tests. Clippy runs
# inside the release build of every target (scripts/ci-lib.sh), so that build is not repeated;
# rustdoc needs the dependencies' metadata in the dev profile (about 50 s cold on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/ci-lib.sh
source scripts/ci-lib.sh
stage "fmt" cargo fmt --all -- --check
stage "clippy -D warnings + release build (all targets)" \
    with_clippy cargo build --release --workspace --all-targets
stage "rustdoc -D warnings (API docs)" env RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --workspace
stage "release tests" with_clippy cargo test --release --workspace
stage "server end to end (openai client)" with_clippy bash scripts/test-server.sh
