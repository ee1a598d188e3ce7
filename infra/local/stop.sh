#!/usr/bin/env bash
# Stops the local stack: Takosumi processes started by quickstart.sh, s3s-fs (pid file), RabbitMQ,
# Postgres.
# Data stays in $STACK and in the services' own data folders; start.sh brings it all back.
set -euo pipefail

STACK=${TAKOSUMI_STACK:-/var/tmp/takosumi-stack}

log() { printf 'stop: %s\n' "$*" >&2; }
[ "$(id -u)" = 0 ] || { log "ERROR: run as root"; exit 1; }

# --- Takosumi processes started by quickstart.sh ---
for pid_file in "$STACK"/pids/*.pid; do
    [ -f "$pid_file" ] || continue
    pid=$(cat "$pid_file")
    case "$(cat "/proc/$pid/comm" 2>/dev/null)" in
        takosumi-*)
            log "stopping $(basename "$pid_file" .pid) (pid $pid)"
            kill "$pid" 2>/dev/null || true
            ;;
    esac
    rm -f "$pid_file"
done

# --- s3s-fs ---
PID_FILE=$STACK/s3s.pid
if [ -f "$PID_FILE" ]; then
    pid=$(cat "$PID_FILE")
    if [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = s3s-fs ]; then
        log "stopping s3s-fs (pid $pid)"
        kill "$pid"
        for _ in $(seq 1 20); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.25
        done
        if kill -0 "$pid" 2>/dev/null; then
            log "s3s-fs did not exit on TERM; sending KILL"
            kill -9 "$pid" 2>/dev/null || true
        fi
    else
        log "s3s-fs not running (stale pid file)"
    fi
    rm -f "$PID_FILE"
else
    log "s3s-fs: no pid file ($PID_FILE), nothing to stop"
fi

# --- RabbitMQ ---
if rabbitmq-diagnostics -q ping --timeout 5 >/dev/null 2>&1; then
    log "stopping RabbitMQ"
    rabbitmqctl -q stop >&2 || log "WARNING: rabbitmqctl stop failed"
    # rabbitmqctl returns before the Erlang VM has exited; wait so a following start.sh is clean
    for _ in $(seq 1 40); do
        pgrep -u rabbitmq -x beam.smp >/dev/null || break
        sleep 0.5
    done
else
    log "RabbitMQ not running"
fi

# --- Postgres ---
if [ -d /etc/postgresql ]; then
    for dir in /etc/postgresql/*/main; do
        [ -d "$dir" ] || continue
        ver=$(basename "$(dirname "$dir")")
        if pg_ctlcluster --skip-systemctl-redirect "$ver" main status >/dev/null 2>&1; then
            log "stopping Postgres $ver/main"
            pg_ctlcluster --skip-systemctl-redirect "$ver" main stop >&2 ||
                log "WARNING: pg_ctlcluster $ver main stop failed"
        else
            log "Postgres $ver/main not running"
        fi
    done
fi
log "stopped"
