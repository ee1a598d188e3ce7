#!/usr/bin/env bash
# The one test command: installs and starts the local stack when needed, then builds every binary
# and runs the whole workspace's tests against it. Extra arguments go to `cargo test`, e.g.
#   infra/local/test.sh -- --nocapture
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"

log() { printf 'test: %s\n' "$*" >&2; }

bash infra/local/install.sh
bash infra/local/start.sh
STACK=${TAKOSUMI_STACK:-/var/tmp/takosumi-stack}
# shellcheck disable=SC1091
. "$STACK/env.sh"
bash infra/local/validate-deploy.sh # deploy/: kustomize renders, Kubernetes + KEDA schemas, checkov

if ! command -v cargo >/dev/null 2>&1 && [ -x "$HOME/.cargo/bin/cargo" ]; then
    PATH=$HOME/.cargo/bin:$PATH
fi
command -v cargo >/dev/null 2>&1 || { log "ERROR: cargo not found: install the Rust toolchain"; exit 1; }

export SQLX_OFFLINE=true
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/var/tmp/takosumi-target}

# A relay worker reaches the control plane only through the API: nothing that links a
# database driver, the broker client or the S3 SDK may be in its dependency graph.
relay_deps=$(cargo tree -p takosumi-relay -e normal --prefix none)
forbidden=$(grep -E '^(sqlx|lapin|aws-sdk)' <<<"$relay_deps" | sort -u || true)
if [ -n "$forbidden" ]; then
    log "ERROR: takosumi-relay depends on sqlx, lapin or the S3 SDK:"
    printf '%s\n' "$forbidden" >&2
    exit 1
fi

log "cargo build --workspace --bins (target dir $CARGO_TARGET_DIR)"
cargo build --workspace --bins
log "cargo test --workspace $*"
# The fault and security suites add their figures here; the table is printed at the end.
export TAKOSUMI_SUITE_SUMMARY=${TAKOSUMI_SUITE_SUMMARY:-$CARGO_TARGET_DIR/takosumi-suite-summary.tsv}
rm -f "$TAKOSUMI_SUITE_SUMMARY"
status=0
cargo test --workspace "$@" || status=$?
bash infra/local/suite-summary.sh
exit "$status"
