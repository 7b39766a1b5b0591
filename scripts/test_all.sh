#!/usr/bin/env bash
# The stages of `make test` after the build (the Makefile's test target calls this), in order:
#   includes scripts/check_includes.py: the include directions of docs/ARCHITECTURE.md
#   ctest    the CPU GoogleTests (ctest in BUILD)
#   check    flashcpp check --backend cpu --quick --area all (JSON: BUILD/cpu_correctness_report.json)
#   install  scripts/check_install.sh: install into a scratch prefix, build a find_package consumer
#   fuzz     scripts/deps.sh --fuzz (clang, libFuzzer), then tests/fuzz/run_fuzz.sh BUILD/fuzz
#   pytest   python/ci_test.sh: the Python package (CPU build) and tests/python
# Each stage's output goes to the terminal and to BUILD/test-logs/<stage>.log. Every stage runs even
# after one fails. The run ends with one row per stage, the verdict line naming each stage with the
# counts read from its output, and the totals (also written to BUILD/test-logs/verdict.txt):
#   make test: PASS | includes 115 files 0 violations | ctest 297/297 passed | check 218 passed 0 failed | install ok | fuzz ... | pytest ...
#   make-test: 1234 passed, 0 failed, 19 skipped
# The totals add ctest's, check's and pytest's cases, the include check (1; failed: its violations),
# the install check (1) and each fuzz target that ran clean; skipped are ctest's and pytest's skips and check's unsupported cases. A stage
# fails on a non-zero exit status, and also when its counts are missing from its output or it
# ran no test at all. Exit status: 0 when every stage passed, 1 otherwise.
#   scripts/test_all.sh [BUILD]        (default build)
#   env: JOBS (ctest -j; default nproc), FUZZ_SECONDS (default 60; make test passes 40), PYTHON (python/ci_test.sh's),
#        TEST_STAGES (a subset of the stages, in the order given; default all)
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
build="${1:-build}"
case "$build" in /*) ;; *) build="$root/$build" ;; esac
jobs="${JOBS:-$(nproc)}"
fuzz_seconds="${FUZZ_SECONDS:-60}"
logs="$build/test-logs"
# TEST_STAGES="ctest check": only those stages (to rerun one; make test runs them all).
all_stages="includes ctest check install fuzz pytest"
stages="$(echo ${TEST_STAGES:-$all_stages})"
for stage in $stages; do
  [[ " $all_stages " == *" $stage "* ]] || { echo "test_all: unknown stage '$stage' (stages: $all_stages)" >&2; exit 2; }
done
mkdir -p "$logs"
rel() { echo "${1#"$root"/}"; }

# run_stage NAME COMMAND...: runs COMMAND, output to the terminal and to $logs/NAME.log; sets rc and secs.
rc=0 secs=0
run_stage() {
  local name="$1"
  shift
  printf '\n== make test: %s (log: %s/%s.log)\n' "$name" "$(rel "$logs")" "$name"
  local start=$SECONDS
  "$@" 2>&1 | tee "$logs/$name.log"
  rc=${PIPESTATUS[0]}
  secs=$(( SECONDS - start ))
}

# Numbers from a log: num REGEX [LOG] prints the first captured number of the last matching line.
num() { grep -oE "$1" "${2:-$log}" | tail -1 | grep -oE '[0-9]+' | head -1; }

names=() results=() details=() times=() failed_stages=()
total_pass=0 total_fail=0 total_skip=0
# record NAME OK(1/0) DETAIL PASSED FAILED SKIPPED
record() {
  names+=("$1")
  results+=("$([[ $2 == 1 ]] && echo PASS || echo FAIL)")
  details+=("$3")
  times+=("$secs")
  [[ $2 == 1 ]] || failed_stages+=("$1")
  total_pass=$(( total_pass + $4 ))
  total_fail=$(( total_fail + $5 ))
  total_skip=$(( total_skip + $6 ))
}

# ---- includes --------------------------------------------------------------------------------
stage_includes() {
  run_stage includes python3 scripts/check_includes.py "$root"
  log="$logs/includes.log"
  # Its closing line: "115 files checked, 0 violations" (one "file:line: rule" line per violation above it).
  summary="$(grep -E '^[0-9]+ files checked, [0-9]+ violations$' "$log" | tail -1)"
  if [[ -n "$summary" ]]; then
    nfiles="$(num '^[0-9]+ files' <(echo "$summary"))"
    nviol="$(num '[0-9]+ violations' <(echo "$summary"))"
    detail="${nfiles} files ${nviol} violations"
    ok=1; (( rc != 0 || nviol > 0 || nfiles == 0 )) && ok=0
    if (( ok )); then record includes 1 "$detail" 1 0 0; else record includes 0 "$detail" 0 $(( nviol > 0 ? nviol : 1 )) 0; fi
  else
    record includes 0 "no summary in its output (exit $rc)" 0 1 0
  fi
}

# ---- ctest -----------------------------------------------------------------------------------
stage_ctest() {
  run_stage ctest bash -c "cd '$build' && ctest --output-on-failure -j '$jobs' --timeout 600"
  log="$logs/ctest.log"
  # "100% tests passed, 0 tests failed out of 297"; ctest counts skipped tests among the passed.
  summary="$(grep -E '^[0-9]+% tests passed, [0-9]+ tests? failed out of [0-9]+' "$log" | tail -1)"
  if [[ -n "$summary" ]]; then
    total="$(grep -oE 'out of [0-9]+' <<<"$summary" | grep -oE '[0-9]+')"
    nfail="$(grep -oE '[0-9]+ tests? failed' <<<"$summary" | grep -oE '[0-9]+')"
    nskip="$(grep -cE '^ *[0-9]+/[0-9]+ Test +#[0-9]+: .*\*\*\*Skipped' "$log")"
    npass=$(( total - nfail - nskip ))
    detail="${npass}/${total} passed"
    (( nskip > 0 )) && detail+=" ${nskip} skipped"
    if (( nfail > 0 )); then  # ctest's closing list: "  12 - Name (Failed)"
      failed_tests="$(grep -E '^[[:space:]]+[0-9]+ - .* \((Failed|Timeout|SEGFAULT|Subprocess aborted|Exception)' "$log" |
        awk '{print $3}' | head -3 | paste -sd, -)"
      detail+=" ${nfail} failed${failed_tests:+ ($failed_tests)}"
    fi
    ok=1; (( rc != 0 || nfail > 0 || npass == 0 )) && ok=0
    record ctest "$ok" "$detail" "$npass" "$nfail" "$nskip"
  else
    record ctest 0 "no summary in its output (exit $rc)" 0 1 0
  fi
}

# ---- check -----------------------------------------------------------------------------------
stage_check() {
  run_stage check "$build/flashcpp" check --backend cpu --quick --area all --json "$build/cpu_correctness_report.json"
  log="$logs/check.log"
  # Its closing line: "N passed, M failed[, K unsupported]".
  summary="$(grep -E '^[0-9]+ passed, [0-9]+ failed(, [0-9]+ unsupported)?$' "$log" | tail -1)"
  if [[ -n "$summary" ]]; then
    npass="$(num '^[0-9]+ passed' <(echo "$summary"))"
    nfail="$(num '[0-9]+ failed' <(echo "$summary"))"
    nuns="$(num '[0-9]+ unsupported' <(echo "$summary"))"
    nuns="${nuns:-0}"
    ok=1; (( rc != 0 || nfail > 0 || npass == 0 )) && ok=0
    detail="${npass} passed ${nfail} failed"
    (( nuns > 0 )) && detail+=" ${nuns} unsupported"
    # A failure names its cases and the input seed in the verdict line, the part of a CI log that
    # is sure to be kept (the check draws fresh inputs each run, so the seed is what replays it).
    if (( nfail > 0 )); then
      failed_cases="$(grep -E ' FAIL$' "$log" | awk '{print $1}' | head -3 | paste -sd, -)"
      seed="$(grep -oE 'replay with --seed [0-9]+' "$log" | head -1 | grep -oE '[0-9]+$')"
      detail+=" (${failed_cases:-?}; replay: --seed ${seed:-?})"
    fi
    record check "$ok" "$detail" "$npass" "$nfail" "$nuns"
  else
    record check 0 "no summary in its output (exit $rc)" 0 1 0
  fi
}

# ---- install ---------------------------------------------------------------------------------
stage_install() {
  run_stage install bash scripts/check_install.sh "$build"
  log="$logs/install.log"
  # The consumer prints "consumer: ok (...)".
  if (( rc == 0 )) && grep -qE '^consumer: ok' "$log"; then
    record install 1 ok 1 0 0
  else
    record install 0 "failed (exit $rc)" 0 1 0
  fi
}

# ---- fuzz ------------------------------------------------------------------------------------
stage_fuzz() {
  run_stage fuzz bash -c "bash scripts/deps.sh --fuzz && FUZZ_SECONDS='$fuzz_seconds' bash tests/fuzz/run_fuzz.sh '$build/fuzz'"
  log="$logs/fuzz.log"
  # One line per target: "fuzz_validate: 123456 runs, 0 crashes (...)".
  lines="$(grep -E '^fuzz_[a-z_]+: [0-9]+ runs, [0-9]+ crashes' "$log")"
  if [[ -n "$lines" ]]; then
    targets="$(wc -l <<<"$lines")"
    runs=0 crashes=0 crashed_targets=0
    local re='^fuzz_[a-z_]+: ([0-9]+) runs, ([0-9]+) crashes'
    while read -r line; do
      [[ "$line" =~ $re ]] || continue
      r="${BASH_REMATCH[1]}" c="${BASH_REMATCH[2]}"
      runs=$(( runs + r ))
      crashes=$(( crashes + c ))
      (( c > 0 )) && crashed_targets=$(( crashed_targets + 1 ))
    done <<<"$lines"
    detail="${targets} targets ${fuzz_seconds} s ${runs} runs"
    if (( crashes == 0 )); then detail+=" clean"; else detail+=" ${crashes} crashes"; fi
    ok=1; (( rc != 0 || crashes > 0 || runs == 0 )) && ok=0
    (( rc != 0 && crashes == 0 )) && detail+=" (exit $rc)"
    (( rc != 0 && crashed_targets == 0 )) && crashed_targets=1
    record fuzz "$ok" "$detail" $(( targets - crashed_targets )) "$crashed_targets" 0
  else
    record fuzz 0 "did not run (exit $rc; see the log)" 0 1 0
  fi
}

# ---- pytest ----------------------------------------------------------------------------------
stage_pytest() {
  run_stage pytest bash python/ci_test.sh
  log="$logs/pytest.log"
  # pytest -q's closing line: "313 passed, 19 skipped in 45.21s" (any of failed/errors/... too).
  summary="$(grep -E '[0-9]+ (passed|failed|skipped|errors?)\b.* in [0-9.]+s' "$log" | tail -1)"
  if [[ -n "$summary" ]]; then
    count() { grep -oE "[0-9]+ $1" <<<"$summary" | grep -oE '[0-9]+' | head -1; }
    npass="$(count passed)"; npass="${npass:-0}"
    nfail="$(count failed)"; nfail="${nfail:-0}"
    nerr="$(count 'errors?')"; nerr="${nerr:-0}"
    nskip="$(count skipped)"; nskip="${nskip:-0}"
    detail="${npass} passed ${nskip} skipped ${nfail} failed"
    (( nerr > 0 )) && detail+=" ${nerr} errors"
    ok=1; (( rc != 0 || nfail > 0 || nerr > 0 || npass == 0 )) && ok=0
    record pytest "$ok" "$detail" "$npass" $(( nfail + nerr )) "$nskip"
  else
    record pytest 0 "no pytest summary in its output (exit $rc)" 0 1 0
  fi
}

for stage in $stages; do
  "stage_$stage"
done
# A stage without a result (a fault in this script: bash leaves the loop on an arithmetic error) fails.
for stage in $stages; do
  [[ " ${names[*]} " == *" $stage "* ]] && continue
  secs=0
  record "$stage" 0 "no result (scripts/test_all.sh stopped before it finished)" 0 1 0
done

# ---- verdict ---------------------------------------------------------------------------------
label="make test"
[[ "$stages" == "$all_stages" ]] || label="make test (TEST_STAGES: $stages)"
if (( ${#failed_stages[@]} == 0 )); then
  verdict="$label: PASS"
else
  verdict="$label: FAIL in $(IFS=,; echo "${failed_stages[*]}" | sed 's/,/, /g')"
fi
rows=""
for i in "${!names[@]}"; do
  rows+="$(printf '  %-8s %-4s  %-56s %5d s' "${names[$i]}" "${results[$i]}" "${details[$i]}" "${times[$i]}")"$'\n'
  verdict+=" | ${names[$i]} ${details[$i]}"
done
totals="make-test: ${total_pass} passed, ${total_fail} failed, ${total_skip} skipped"
echo
printf '== make test: stages (logs: %s/)\n%s%s\n%s\n' "$(rel "$logs")" "$rows" "$verdict" "$totals" | tee "$logs/verdict.txt"
(( ${#failed_stages[@]} == 0 ))
