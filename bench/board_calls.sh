#!/usr/bin/env bash
# Issue 21's H200 evidence as device calls, one per line (carry [".hh", ".whl", ".peers"], timeout_s 600):
#
#   git rev-parse HEAD > .hh/sha          # here, before the calls (the device's copy of .git may be stale)
#   OUT=... bash bench/board_calls.sh 1   # board part 1 (builds; the wheel and its build_inputs.sha256 come back in
#                                         # $OUT/wheel: copy both to .hh/)
#   OUT=... bash bench/board_calls.sh 2   # board part 2 (--resume; carry part 1's lce.json as .peers/lce_parts/lce.json
#                                         # unless the machine stayed warm), then split_lce and Nsight Compute of one
#                                         # fused xc6M chunk (bench_gemm --ncu: the issue's "ncu of one fused chunk")
#   OUT=... bash bench/board_calls.sh suite   # the CUDA test suite
#   OUT=... bash bench/board_calls.sh evidence   # H200 only: the CUDA test suite, then Nsight Compute of one fused
#                                         # xc6M chunk (part 2's ncu): acceptance 2 and the ncu without the board
#   git archive --format=tar -o .hh/old.tar bf7c076   # here, before an `ab` call
#   OUT=... [AB_SHAPES=llama3_4k,gemma2] [AB_ROUNDS=2] bash bench/board_calls.sh ab
#                                         # H200 (any GPU with AB_ANY_GPU=1): bench/ab_commits.py, the old
#                                         # commit's hugehead built beside this tree's and both timed in turns
#                                         # with torch.compile, then
#                                         # bench/step_trace.py at xc6M (20 steps, clocks sampled) (~5 minutes);
#                                         # the per-run folders come back in $OUT/ab_runs.tar.gz
#   OUT=... [MINI_S=230] [SUITE_S=150] [DEADLINE_S=585] bash bench/board_calls.sh mini
#                                         # one call for a short budget: hugehead and torch.compile at llama3_4k,
#                                         # xc6M and xc6M_16k (cheapest first), then the CUDA suite
#
# .hh/ (git-ignored) holds sha and, after the first build, hugehead-*.whl: later calls install that wheel with the
# tree's Python laid over it (HUGEHEAD_WHEEL_OVERLAY: only valid while csrc/, setup.py and CMakeLists.txt are the
# wheel's). build_inputs.sha256 beside it is those files' digest at the build; a wheel without it, or built from
# other files, is left unused and the call builds a fresh one. .whl/ holds nvidia-cutlass 4.2.0.0 and .peers/ the
# peer wheels (bench/README.md, "Peers").
# Parts 1, 2, evidence, ab (unless AB_ANY_GPU=1) and mini exit 3 at once on a GPU other than an H200 (the issue's
# targets are the H200's); part 1 then builds the wheel only, if .hh/ has none that fits.
# For a rehearsal elsewhere: HH (the folder for sha and the wheel), DEVICE_CHECK and LCE_PARTS (the scripts called).
set -u
WHAT=${1:?usage: bash bench/board_calls.sh 1|2|suite|evidence|ab|mini}
OUT=${OUT:?set OUT to the output folder}
export OUT
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 2
HH=${HH:-.hh}
DEVICE_CHECK=${DEVICE_CHECK:-bench/device_check.sh}
LCE_PARTS=${LCE_PARTS:-bench/lce_parts.sh}
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "GPU: $GPU"
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm,memory.total --format=csv
IS_H200=0
[[ "$GPU" == *H200* ]] && IS_H200=1
HUGEHEAD_GIT_SHA=$(cat "$HH/sha") || { echo "write $HH/sha first (git rev-parse HEAD > $HH/sha)"; exit 2; }
export HUGEHEAD_GIT_SHA
build_inputs() {  # the digest of what the compiled extension is built from
    find csrc setup.py CMakeLists.txt -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -c1-64
}
WHEEL=$(ls "$HH"/hugehead-*.whl 2>/dev/null | head -1)
if [ -n "$WHEEL" ] && [ "$(cat "$HH/build_inputs.sha256" 2>/dev/null)" != "$(build_inputs)" ]; then
    echo "$WHEEL: not built from this tree's csrc/, setup.py and CMakeLists.txt (or no $HH/build_inputs.sha256):" \
         "not used; a fresh wheel is built"
    WHEEL=""
fi
use_wheel() {
    if [ -n "$WHEEL" ]; then
        export HUGEHEAD_WHEEL=$WHEEL HUGEHEAD_WHEEL_OVERLAY=1
    else
        mkdir -p "$OUT/wheel" && export BUILD_WHEEL_DIR=$OUT/wheel
        build_inputs > "$OUT/wheel/build_inputs.sha256"
    fi
}
not_h200() { echo "not an H200: nothing run"; exit 3; }
NCU=${NCU:-/usr/local/cuda/bin/ncu}
# At most 8 files come back from $OUT: the A/B's per-run folders and logs and the trace go into one tar (a fresh
# wheel and its digest need two more)
AB_PACK="pack=cd $OUT && tar -czf ab_runs.tar.gz --exclude=work \$(ls -d ab trace 2>/dev/null) && rm -rf ab/old[0-9]* ab/new[0-9]* ab/*.log trace; find . -type f | sort"
NCU_FUSED="ncu=$NCU --clock-control none --profile-from-start off --section SpeedOfLight python3 -m bench.bench_gemm --ncu xc6M > $OUT/ncu_fused_xc6M.txt 2>&1"

case "$WHAT" in
1)
    if [ "$IS_H200" = 1 ]; then
        use_wheel
        exec bash "$LCE_PARTS" 1
    fi
    [ -n "$WHEEL" ] && not_h200
    use_wheel
    STAGES="smi peers build dispatch" DEADLINE_S=400 exec bash "$DEVICE_CHECK"
    ;;
2)
    [ "$IS_H200" = 1 ] || not_h200
    use_wheel
    DEADLINE_S=${DEADLINE_S:-585} STAGES="peers build bench" \
        EXTRA="split=python3 -m bench.split_lce --shapes xc6M,xc6M_16k --out $OUT/split|$NCU_FUSED" \
        exec bash "$LCE_PARTS" 2
    ;;
evidence)  # the suite below, then the fused chunk's ncu
    [ "$IS_H200" = 1 ] || not_h200
    export EXTRA="$NCU_FUSED"
    ;&
suite)
    use_wheel
    STAGES="smi peers build dispatch test" TEST_ARGS="tests -q -m cuda -rf" TEST_TIMEOUT=${TEST_TIMEOUT:-400} \
        DEADLINE_S=${DEADLINE_S:-560} exec bash "$DEVICE_CHECK"
    ;;
ab)  # AB_ANY_GPU=1: on any GPU (the code's A/B holds on its own board; the issue's targets are the H200's)
    [ "$IS_H200" = 1 ] || [ "${AB_ANY_GPU:-0}" = 1 ] || not_h200
    [ -f "$HH/old.tar" ] || { echo "make $HH/old.tar first (git archive --format=tar -o $HH/old.tar bf7c076)"; exit 2; }
    use_wheel
    STAGES="smi peers build" DEADLINE_S=${DEADLINE_S:-585} \
        EXTRA="ab=python3 -m bench.ab_commits --old-tar $HH/old.tar --out $OUT/ab --shapes ${AB_SHAPES:-llama3_4k,gemma2} --rounds ${AB_ROUNDS:-2}|trace=python3 -m bench.step_trace --shape xc6M --steps 20 --out $OUT/trace|$AB_PACK" \
        exec bash "$DEVICE_CHECK"
    ;;
mini)
    [ "$IS_H200" = 1 ] || not_h200
    use_wheel
    S=${SUITE_S:-150}
    EX=""
    # The suite's log goes into logs.tar.gz: with a fresh wheel and its digest, 8 files come back
    [ "$S" -gt 0 ] && EX="suite=timeout $S python3 -P -m pytest tests -q -m cuda -rf --junitxml=$OUT/junit.xml > $OUT/logs/pytest_cuda.log 2>&1; tail -3 $OUT/logs/pytest_cuda.log"
    DEADLINE_S=${DEADLINE_S:-585} STAGES="smi peers build dispatch bench" \
        BENCH_ARGS="--shapes llama3_4k,xc6M,xc6M_16k --peers hugehead,torch_compile --min-case-s 100 --budget ${MINI_S:-230}" \
        EXTRA="$EX" exec bash "$DEVICE_CHECK"
    ;;
*)
    echo "usage: bash bench/board_calls.sh 1|2|suite|evidence|ab|mini" >&2
    exit 2
    ;;
esac
