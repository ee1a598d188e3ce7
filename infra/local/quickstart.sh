#!/usr/bin/env bash
# The quick start: installs (when missing) and starts the local stack, builds Takosumi,
# starts the API and the plan, gate, approve, apply, drift and sweep functions, then takes the example Capsule
# infra/examples/network through plan -> apply with the `takosumi` CLI and prints both
# Run records (the apply shows `vpc = "vpc-eu"`). The services keep running afterwards;
# infra/local/stop.sh stops everything.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
STACK=${TAKOSUMI_STACK:-/var/tmp/takosumi-stack}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/var/tmp/takosumi-target}
export SQLX_OFFLINE=true
log() { printf 'quickstart: %s\n' "$*" >&2; }
if ! command -v cargo >/dev/null 2>&1 && [ -x "$HOME/.cargo/bin/cargo" ]; then
    export PATH=$HOME/.cargo/bin:$PATH
fi

bash "$ROOT/infra/local/install.sh" </dev/null
bash "$ROOT/infra/local/start.sh" </dev/null
# shellcheck disable=SC1091
. "$ROOT/infra/local/env.sh"

log "building Takosumi (first build takes several minutes)"
(cd "$ROOT" && cargo build --workspace --bins --quiet)
BIN=$CARGO_TARGET_DIR/debug

# (Re)start the four processes so they run this build.
mkdir -p "$STACK/logs" "$STACK/pids"
for step in api plan gate approve apply drift sweep; do
    pid_file=$STACK/pids/$step.pid
    if [ -f "$pid_file" ] && kill -0 "$(cat "$pid_file")" 2>/dev/null; then
        kill "$(cat "$pid_file")" 2>/dev/null || true
        for _ in $(seq 1 40); do kill -0 "$(cat "$pid_file")" 2>/dev/null || break; sleep 0.25; done
    fi
    nohup setsid "$BIN/takosumi-$step" >>"$STACK/logs/$step.log" 2>&1 </dev/null &
    echo $! >"$pid_file"
done
for _ in $(seq 1 120); do
    curl -sf "$TAKOSUMI_DEPLOY_CONTROL_URL/healthz" >/dev/null 2>&1 && break
    sleep 0.25
done
curl -sf "$TAKOSUMI_DEPLOY_CONTROL_URL/healthz" >/dev/null ||
    { log "the API did not come up; see $STACK/logs/api.log"; exit 1; }
log "API up at $TAKOSUMI_DEPLOY_CONTROL_URL (logs in $STACK/logs)"

# The example Capsule lives in a Git repository; make one from infra/examples/network, afresh
# each time: one left from before may borrow objects (alternates) from a path the checkout's
# sandbox does not see, and its checkout would fail.
REPO=${TAKOSUMI_REPOS:-/var/tmp/takosumi-repos}/quickstart
rm -rf "$REPO"
mkdir -p "$REPO/infra/network"
git -C "$REPO" init -q -b main
cp "$ROOT/infra/examples/network/main.tf" "$REPO/infra/network/main.tf"
git -C "$REPO" add -A
git -C "$REPO" -c user.email=quickstart@takosumi.local -c user.name=quickstart \
    commit -q -m "network example" >/dev/null 2>&1 || true

takosumi() { "$BIN/takosumi" "$@"; }
json_id() { python3 -c 'import json,sys; print(json.load(sys.stdin)["id"])'; }

WS=$(takosumi --json workspace create "quickstart-$(date +%s)" | json_id)
CAP=$(takosumi --json capsule create --workspace "$WS" --name network --repo "file://$REPO" \
    --branch main --dir infra/network --tool terraform --var region=eu | json_id)
log "workspace $WS, capsule $CAP"

echo "== plan =="
PLAN=$(takosumi --json plan "$CAP" | json_id)
takosumi wait "$PLAN"
echo
echo "== apply =="
APPLY=$(takosumi --json apply "$PLAN" | json_id)
takosumi wait "$APPLY"
echo
log "done. Try: takosumi status $APPLY | takosumi logs $PLAN | takosumi events $APPLY"
log "(source infra/local/env.sh first to set TAKOSUMI_DEPLOY_CONTROL_URL and _TOKEN; the CLI is $BIN/takosumi)"
log "the dashboard: ${TAKOSUMI_DEPLOY_CONTROL_URL:-http://127.0.0.1:8080}/ (sign in with TAKOSUMI_ADMIN_TOKEN from infra/local/env.sh)"
log "stop everything with infra/local/stop.sh"
