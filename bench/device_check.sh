#!/usr/bin/env bash
# One device call on the GPU machine: GPU facts, peer wheels, build, dispatcher registration, tests, and
# on request compute-sanitizer and the benchmark. Every step is timed and logged; a failed step does not
# stop the next ones, but the script exits 1 at the end if any failed.
#
#   OUT=/path/to/empty/dir [STAGES="..."] [BENCH_ARGS="..."] bash bench/device_check.sh
#
# Environment (all optional):
#   STAGES       steps to run, any of: smi peers build dispatch test sanitizer bench placement
#                (default "smi peers build dispatch test"); the order of the list does not matter.
#   BENCH_ARGS   extra arguments for python -m bench.bench_lce (e.g. "--shapes llama3_4k,xc1M").
#   DEADLINE_S   seconds this script may take in all (default 570, under the device tool's 600 s);
#                the test, sanitizer and bench steps get what is left.
#   TEST_ARGS    pytest arguments (default "tests -x -q -rs"); TEST_TIMEOUT caps pytest (default 360 s).
#   MAX_JOBS     parallel compile jobs (default 16). HUGEHEAD_CUDA defaults to ON here.
#   SANITIZER_TOOLS  compute-sanitizer tools to run in turn over bench/sanitize_case.py (default
#                "memcheck racecheck initcheck synccheck"); SANITIZER_TIMEOUT caps each (default 150 s);
#                SANITIZER_FILTER overrides the kernel filter (default: our kernels only, by name);
#                SANITIZE_ARGS the harness's arguments (default "-q").
#   EXTRA        extra steps after the others, "name=command|name=command" (each logged as a step and
#                given what is left of the deadline), e.g. "amp=python3 -m bench.bench_amp --out $OUT/amp".
#   HUGEHEAD_GIT_SHA the commit the benchmark JSON and this log record, over git's answer (set it: the device's
#                copy of the tree may carry a stale .git).
#   BUILD_WHEEL_DIR  the build step also leaves its wheel there (e.g. under $OUT, to come back);
#   HUGEHEAD_WHEEL   the build step installs this wheel (one an earlier call built from the same commit,
#                carried back) instead of building: a second call of a long benchmark saves the build.
#   HUGEHEAD_WHEEL_OVERLAY=1  with HUGEHEAD_WHEEL: the tree's hugehead/*.py then replace the installed ones
#                (a later commit that changed Python files only; check csrc/, setup.py, CMakeLists.txt first).
# What comes back under $OUT: check.log (every step's command, time, status and output tail),
# logs.tar.gz (full logs), junit.xml, results/lce.{json,md,png}, sanitizer/{version.txt,<tool>.log}.
# shellcheck disable=SC2317  # the step functions are called through "step NAME FUNCTION"
set -u
set -o pipefail

OUT=${OUT:?set OUT to the output folder}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 2
STAGES=${STAGES:-"smi peers build dispatch test"}
DEADLINE_S=${DEADLINE_S:-570}
TEST_ARGS=${TEST_ARGS:-"tests -x -q -rs"}
export MAX_JOBS=${MAX_JOBS:-16}
export HUGEHEAD_CUDA=${HUGEHEAD_CUDA:-ON}
SANITIZER_TOOLS=${SANITIZER_TOOLS:-"memcheck racecheck initcheck synccheck"}
PY=${PYTHON:-python3}
SITE=/tmp/site

mkdir -p "$OUT/logs"
LOG="$OUT/check.log"
LOGDIR="$OUT/logs"
T0=$(date +%s)
SUMMARY=()
FAILED=0
: >"$LOG"

say() { echo "$*" | tee -a "$LOG"; }
has_stage() { [[ " $STAGES " == *" $1 "* ]]; }
remaining() { echo $((DEADLINE_S - ($(date +%s) - T0))); }

# step NAME CMD...: run CMD (a command or a shell function) with its output in logs/NAME.log; append the
# command, duration, exit status and the output's tail to check.log. Returns CMD's status.
step() {
    local name=$1
    shift
    local t1 rc dt
    t1=$(date +%s.%N)
    say ""
    say "=== [$name] $(date -u +%H:%M:%S) (t+$(($(date +%s) - T0)) s): $*"
    "$@" >"$LOGDIR/$name.log" 2>&1
    rc=$?
    dt=$(awk -v a="$t1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
    tail -n "${TAIL_LINES:-40}" "$LOGDIR/$name.log" >>"$LOG"
    tail -n "${STDOUT_LINES:-6}" "$LOGDIR/$name.log" | sed 's/^/    /'
    if [ "$rc" -eq 0 ]; then
        SUMMARY+=("ok     $(printf '%-10s' "$name") ${dt} s")
    else
        SUMMARY+=("FAILED $(printf '%-10s' "$name") ${dt} s (exit $rc)")
        FAILED=1
    fi
    say "=== [$name] exit $rc after ${dt} s"
    return "$rc"
}

skip() {  # skip NAME REASON: a step that could not run counts as failed
    SUMMARY+=("FAILED $(printf '%-10s' "$1") skipped: $2")
    FAILED=1
    say "=== [$1] skipped: $2"
}

# ---------------------------------------------------------------------------------------------------
gpu_facts() {
    local rc=0
    nvidia-smi -L || rc=1
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv
    if command -v nvcc >/dev/null; then nvcc --version | tail -n 2; else echo "nvcc not on PATH"; fi
    "$PY" -P -c "import sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__, '| CUDA', torch.version.cuda, '| available', torch.cuda.is_available(), '| devices', torch.cuda.device_count()); sys.exit(0 if torch.cuda.is_available() else 1)" || rc=1
    "$PY" -P -c "import importlib.metadata as m
for d in ('triton', 'pytest', 'hypothesis', 'expecttest', 'matplotlib', 'numpy', 'cmake', 'ninja', 'pybind11', 'setuptools', 'packaging', 'transformers', 'lightning', 'safetensors', 'tqdm'):
    try: print(f'{d:<13}', m.version(d))
    except m.PackageNotFoundError: print(f'{d:<13} MISSING')"
    echo "CUDA_HOME=${CUDA_HOME:-} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-}"
    return "$rc"
}

install_peers() {
    # Pure-Python wheels brought along in .peers/ (peer libraries) and .whl/ (e.g. test dependencies);
    # --no-deps: the image's torch and triton stay as they are.
    local wheels=()
    for dir in .peers .whl; do
        [ -d "$dir" ] && for w in "$dir"/*.whl; do [ -e "$w" ] && wheels+=("$w"); done
    done
    if [ "${#wheels[@]}" -eq 0 ]; then
        echo "no wheels in .peers/ or .whl/ (pass carry=[\".peers\"] to the device tool); peers will report import errors"
        return 0
    fi
    PIP_ROOT_USER_ACTION=ignore "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade \
        --target "$SITE" "${wheels[@]}" || return 1
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    echo "installed into $SITE: ${wheels[*]}"
    # A peer that does not import is a benchmark result, not a failed step: report only.
    "$PY" -P -c "
for mod, what in (('cut_cross_entropy', 'linear_cross_entropy'), ('liger_kernel.transformers', 'LigerFusedLinearCrossEntropyLoss')):
    try:
        getattr(__import__(mod, fromlist=[what]), what); print('import ok    ', mod)
    except Exception as e:
        print('import FAILED', mod, '-', type(e).__name__, e)"
}

build() {
    local b0 b1
    b0=$(date +%s)
    # PIP_BREAK_SYSTEM_PACKAGES: an image whose Python is marked externally managed (PEP 668) would
    # refuse the install; this throwaway machine's environment is ours to change.
    export PIP_BREAK_SYSTEM_PACKAGES=1 PIP_ROOT_USER_ACTION=ignore
    if [ -n "${HUGEHEAD_WHEEL:-}" ]; then
        "$PY" -m pip install --no-deps --force-reinstall "$HUGEHEAD_WHEEL" || return 1
        echo "INSTALLED $HUGEHEAD_WHEEL: built by an earlier call (BUILD_WHEEL_DIR), not here"
        if [ "${HUGEHEAD_WHEEL_OVERLAY:-0}" = 1 ]; then
            # A commit that changed Python files only (csrc/, setup.py and CMakeLists.txt as the wheel's):
            # the tree's package laid over the installed one, the wheel's compiled extension kept.
            local site
            site=$("$PY" -P -c "import hugehead, os; print(os.path.dirname(hugehead.__file__))") || return 1
            (cd hugehead && find . -name '*.py' -exec cp --parents {} "$site/" \;) || return 1
            echo "OVERLAID the tree's Python sources on $site (the wheel's compiled extension kept)"
        fi
        return 0
    fi
    if [ -n "${BUILD_WHEEL_DIR:-}" ]; then
        "$PY" -m pip wheel --no-build-isolation --no-deps -v . -w "$BUILD_WHEEL_DIR" || return 1
        "$PY" -m pip install --no-deps --force-reinstall "$BUILD_WHEEL_DIR"/hugehead-*.whl || return 1
    else
        "$PY" -m pip install --no-build-isolation --no-deps -v . || return 1
    fi
    b1=$(date +%s)
    echo "BUILD TIME: $((b1 - b0)) s (MAX_JOBS=$MAX_JOBS, HUGEHEAD_CUDA=$HUGEHEAD_CUDA)"
}

dispatch() {
    # -P: not the source tree's hugehead/ (no compiled _C after pip install .) but the installed one.
    "$PY" -P -c "
import torch, hugehead
print('hugehead', hugehead.__version__, 'from', hugehead.__file__, '| cuda_built', hugehead.cuda_built())
for op in ('chunk_stats_', 'chunk_grad_'):
    print(getattr(torch.ops.hugehead, op).default._schema)
    print('  CPU kernel:', hugehead.has_kernel(op, 'CPU'), '| CUDA kernel:', hugehead.has_kernel(op, 'CUDA'))
print('CUTLASS GEMMs built:', hugehead._C.cutlass_built(), '| CUDA kernel of gemm_chunk_stats_ / gemm_chunk_grad_:',
      hugehead.has_kernel('gemm_chunk_stats_', 'CUDA'), hugehead.has_kernel('gemm_chunk_grad_', 'CUDA'),
      '| forward/backward GEMMs here:', hugehead.ops.gemm_path(torch.device('cuda'), torch.bfloat16)
      if torch.cuda.is_available() else '-')
print(torch._C._dispatch_dump('hugehead::chunk_stats_'))
raise SystemExit(0 if hugehead.has_kernel('chunk_stats_', 'CUDA') else 'no CUDA kernel registered for hugehead::chunk_stats_')
"
}

run_tests() {
    local left=$1
    [ "$left" -gt "${TEST_TIMEOUT:-360}" ] && left=${TEST_TIMEOUT:-360}
    # -P: tests import the installed hugehead, not the source tree (see dispatch).
    # shellcheck disable=SC2086
    timeout -k 10 "$left" "$PY" -P -m pytest $TEST_ARGS --junitxml="$OUT/junit.xml"
    local rc=$?
    [ "$rc" -eq 124 ] && echo "pytest TIMED OUT after $left s"
    [ "$rc" -eq 5 ] && echo "pytest collected no tests"
    return "$rc"
}

sanitize() {
    # Every tool over bench/sanitize_case.py (each hugehead kernel op on host-made inputs, checked against
    # float64), restricted to our kernels by name; one log per tool in $OUT/sanitizer/ (committed as is).
    local left=$1 tool rc=0 san per n filter
    san=$(command -v compute-sanitizer || true)
    [ -z "$san" ] && [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer" ] && san="${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer"
    if [ -z "$san" ]; then echo "compute-sanitizer not found"; return 1; fi
    mkdir -p "$OUT/sanitizer"
    # The kernel filter's option was --filter in old releases and is --kernel-name now; kns= matches a
    # substring of the (mangled) kernel name, and all of ours live in namespace hugehead.
    # The help text is read whole first: `"$san" --help | grep -q` under pipefail failed whenever grep quit
    # before the help was written (SIGPIPE), so the filter came and went between calls (session 6).
    local help
    help=$("$san" --help 2>&1 || true)
    if [ -n "${SANITIZER_FILTER+set}" ]; then
        filter=$SANITIZER_FILTER
    elif grep -q -- "--kernel-name " <<<"$help"; then
        filter="--kernel-name kns=hugehead"
    elif grep -q -- "--filter " <<<"$help"; then
        filter="--filter kns=hugehead"
    else
        filter=""
    fi
    { "$san" --version; echo "filter: ${filter:-none (this compute-sanitizer has no kernel filter)}"; } \
        | tee "$OUT/sanitizer/version.txt"
    read -r -a tools <<<"$SANITIZER_TOOLS"
    n=${#tools[@]}
    per=$(( left / n ))
    [ "$per" -gt "${SANITIZER_TIMEOUT:-150}" ] && per=${SANITIZER_TIMEOUT:-150}
    local tool_filter
    for tool in "${tools[@]}"; do
        # initcheck runs unfiltered: it checks the host's cudaMemcpy sources too, and memory that only an
        # unfiltered (torch) kernel wrote looks uninitialized to it under a filter (8553dda's bce_cases reports;
        # the same kernels without the filter, 194b171: 0 errors).
        tool_filter=$filter
        [ "$tool" = initcheck ] && [ -z "${SANITIZER_FILTER+set}" ] && tool_filter=""
        # each tool with its defaults (SANITIZER_OPTS adds options to every one, e.g. "--racecheck-report all")
        echo "--- compute-sanitizer --tool $tool $tool_filter ${SANITIZER_OPTS:-} (at most $per s) -> sanitizer/$tool.log"
        # shellcheck disable=SC2086  # $tool_filter and $SANITIZER_OPTS are several words
        PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout -k 10 "$per" "$san" --tool "$tool" $tool_filter ${SANITIZER_OPTS:-} \
            --error-exitcode 1 --print-limit 50 "$PY" -P bench/sanitize_case.py ${SANITIZE_ARGS:--q} \
            >"$OUT/sanitizer/$tool.log" 2>&1
        local trc=$?
        [ "$trc" -eq 124 ] && echo "    TIMED OUT after $per s"
        tail -n 3 "$OUT/sanitizer/$tool.log" | sed 's/^/    /'
        [ "$trc" -ne 0 ] && rc=1
    done
    return "$rc"
}

bench() {
    local left=$1 rc work=/tmp/hugehead-bench-work
    rm -rf "$work"
    # --budget: cases that would start too late are skipped, so results are written before the deadline.
    # HUGEHEAD_BENCH_IMPORT=installed: measure the hugehead that was just built and installed.
    # shellcheck disable=SC2086
    HUGEHEAD_BENCH_IMPORT=installed timeout -k 20 "$left" "$PY" -m bench.bench_lce --out "$OUT/results" \
        --work "$work" --budget $((left - 30)) ${BENCH_ARGS:-}
    rc=$?
    mkdir -p "$LOGDIR/bench-cases" && cp "$work"/*.log "$LOGDIR/bench-cases/" 2>/dev/null
    return "$rc"
}

placement() {
    # Multi-GPU only: the one-GPU vs all-GPU scaling figure at xc6M and the 50M-class head
    # (PLACEMENT_ARGS, e.g. "--scaling" alone). Results in $OUT/placement/placement.{json,md,png}.
    local left=$1
    # shellcheck disable=SC2086
    HUGEHEAD_BENCH_IMPORT=installed timeout -k 20 "$left" "$PY" -m bench.bench_placement --out "$OUT/placement" \
        ${PLACEMENT_ARGS:-}
}

# ---------------------------------------------------------------------------------------------------
say "device_check: stages [$STAGES], deadline ${DEADLINE_S} s, repo $REPO, git ${HUGEHEAD_GIT_SHA:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
has_stage smi && step smi gpu_facts
# the peers step exports PYTHONPATH in this shell (step runs functions without a subshell); without it,
# wheels a previous call installed on this (still warm) machine are used
has_stage peers && step peers install_peers
if ! has_stage peers && [ -d "$SITE" ]; then export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"; fi
has_stage build && step build build
if has_stage build && grep -q "BUILD TIME" "$LOGDIR/build.log" 2>/dev/null; then
    say "$(grep "BUILD TIME" "$LOGDIR/build.log")"
fi
has_stage dispatch && step dispatch dispatch
if has_stage test; then
    left=$(( $(remaining) - 20 ))
    if [ "$left" -gt 30 ]; then step test run_tests "$left"; else skip test "no time left (${left} s)"; fi
fi
if has_stage sanitizer; then
    left=$(( $(remaining) - 20 ))
    if [ "$left" -gt 60 ]; then step sanitizer sanitize "$left"; else skip sanitizer "no time left (${left} s)"; fi
fi
if has_stage bench; then
    left=$(( $(remaining) - 15 ))
    if [ "$left" -gt 90 ]; then TAIL_LINES=80 step bench bench "$left"; else skip bench "no time left (${left} s)"; fi
fi
if has_stage placement; then
    left=$(( $(remaining) - 15 ))
    if [ "$left" -gt 120 ]; then TAIL_LINES=60 step placement placement "$left"; else skip placement "no time left (${left} s)"; fi

fi
run_extra() {  # run_extra COMMAND: one EXTRA step, bounded by what is left of the deadline
    local left
    left=$(remaining)
    HUGEHEAD_BENCH_IMPORT=installed timeout -k 20 "$left" bash -c "$1"
}
if [ -n "${EXTRA:-}" ]; then
    IFS='|' read -r -a EXTRA_STEPS <<<"$EXTRA"
    for item in "${EXTRA_STEPS[@]}"; do
        name=${item%%=*}
        if [ "$(remaining)" -gt 20 ]; then TAIL_LINES=60 step "$name" run_extra "${item#*=}"; else skip "$name" "no time left"; fi
    done
fi

# ---------------------------------------------------------------------------------------------------
say ""
say "=== summary after $(($(date +%s) - T0)) s"
for line in ${SUMMARY[@]+"${SUMMARY[@]}"}; do say "  $line"; done
tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$LOGDIR"
if [ -f "$OUT/results/lce.md" ]; then
    echo ""
    cat "$OUT/results/lce.md"
fi
exit "$FAILED"
