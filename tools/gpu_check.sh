#!/usr/bin/env bash
# The GPU check, in one run on any machine with a CUDA GPU and torch installed: build and install this tree
# against that torch, print what was built, run the CUDA tests and the compute-sanitizer harness (memcheck,
# racecheck), then the benchmarks (VERL_DIR: verl's kernel folder, for the post-training board's verl rows).
# Everything is written under OUT (logs, junit, the results); nothing into the tree.
#   tools/gpu_check.sh OUT [bench_lce arguments, e.g. --shapes llama3_4k,xc6M]
set -uo pipefail
out=${1:?usage: tools/gpu_check.sh OUT [bench_lce arguments]}; shift
cd "$(dirname "$0")/.."
mkdir -p "$out"
status=0
step() {  # step NAME COMMAND...: run, log to OUT/NAME.log, remember a failure and go on
    local name=$1; shift
    echo "== $name: $*"
    "$@" >"$out/$name.log" 2>&1 || { echo "   $name failed (rc $?), see $out/$name.log"; status=1; }
}
step build pip install --no-build-isolation --no-deps .
step info python -P -m hugehead.info
step tests env HUGEHEAD_BENCH_IMPORT=installed python -P -m pytest -q -m cuda tests --junitxml "$out/junit.xml"
if command -v compute-sanitizer >/dev/null; then
    for tool in memcheck racecheck; do
        step "sanitizer_$tool" env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool "$tool" \
            --kernel-name kns=hugehead --error-exitcode 1 python -P -m tools.sanitize_case -q
    done
fi
step bench_lce env HUGEHEAD_BENCH_IMPORT=installed python -m bench.bench_lce --out "$out/results" "$@"
step split env HUGEHEAD_BENCH_IMPORT=installed python -m tools.split_lce --out "$out/results"
# VERL_DIR: verl's utils/kernel folder (from its wheel), for the post-training board's verl rows
step posttrain env HUGEHEAD_BENCH_IMPORT=installed python -m bench.bench_posttrain --out "$out/results" \
    ${VERL_DIR:+--verl-dir "$VERL_DIR"}
echo "gpu_check: $( ((status)) && echo 'a step failed' || echo 'every step passed' ); logs and results in $out"
exit $status
