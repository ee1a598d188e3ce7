#!/usr/bin/env bash
# The benchmarks: installs (when missing) and starts the local stack, installs wrk
# from apt when missing (figure 6 falls back to a built-in load loop without it), builds the
# release binaries, runs the Criterion benches (`cargo bench -p takosumi-bench`), then the
# end-to-end bench binary, which prints every figure beside its reference as markdown and
# also writes it to $BENCH_OUT (default $STACK/bench-results.md). Arguments go to the bench
# binary, e.g. `infra/local/bench.sh --runs 50` or `--only 1,2`. About 5 minutes on
# 2 cores once built (a cold release build adds 10-20 minutes); figures never fail the
# script, only a broken pipeline does.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"
STACK=${TAKOSUMI_STACK:-/var/tmp/takosumi-stack}
log() { printf 'bench: %s\n' "$*" >&2; }
if ! command -v cargo >/dev/null 2>&1 && [ -x "$HOME/.cargo/bin/cargo" ]; then
    PATH=$HOME/.cargo/bin:$PATH
fi

bash infra/local/install.sh </dev/null
bash infra/local/start.sh </dev/null
# shellcheck disable=SC1091
. "$STACK/env.sh"

if ! command -v wrk >/dev/null 2>&1; then
    log "installing wrk (apt) for figure 6"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk; } >&2 ||
        log "wrk could not be installed: figure 6 uses the bench binary's own load loop"
fi

export SQLX_OFFLINE=${SQLX_OFFLINE:-true}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/var/tmp/takosumi-target}

log "cargo build --release (the step binaries, the bench binary, the no-op tool, the Criterion benches)"
# takosumi-runner's one binary is the in-sandbox step launcher the handlers start.
# One command for bins and benches: the benches' dev-dependencies change some crates' features,
# and building both together lets `cargo bench` below reuse every artifact.
cargo build --release --bins --benches -p takosumi-runner -p takosumi-api -p takosumi-plan -p takosumi-gate -p takosumi-apply -p takosumi-sweep -p takosumi-bench
log "cargo bench -p takosumi-bench (Criterion: seal/unseal)"
cargo bench -p takosumi-bench
log "takosumi-bench $*"
"$CARGO_TARGET_DIR/release/takosumi-bench" --out "${BENCH_OUT:-$STACK/bench-results.md}" "$@"
