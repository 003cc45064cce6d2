#!/usr/bin/env bash
# The project's test command: format check, clippy with -D warnings, release tests. Clippy runs
# inside the release build of every target (scripts/ci-lib.sh), so nothing is compiled twice.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/ci-lib.sh
source scripts/ci-lib.sh
stage "fmt" cargo fmt --all -- --check
stage "clippy -D warnings + release build (all targets)" \
    with_clippy cargo build --release --workspace --all-targets
stage "release tests" with_clippy cargo test --release --workspace
stage "server end to end (openai client)" with_clippy bash scripts/test-server.sh
