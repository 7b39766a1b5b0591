#!/usr/bin/env bash
# A round for the CUDA attention backward on the lent H200, three device calls back to back (FA4
# travels in three parts: ../shared/tools/fa4-carry.sh; the machine stays warm ~30 s between calls).
#   call 1, carry [".fa4a"]: bash scripts/backward_round.sh 1 C   build; the backward's GPU tests; check
#                                                               --area backward; memcheck of three backward
#                                                               tests; bench backward --quick without FA4
#   call 2, carry [".fa4b"]: bash scripts/backward_round.sh 2 C   (copies FA4's second part)
#   call 3, carry [".fa4c"]: bash scripts/backward_round.sh 3 C   bench backward (every shape, FA4 and
#                                                               cuDNN in the process), head dims --quick
# C = the commit measured (the device's copy of the tree has no usable git). At most 8 files come back.
set -uo pipefail
phase=${1:?phase 1..3}; commit=${2:?commit}
export PYTHONUNBUFFERED=1 FLASHCPP_GIT_COMMIT=$commit
OUT=${OUT:?run through the device tool: OUT is its output folder}
mkdir -p "$OUT"
case $phase in
  1)
    # Overrides: GT (gtest filter), MC (memcheck filter), PRE (a short test run first), CHECK=0 (no
    # check --area backward), BENCH=0 (no quick bench), AB=1 (scripts/bwd_ab.py: AB_CONFIGS, AB_SHAPES),
    # NCU="B H N D [causal] [det] [config]; ..." (an ncu profile of each: details and per-SASS-line
    # source counters), PYT=1 (tests/python/test_backward_torch.py on CUDA; PYT_TESTS="a.py b.py" names
    # other files of tests/python), GT_TIMEOUT (seconds for the gtest run, default 240), TRAIN=1 (the training check).
    # Logs other than the last bench's are packed into $OUT/phase1.tgz (8 files come back at most).
    mkdir -p /tmp/fa4 && cp .fa4a/* /tmp/fa4/ 2>/dev/null
    make build JOBS=16 FLASHCPP_GIT_COMMIT="$commit" > "$OUT/build.txt" 2>&1 || { tail -30 "$OUT/build.txt"; exit 1; }
    tail -2 "$OUT/build.txt" | head -1
    grep -A2 -E "bwd_sm90_(ws_)?kernel" build/ptxas_report.txt 2>/dev/null | grep -E "registers|spill" | sort | uniq -c
    (python3 -m pip install --no-build-isolation --no-deps -q -Cbuild-dir=build-py . > /tmp/pip.txt 2>&1
     echo "pip rc $?" >> /tmp/pip.txt) &
    if [ -n "${PRE:-}" ]; then  # a short first test: a hang or a failure stops the round here
      timeout 40 ./build/flashcpp_gpu_tests --gtest_filter="$PRE" > "$OUT/pre.txt" 2>&1
      rc=$?; echo "pre $PRE rc $rc"; [ $rc = 0 ] || { tail -40 "$OUT/pre.txt"; exit 4; }
    fi
    timeout "${GT_TIMEOUT:-240}" ./build/flashcpp_gpu_tests --gtest_filter="${GT:-BackwardGpu.*}" > "$OUT/gpu_bwd.txt" 2>&1
    echo "gpu tests rc $?: $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/gpu_bwd.txt" | tr '\n' ' ')"
    grep -E '^\[  FAILED  \]|Failure|max err|differs' "$OUT/gpu_bwd.txt" | head -20
    [ "${CHECK:-1}" = 1 ] && timeout 120 ./build/flashcpp check --backend cuda --area backward > "$OUT/check_bwd.txt" 2>&1
    echo "check backward rc $?: $(tail -1 "$OUT/check_bwd.txt")"
    timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 ./build/flashcpp_gpu_tests \
      --gtest_filter="${MC:-BackwardGpu.VarlenZeroesUncoveredRows:BackwardGpu.NanIn*:BackwardGpu.WarpSpecializedSmall}" > "$OUT/memcheck_bwd.txt" 2>&1
    echo "memcheck rc $?: $(grep -E 'ERROR SUMMARY' "$OUT/memcheck_bwd.txt" | tail -1)"
    wait; tail -1 /tmp/pip.txt
    if [ "${AB:-0}" = 1 ]; then  # the backward's kernels A/B (scripts/bwd_ab.py), cuDNN beside
      (cd /tmp && timeout 200 python3 "$OLDPWD/scripts/bwd_ab.py" "${AB_CONFIGS:-sm90,sm90ws}" ${AB_SHAPES:-}) > "$OUT/ab.txt" 2>&1
      echo "ab rc $?"; cat "$OUT/ab.txt"
    fi
    if [ "${BENCH:-1}" = 1 ]; then
      (cd /tmp && timeout 150 python3 -m flashcpp.bench backward --quick --out "$OUT/bwd_quick") > "$OUT/bench_quick.log" 2>&1
      echo "bench quick rc $?"; grep -E "^b[0-9]| ours |det " "$OUT/bench_quick.log" | tail -8
    fi
    if [ "${PYT:-0}" = 1 ]; then
      (cd /tmp && timeout 200 python3 -m pytest -q -x $(for t in ${PYT_TESTS:-test_backward_torch.py}; do echo "$OLDPWD/tests/python/$t"; done)) > "$OUT/pytest_bwd.txt" 2>&1
      echo "pytest backward rc $?: $(tail -1 "$OUT/pytest_bwd.txt")"
    fi
    if [ -n "${NCU:-}" ]; then  # ncu of each listed backward (scripts/bwd_one.py), the main kernel only
      i=0
      IFS=';' read -ra runs <<< "$NCU"
      for r in "${runs[@]}"; do
        i=$((i + 1))
        timeout 150 ncu -k regex:bwd_sm90\|bwd_main --launch-skip 1 --launch-count 1 --set full \
          -f -o "/tmp/ncu$i" python3 scripts/bwd_one.py $r > "$OUT/ncu$i.log" 2>&1
        echo "ncu $i ($r) rc $?"
        ncu --import "/tmp/ncu$i.ncu-rep" --page details > "$OUT/ncu${i}_details.txt" 2>&1
        ncu --import "/tmp/ncu$i.ncu-rep" --page source --csv --print-source sass 2>/dev/null | gzip > "$OUT/ncu${i}_sass.csv.gz"
        grep -E "Duration|Compute \(SM\) Throughput|Registers Per|Warp Cycles Per Issued|Issue Slots Busy|Shared Memory Bank|Executed Ipc A" "$OUT/ncu${i}_details.txt" | head -12
      done
    fi
    if [ "${TRAIN:-0}" = 1 ]; then
      (cd /tmp && timeout 240 python3 -m flashcpp.bench.train_check --out "$OUT/train_check") > "$OUT/train_check.log" 2>&1
      echo "train check rc $?"; tail -4 "$OUT/train_check.log"
    fi
    (cd "$OUT" && tar czf /tmp/phase1.tgz --exclude phase1.tgz . && rm -rf ./* && mv /tmp/phase1.tgz .)
    ;;
  2) cp .fa4b/* /tmp/fa4/ && echo "fa4 part 2 copied" ;;
  3)
    source .fa4c/install.sh || exit 3
    (cd /tmp && timeout 330 python3 -m flashcpp.bench backward --out "$OUT/backward") > "$OUT/bench_bwd.log" 2>&1
    echo "bench backward rc $?"
    (cd /tmp && timeout 200 python3 -m flashcpp.bench headdims --quick --out "$OUT/headdims") > "$OUT/headdims.log" 2>&1
    echo "headdims rc $?"
    tar czf "$OUT/csv.tgz" -C "$OUT" backward headdims 2>/dev/null && rm -rf "$OUT/backward" "$OUT/headdims"
    grep -E " ours " "$OUT/bench_bwd.log" | tail -12
    tail -12 "$OUT/headdims.log"
    ;;
  *) echo "backward_round.sh: phase must be 1, 2 or 3; got '$phase'" >&2; exit 2 ;;
esac
