# shellcheck shell=bash
# Sourced by scripts/test.sh and scripts/test-cuda.sh: stage timing, and a cargo run that is
# also the clippy run.

# stage NAME CMD...: runs CMD between two lines naming the stage; the second gives its time.
stage() {
    local name=$1 start=$SECONDS
    shift
    echo "==> stage: $name"
    "$@"
    echo "==> stage: $name: done in $((SECONDS - start)) s"
}

# with_clippy CMD...: runs a cargo command whose workspace crates are compiled by clippy-driver,
# as `cargo clippy` does, with every warning (rustc's and clippy's) an error. Unlike
# `cargo clippy` (a check build), a `cargo build` or `cargo test` run this way also produces the
# binaries, so the dependencies are compiled once, not once in check mode for clippy and again
# for the build. Run the build and the tests with the same wrapper so the tests reuse the build.
with_clippy() {
    local driver
    driver=$(command -v clippy-driver || rustup which clippy-driver) || {
        echo "clippy-driver not found: rustup component add clippy" >&2
        return 1
    }
    RUSTC_WORKSPACE_WRAPPER="$driver" CLIPPY_ARGS="-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__" "$@"
}
