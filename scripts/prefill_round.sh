#!/usr/bin/env bash
# A round for the sm90 prefill kernel on the lent H200, three device calls back to back (FA4 travels
# in three parts: ../shared/tools/fa4-carry.sh; the machine stays warm ~30 s between calls).
#   call 1, carry [".fa4a", ".debs"]: bash scripts/prefill_round.sh 1 C   build; every GPU test; check attention
#                                                                        and backward; memcheck of the prefill
#                                                                        tests; ncu of the d128 kernel (executed
#                                                                        instructions by opcode)        (~300 s)
#   call 2, carry [".fa4b"]:          bash scripts/prefill_round.sh 2 C   (copies FA4's second part)
#   call 3, carry [".fa4c"]:          bash scripts/prefill_round.sh 3 C   prefill on the shapes of the FA4 bar
#                                                                        (25 ms rounds), head dims --quick (~300 s)
# An A/B round without FA4, two calls back to back (no carry):
#   bash scripts/prefill_round.sh ab1 C   build; scripts/prefill_probe.py over $PROBE (its arguments: shapes,
#                                         configs, variants); the prefill, mask and rotary GPU tests (~450 s)
#   bash scripts/prefill_round.sh ab2 C   memcheck of every compiled config and the persistent masks
# C = the commit measured (the device's copy of the tree has no usable git). At most 8 files come back.
set -uo pipefail
phase=${1:?phase 1..3}; commit=${2:?commit}
export PYTHONUNBUFFERED=1 FLASHCPP_GIT_COMMIT=$commit
OUT=${OUT:?run through the device tool: OUT is its output folder}
mkdir -p "$OUT"
# The build on the device (its log in $OUT/build.txt; the round stops if it fails), then the Python
# package beside it (log /tmp/pip.txt, its rc as the log's last line).
build() {
  make build JOBS=16 FLASHCPP_GIT_COMMIT="$commit" > "$OUT/build.txt" 2>&1 || { tail -30 "$OUT/build.txt"; exit 1; }
  tail -2 "$OUT/build.txt" | head -1
}
install_package() {
  python3 -m pip install --no-build-isolation --no-deps -q -Cbuild-dir=build-py . > /tmp/pip.txt 2>&1; echo "pip rc $?" >> /tmp/pip.txt
}
case $phase in
  1)
    # Overrides: GT (gtest filter, default every test), MC (memcheck filter), CHECKS=0 (no check
    # tables), NCU=0 (no instruction mix), HF=1 (transformers' generate on CUDA, flashcpp.bench.hf_generate).
    mkdir -p /tmp/fa4 && cp .fa4a/* /tmp/fa4/ 2>/dev/null
    build
    install_package &
    timeout 280 ./build/flashcpp_gpu_tests --gtest_filter="${GT:-*}" > "$OUT/gpu_tests.txt" 2>&1
    echo "gpu tests rc $?: $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/gpu_tests.txt" | tr '\n' ' ')"
    grep -E '^\[  FAILED  \]' "$OUT/gpu_tests.txt" | head
    if [ "${CHECKS:-1}" = 1 ]; then
      for area in attention backward; do
        timeout 120 ./build/flashcpp check --backend cuda --area $area >> "$OUT/checks.txt" 2>&1
        echo "check $area rc $?: $(tail -1 "$OUT/checks.txt")"
      done
    fi
    timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 ./build/flashcpp_gpu_tests \
      --gtest_filter="${MC:-Prefill.EveryCompiledConfig*:MasksGpuPersistent*}" > "$OUT/memcheck.txt" 2>&1
    echo "memcheck rc $?: $(grep -E 'ERROR SUMMARY' "$OUT/memcheck.txt" | tail -1)"
    if [ "${NCU:-1}" = 1 ]; then
      timeout 120 ncu --section InstructionStats --section SourceCounters --section SpeedOfLight -k regex:fa3_forward_kernel -c 1 \
        -o /tmp/d128 -f ./build/flashcpp bench --head-dims 128 --warmup 0 --iters 1 > /dev/null 2>&1
      ncu -i /tmp/d128.ncu-rep --page source --csv --print-source sass > /tmp/d128_sass.csv 2>/dev/null
      ncu -i /tmp/d128.ncu-rep --page details 2>/dev/null | grep -E "SM Frequency|Duration|Executed Instructions  " | tee "$OUT/ncu_d128.txt"
      python3 scripts/sass_mix.py /tmp/d128_sass.csv >> "$OUT/ncu_d128.txt" 2>&1
    fi
    wait; tail -1 /tmp/pip.txt
    if [ "${HF:-0}" = 1 ]; then
      (cd /tmp && timeout 170 python3 -m flashcpp.bench.hf_generate --device cuda --out "$OUT/hf") > "$OUT/hf_generate.log" 2>&1
      echo "hf_generate rc $?"; tail -12 "$OUT/hf_generate.log"
    fi
    ;;
  2) cp .fa4b/* /tmp/fa4/ && echo "fa4 part 2 copied" ;;
  3)
    source .fa4c/install.sh || exit 3
    timeout 300 python3 - "$OUT/prefill_fa4_shapes" > "$OUT/prefill_fa4_shapes.log" 2>&1 <<'PY'
import sys
from flashcpp.bench import prefill
# The shapes of the FA4 bar (issue [fa4]), bf16, causal and not, 25 ms interleaved rounds.
shapes = [(4, 32, 4096, 128), (1, 16, 16384, 128), (2, 16, 4096, 64), (2, 16, 16384, 64), (1, 16, 4096, 256),
          (16, 32, 512, 128), (8, 16, 1024, 128), (1, 64, 8192, 128, 8)]
sys.exit(prefill.run(True, sys.argv[1], shapes=shapes, area_reports=False))
PY
    echo "prefill rc $?"
    timeout 200 python3 -m flashcpp.bench headdims --quick --out "$OUT/headdims" > "$OUT/headdims.log" 2>&1; echo "headdims rc $?"
    tar czf "$OUT/csv.tgz" -C "$OUT" prefill_fa4_shapes headdims 2>/dev/null && rm -rf "$OUT/prefill_fa4_shapes" "$OUT/headdims"
    grep -E "^b[0-9]" "$OUT/prefill_fa4_shapes.log" | awk '{printf "%-34s ours %6s", $1, $3; for (i=1;i<=NF;i++) if ($i=="fa4" || $i=="torch_cudnn") printf "  %s %s %s", $i, $(i+1), $(i+2); print ""}'
    tail -15 "$OUT/headdims.log"
    ;;
  ab1)
    build
    install_package; tail -1 /tmp/pip.txt
    (cd /tmp && eval timeout 200 python3 "$OLDPWD/scripts/prefill_probe.py" ${PROBE:?} --out "$OUT/probe.csv") > "$OUT/probe.txt" 2>&1
    echo "probe rc $?"
    timeout 200 ./build/flashcpp_gpu_tests --gtest_filter='Prefill.*:MasksGpu*:Rotary*:-Prefill.CourseShapes' > "$OUT/gpu_tests.txt" 2>&1
    echo "gpu tests rc $?: $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/gpu_tests.txt" | tr '\n' ' ')"
    grep -E '^\[  FAILED  \]' "$OUT/gpu_tests.txt" | head
    cat "$OUT/probe.txt"
    ;;
  ab2)
    timeout 240 compute-sanitizer --tool memcheck --error-exitcode 9 ./build/flashcpp_gpu_tests \
      --gtest_filter='Prefill.EveryCompiledConfig*:MasksGpuPersistent*' > "$OUT/memcheck.txt" 2>&1
    echo "memcheck rc $?: $(grep -E 'ERROR SUMMARY' "$OUT/memcheck.txt" | tail -1)"
    ;;
  *) echo "prefill_round.sh: phase must be 1, 2, 3, ab1 or ab2; got '$phase'" >&2; exit 2 ;;
esac
