#!/usr/bin/env bash
# The project's test command: format check, clippy with -D warnings, release tests.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo fmt --all -- --check
cargo clippy --release --workspace --all-targets -- -D warnings
cargo test --release --workspace
