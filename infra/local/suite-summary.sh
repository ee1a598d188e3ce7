#!/usr/bin/env bash
# Prints the fault and security suites' figures as a table, with the totals the suite
# promises (faults survived, inputs tried, leaks found = 0). The tests append one line per
# figure (`suite<TAB>figure<TAB>value`) to $CARGO_TARGET_DIR/takosumi-suite-summary.tsv
# (or $TAKOSUMI_SUITE_SUMMARY); infra/local/test.sh empties it first and runs this after.
set -euo pipefail

FILE=${TAKOSUMI_SUITE_SUMMARY:-${CARGO_TARGET_DIR:-/var/tmp/takosumi-target}/takosumi-suite-summary.tsv}
[ -s "$FILE" ] || { echo "suite summary: no figures recorded ($FILE)"; exit 0; }

# A breakdown of a figure (the fuzz's `inputs: <caller>`, `routes hit`) is shown but not
# summed: only the figures the totals name are.
echo "== Fault and security suite =="
sort -s -t$'\t' -k1,1 "$FILE" | awk -F'\t' '
    NF < 3 { next }
    { printf "  %-10s %-45s %s\n", $1, $2, $3 }
    $2 ~ /SIGKILLs survived|restarts survived|hard crashes survived|SIGTERMs survived|poison messages|tampered artifacts refused/ { faults += $3 }
    $2 ~ /inputs tried|role matrix: calls/ { inputs += $3 }
    $2 ~ /leaks found/ { leaks += $3; swept = 1 }
    $2 ~ /runs lost|double applies|5xx or changed-on-4xx found/ { broken += $3 }
    END {
        print  "  ------------------------------------------------------------------"
        printf "  faults survived %d | inputs tried %d | leaks found %s | promises broken %d\n",
            faults, inputs, (swept ? leaks : "not measured"), broken
    }
'
