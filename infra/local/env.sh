#!/usr/bin/env bash
# Source this file (`. infra/local/env.sh`) to get the local stack's TAKOSUMI_* settings and PATH.
# It only sources $STACK/env.sh, written by start.sh. No `set -euo pipefail` here on purpose:
# it would change the options of the shell that sources it.
_takosumi_env=${TAKOSUMI_STACK:-/var/tmp/takosumi-stack}/env.sh
if [ -f "$_takosumi_env" ]; then
    # shellcheck disable=SC1090
    . "$_takosumi_env"
    unset _takosumi_env
else
    echo "env: $_takosumi_env is missing: run infra/local/start.sh first" >&2
    unset _takosumi_env
    # shellcheck disable=SC2317 # exit only when run instead of sourced
    return 1 2>/dev/null || exit 1
fi
