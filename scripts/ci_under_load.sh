#!/usr/bin/env bash
# Issue 25's acceptance 3: `.ci/run` on a clean clone passes RUNS times in a row (default 3) while other
# processes keep every core busy. The load: one Python busy loop per core (os.cpu_count(), at least 2),
# started before the first run and killed at the end; each run gets a fresh clone of SOURCE (default
# /work/main) in its own temporary directory, so no build tree or cache of an earlier run is reused.
#
#   bash scripts/ci_under_load.sh [SOURCE] [RUNS]        # log: $LOG (default /tmp/ci_under_load.<time>.log)
#
# Exit status 0 only when every run passed. Each run's output is kept in $LOG's folder as run<k>.log;
# the summary (pass/fail, tests passed, seconds, the load's CPU share) is appended to $LOG.
# `.ci/run` installs each clone editable into this machine's Python (as CI does); the clones are removed
# afterwards, so at the end the editable install is pointed back at SOURCE (RESTORE=0 skips that).
set -u
set -o pipefail

SOURCE=${1:-/work/main}
RUNS=${2:-3}
STAMP=$(date -u +%Y%m%dT%H%M%SZ)
LOG=${LOG:-/tmp/ci_under_load.$STAMP.log}
WORK=$(mktemp -d /tmp/ci_under_load.XXXXXX)
LOGDIR=$(dirname "$LOG")
CORES=$(python3 -c 'import os; print(max(2, os.cpu_count() or 1))')
PIDS=()

say() { echo "$*" | tee -a "$LOG"; }

stop_load() {
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null; done
    for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null; done
    PIDS=()
}
cleanup() { stop_load; rm -rf "$WORK"; }
trap cleanup EXIT
trap 'exit 130' INT TERM

sha=$(git -C "$SOURCE" rev-parse HEAD)
say "ci_under_load: $RUNS runs of .ci/run on clean clones of $SOURCE at $sha, $CORES busy loops, $(date -u)"

# The load: a pure-Python busy loop per core (nice 0, like the CI job), for the whole session.
for _ in $(seq "$CORES"); do
    python3 -c 'while True: pass' &
    PIDS+=($!)
done
say "load: busy-loop pids ${PIDS[*]}"

read_cpu() { awk '/^cpu / { print $2 + $3 + $4 + $6 + $7 + $8, $5 }' /proc/stat; }
load_ticks() {  # user+system ticks of the busy loops so far
    local total=0 pid
    for pid in "${PIDS[@]}"; do
        total=$(( total + $(awk '{ print $14 + $15 }' "/proc/$pid/stat" 2>/dev/null || echo 0) ))
    done
    echo "$total"
}

failed=0
for k in $(seq "$RUNS"); do
    clone="$WORK/run$k"
    git clone -q "$SOURCE" "$clone" || { say "run $k: clone failed"; failed=1; continue; }
    read -r busy0 idle0 < <(read_cpu)
    lt0=$(load_ticks)
    t0=$(date +%s)
    (cd "$clone" && bash .ci/run) >"$LOGDIR/run$k.log" 2>&1
    rc=$?
    t1=$(date +%s)
    read -r busy1 idle1 < <(read_cpu)
    lt1=$(load_ticks)
    summary=$(grep -E "^[0-9]+ (passed|failed)|passed|failed|error" "$LOGDIR/run$k.log" | tail -n 1)
    share=$(awk -v l=$((lt1 - lt0)) -v b=$((busy1 - busy0)) -v i=$((idle1 - idle0)) \
        'BEGIN { if (b + i > 0) printf "%.0f%%", 100 * l / (b + i); else print "?" }')
    if [ "$rc" -eq 0 ]; then word=PASSED; else word="FAILED (exit $rc)"; failed=1; fi
    say "run $k: $word in $((t1 - t0)) s; $summary; the load took $share of all CPU time meanwhile; log $LOGDIR/run$k.log"
    rm -rf "$clone"
done
stop_load
if [ "${RESTORE:-1}" = 1 ]; then
    say "restoring the editable install of $SOURCE (the runs' clones are gone)"
    (cd "$SOURCE" && python3 -m pip install -q --no-build-isolation --no-deps -e .) >>"$LOG" 2>&1 \
        || say "WARNING: could not restore the editable install of $SOURCE"
fi
if [ "$failed" -eq 0 ]; then
    say "ci_under_load: all $RUNS runs passed under load at $sha"
else
    say "ci_under_load: NOT all runs passed at $sha"
fi
exit "$failed"
