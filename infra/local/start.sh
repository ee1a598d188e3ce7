#!/usr/bin/env bash
# Starts the local stack (Postgres, RabbitMQ with its management API, s3s-fs) when not already
# running, waits until each answers, and writes $STACK/env.sh with every TAKOSUMI_* setting.
# Idempotent: a second run on a running stack takes about a second. Run install.sh first.
#   CACHE=${TAKOSUMI_CACHE:-/var/tmp/takosumi-cache}   installed tools (install.sh)
#   STACK=${TAKOSUMI_STACK:-/var/tmp/takosumi-stack}   service data, logs, generated secrets
set -euo pipefail

CACHE=${TAKOSUMI_CACHE:-/var/tmp/takosumi-cache}
STACK=${TAKOSUMI_STACK:-/var/tmp/takosumi-stack}
S3S=$CACHE/cargo-bin/bin/s3s-fs
S3_PORT=8014
S3_BUCKET=takosumi
MGMT_URL=http://127.0.0.1:15672

log() { printf 'start: %s\n' "$*" >&2; }
die() {
    printf 'start: ERROR: %s\n' "$*" >&2
    exit 1
}

[ "$(id -u)" = 0 ] || die "run as root (the services run as their own users)"
for tool in pg_ctlcluster rabbitmq-server "$S3S" "$CACHE/tools/bin/terraform"; do
    command -v "$tool" >/dev/null 2>&1 || die "$tool not found: run infra/local/install.sh first"
done

umask 077
mkdir -p "$STACK/logs" "$STACK/work" "$STACK/s3/$S3_BUCKET"
# Local Git repositories for file:// Capsule sources, outside $STACK (which holds secrets):
# the runner sandbox is shown this directory read-only.
REPOS=${TAKOSUMI_REPOS:-/var/tmp/takosumi-repos}
mkdir -p "$REPOS" && chmod 0755 "$REPOS"
chmod 0700 "$STACK"

# --- generated secrets, created once ---------------------------------------------------------------
SECRETS=$STACK/secrets
rand_hex() { od -An -tx1 -N"$1" /dev/urandom | tr -d ' \n'; }
touch "$SECRETS"
chmod 0600 "$SECRETS"
# shellcheck disable=SC1090
. "$SECRETS"
changed=
if [ -z "${S3_SECRET_KEY:-}" ]; then
    S3_SECRET_KEY=$(rand_hex 16) && echo "S3_SECRET_KEY=$S3_SECRET_KEY" >>"$SECRETS" && changed=1
fi
if [ -z "${SEAL_KEY:-}" ]; then
    SEAL_KEY=$(head -c32 /dev/urandom | base64 -w0) && echo "SEAL_KEY=$SEAL_KEY" >>"$SECRETS" && changed=1
fi
# The API signs every Run's evidence statement with it (an Ed25519 seed: any 32 random bytes).
if [ -z "${EVIDENCE_KEY:-}" ]; then
    EVIDENCE_KEY=$(head -c32 /dev/urandom | base64 -w0) && echo "EVIDENCE_KEY=$EVIDENCE_KEY" >>"$SECRETS" && changed=1
fi
# Postgres and RabbitMQ get passwords of their own: Run sandboxes share the network, so
# nothing the stack serves on loopback may accept a well-known password.
if [ -z "${PG_PASSWORD:-}" ]; then
    PG_PASSWORD=$(rand_hex 16) && echo "PG_PASSWORD=$PG_PASSWORD" >>"$SECRETS" && changed=1
fi
if [ -z "${RABBIT_PASSWORD:-}" ]; then
    RABBIT_PASSWORD=$(rand_hex 16) && echo "RABBIT_PASSWORD=$RABBIT_PASSWORD" >>"$SECRETS" && changed=1
fi
if [ -z "${ADMIN_TOKEN:-}" ]; then
    ADMIN_TOKEN=tks_$(rand_hex 20) && echo "ADMIN_TOKEN=$ADMIN_TOKEN" >>"$SECRETS" && changed=1
fi
[ -z "$changed" ] || log "generated secrets in $SECRETS"

wait_for() { # <seconds> <command...>: true once the command succeeds
    local secs=$1 i
    shift
    for ((i = 0; i < secs * 2; i++)); do
        if "$@" >/dev/null 2>&1; then return 0; fi
        sleep 0.5
    done
    return 1
}

# --- Postgres ------------------------------------------------------------------------------------
pg_ready() { pg_isready -q -h 127.0.0.1 -p 5432; }
if ! pg_ready; then
    # shellcheck disable=SC2012
    PG_VER=$(ls /etc/postgresql 2>/dev/null | head -n1)
    if [ -z "$PG_VER" ] || [ ! -d "/etc/postgresql/$PG_VER/main" ]; then
        # shellcheck disable=SC2012
        PG_VER=$(ls /usr/lib/postgresql 2>/dev/null | sort -V | tail -n1)
        [ -n "$PG_VER" ] || die "no PostgreSQL server installed: run infra/local/install.sh"
        log "creating Postgres cluster $PG_VER/main"
        pg_createcluster "$PG_VER" main >&2
    fi
    log "starting Postgres $PG_VER/main"
    pg_ctlcluster --skip-systemctl-redirect "$PG_VER" main start >&2 ||
        log "pg_ctlcluster start returned an error; waiting for Postgres anyway"
    wait_for 30 pg_ready ||
        die "Postgres not ready after 30 s: see /var/log/postgresql/postgresql-$PG_VER-main.log"
fi
pg_super() { (cd / && runuser -u postgres -- psql -X -q -v ON_ERROR_STOP=1 -tA "$@"); }
if [ "$(pg_super -c "select 1 from pg_roles where rolname = 'takosumi'")" != 1 ]; then
    log "creating Postgres role takosumi"
    pg_super -c "create role takosumi login superuser" >&2
fi
# every start: the generated password (replaces the well-known one older stacks had)
pg_super -c "alter role takosumi password '$PG_PASSWORD'" >/dev/null
if [ "$(pg_super -c "select 1 from pg_database where datname = 'takosumi'")" != 1 ]; then
    log "creating Postgres database takosumi"
    pg_super -c "create database takosumi owner takosumi" >&2
fi

# --- RabbitMQ ------------------------------------------------------------------------------------
rabbit_up() { rabbitmq-diagnostics -q ping --timeout 5; }
mgmt_up() { curl -sf -m 3 -o /dev/null -u "takosumi:$RABBIT_PASSWORD" "$MGMT_URL/api/overview"; }
rabbit_start() {
    if ! rabbit_up >/dev/null 2>&1; then
        log "starting RabbitMQ"
        rabbitmq-server -detached >&2 || die "rabbitmq-server -detached failed: see /var/log/rabbitmq/"
        wait_for 60 rabbit_up ||
            die "RabbitMQ not answering ping after 60 s: see /var/log/rabbitmq/ (stop it with rabbitmqctl stop and retry)"
    fi
    rabbitmqctl -q await_startup --timeout 60 >&2 ||
        die "RabbitMQ did not finish starting within 60 s: see /var/log/rabbitmq/"
    # A user of the stack's own (administrator: the tests create a vhost each); `guest` goes,
    # since anything on loopback, a Run's sandbox included, could log in with it.
    if ! rabbitmqctl -q list_users 2>/dev/null | grep -q '^takosumi'; then
        log "creating RabbitMQ user takosumi"
        rabbitmqctl -q add_user takosumi "$RABBIT_PASSWORD" >/dev/null
    else
        rabbitmqctl -q change_password takosumi "$RABBIT_PASSWORD" >/dev/null
    fi
    rabbitmqctl -q set_user_tags takosumi administrator >/dev/null
    rabbitmqctl -q set_permissions -p / takosumi '.*' '.*' '.*' >/dev/null
    if rabbitmqctl -q list_users 2>/dev/null | grep -q '^guest'; then
        log "removing RabbitMQ's default guest user"
        rabbitmqctl -q delete_user guest >/dev/null
    fi
    if ! mgmt_up; then
        if ! grep -qs rabbitmq_management /etc/rabbitmq/enabled_plugins; then
            log "enabling rabbitmq_management on the running node"
            rabbitmq-plugins enable rabbitmq_management >&2
        fi
        wait_for 30 mgmt_up ||
            die "RabbitMQ management API ($MGMT_URL) not answering after 30 s: run infra/local/install.sh, then rabbitmqctl stop and rerun start.sh"
    fi
}
# The tests make a vhost each. A node that answers but no longer makes one (seen here with a
# few dozen vhosts that failed tests left, each with its quorum queues) fails every test a
# minute later, so it is found here, in 20 s at most.
vhost_made() {
    local probe="$MGMT_URL/api/vhosts/takosumi-start-probe"
    curl -sf -m 20 -o /dev/null -X PUT -u "takosumi:$RABBIT_PASSWORD" "$probe" &&
        curl -sf -m 20 -o /dev/null -X DELETE -u "takosumi:$RABBIT_PASSWORD" "$probe"
}
rabbit_start
if ! vhost_made; then
    # The local broker holds wake-ups only: Postgres is the source of truth, and a queued Run
    # whose wake-up is lost is woken again (TAKOSUMI_STUCK_QUEUED_SECS).
    mnesia=/var/lib/rabbitmq/mnesia
    log "RabbitMQ answers but makes no vhost within 20 s: stopping it and removing its data ($mnesia)"
    timeout 30 rabbitmqctl -q stop >&2 2>/dev/null || pkill -9 -u rabbitmq -f beam.smp || true
    wait_for 30 bash -c '! pgrep -u rabbitmq -f beam.smp >/dev/null' ||
        die "RabbitMQ did not stop: stop it (pkill -9 -u rabbitmq -f beam.smp) and rerun start.sh"
    find "$mnesia" -mindepth 1 -maxdepth 1 -exec rm -rf {} +
    rabbit_start
    vhost_made || die "RabbitMQ still makes no vhost after its data was reset: see /var/log/rabbitmq/"
fi

# --- s3s-fs ------------------------------------------------------------------------------------
s3_up() { (exec 3<>"/dev/tcp/127.0.0.1/$S3_PORT") 2>/dev/null; }
if ! s3_up; then
    # s3s-fs keeps each object's metadata beside the buckets, as
    # `.bucket-<base64url bucket>.object-<base64url key>.<kind>.json`, and leaves it there
    # when the object or its bucket is deleted: every test bucket's objects would stay on
    # disk as metadata (tens of thousands of files a test run). With the server stopped,
    # drop the metadata of objects that no longer exist.
    python3 - "$STACK/s3" <<'PY' || log "could not prune s3s-fs metadata (continuing)"
import base64, os, sys
root = sys.argv[1]
def name(b64):
    return base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4)).decode()
pruned = 0
for entry in os.listdir(root):
    bucket, sep, rest = entry.removeprefix(".bucket-").partition(".object-")
    if not entry.startswith(".bucket-") or not sep:
        continue
    try:
        path = os.path.join(root, name(bucket), name(rest.split(".", 1)[0]))
    except ValueError:
        continue
    if not os.path.lexists(path):
        os.unlink(os.path.join(root, entry))
        pruned += 1
if pruned:
    print(f"start: pruned the metadata of {pruned} deleted objects from s3s-fs's data", file=sys.stderr)
PY
    log "starting s3s-fs on 127.0.0.1:$S3_PORT (data in $STACK/s3)"
    nohup setsid "$S3S" --host 127.0.0.1 --port "$S3_PORT" --access-key takosumi \
        --secret-key "$S3_SECRET_KEY" "$STACK/s3" </dev/null >>"$STACK/logs/s3s.log" 2>&1 &
    echo $! >"$STACK/s3s.pid"
    wait_for 15 s3_up || die "s3s-fs not listening on $S3_PORT after 15 s: see $STACK/logs/s3s.log"
fi
code=$(curl -s -m 3 -o /dev/null -w '%{http_code}' "http://127.0.0.1:$S3_PORT/" || true)
case $code in
000 | "") die "port $S3_PORT is open but does not answer HTTP: see $STACK/logs/s3s.log" ;;
esac

# --- environment for tests and the server ----------------------------------------------------------
ENV_FILE=$STACK/env.sh
tmp=$(mktemp "$STACK/.env.XXXXXX")
{
    echo "# generated by infra/local/start.sh; source it (or infra/local/env.sh)"
    q() { printf 'export %s=%q\n' "$1" "$2"; }
    q TAKOSUMI_DATABASE_URL "postgres://takosumi:$PG_PASSWORD@127.0.0.1:5432/takosumi"
    q TAKOSUMI_PG_ADMIN_URL "postgres://takosumi:$PG_PASSWORD@127.0.0.1:5432/postgres"
    q TAKOSUMI_AMQP_URL "amqp://takosumi:$RABBIT_PASSWORD@127.0.0.1:5672/%2f"
    q TAKOSUMI_RABBITMQ_MGMT_URL "$MGMT_URL"
    q TAKOSUMI_RABBITMQ_MGMT_USER takosumi
    q TAKOSUMI_RABBITMQ_MGMT_PASSWORD "$RABBIT_PASSWORD"
    q TAKOSUMI_S3_ENDPOINT "http://127.0.0.1:$S3_PORT"
    q TAKOSUMI_S3_REGION us-east-1
    q TAKOSUMI_S3_ACCESS_KEY takosumi
    q TAKOSUMI_S3_SECRET_KEY "$S3_SECRET_KEY"
    q TAKOSUMI_S3_BUCKET "$S3_BUCKET"
    q TAKOSUMI_SEAL_KEY "$SEAL_KEY"
    q TAKOSUMI_SEAL_KEY_ID local-1
    q TAKOSUMI_EVIDENCE_KEY "$EVIDENCE_KEY"
    q TAKOSUMI_EVIDENCE_KEY_ID local-evidence-1
    q TAKOSUMI_TERRAFORM_BIN "$CACHE/tools/bin/terraform"
    q TAKOSUMI_TF_CLI_CONFIG "$CACHE/tools/terraformrc"
    q TAKOSUMI_WORK_DIR "$STACK/work"
    # the only host path (besides the system and the tool) a Run's sandbox may read:
    # local Git repositories served as file:// sources (the quick start's)
    q TAKOSUMI_SANDBOX_RO_PATHS "$REPOS"
    # and Capsules may name such local repositories (off unless set; local use only)
    q TAKOSUMI_ALLOW_FILE_REPOS true
    q TAKOSUMI_ADMIN_TOKEN "$ADMIN_TOKEN"
    q TAKOSUMI_LISTEN 127.0.0.1:8080
    q TAKOSUMI_DEPLOY_CONTROL_URL http://127.0.0.1:8080
    q TAKOSUMI_DEPLOY_CONTROL_TOKEN "$ADMIN_TOKEN"
    # shellcheck disable=SC2016 # $PATH expands when env.sh is sourced
    printf 'case ":$PATH:" in *:%q:*) ;; *) export PATH=%q:"$PATH" ;; esac\n' \
        "$CACHE/cargo-bin/bin" "$CACHE/cargo-bin/bin"
} >"$tmp"
chmod 0600 "$tmp"
mv -f "$tmp" "$ENV_FILE"

log "ready: postgres 127.0.0.1:5432, amqp 127.0.0.1:5672, mgmt $MGMT_URL, s3 http://127.0.0.1:$S3_PORT; env: $ENV_FILE"
