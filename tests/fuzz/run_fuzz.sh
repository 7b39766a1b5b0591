#!/usr/bin/env bash
# Builds the validate() fuzzer with clang (libFuzzer + ASan + UBSan, no recovery) and runs it.
#
#   tests/fuzz/run_fuzz.sh [BUILD_DIR]        (default build/fuzz)
#   FUZZ_SECONDS=600 tests/fuzz/run_fuzz.sh   (default 60 s)
#   FUZZ_JOBS=2 ...                           (parallel fuzzing processes; default 1)
#
# The corpus lives in BUILD_DIR/corpus and grows across runs; crash inputs land in
# BUILD_DIR/artifacts. Exits non-zero on any crash, sanitizer report or oracle trap.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
build="${1:-build/fuzz}"
case "$build" in /*) ;; *) build="$root/$build" ;; esac
seconds="${FUZZ_SECONDS:-60}"
jobs="${FUZZ_JOBS:-1}"

cxx="${CXX_FUZZ:-}"
if [[ -z "$cxx" ]]; then
  for c in clang++-14 clang++; do
    if command -v "$c" >/dev/null 2>&1; then cxx="$c"; break; fi
  done
fi
if [[ -z "$cxx" ]]; then
  echo "fuzz_validate: no clang++ found (libFuzzer needs clang); set CXX_FUZZ" >&2
  exit 2
fi

mkdir -p "$build/corpus" "$build/artifacts"
echo "fuzz_validate: building with $cxx into $build"
(cd "$root" && "$cxx" -std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all \
  -I include -I src src/core/validate.cc src/core/names.cc tests/fuzz/fuzz_validate.cc \
  -o "$build/fuzz_validate")

log="$build/fuzz.log"
echo "fuzz_validate: running for ${seconds}s (log: $log)"
rc=0
args=(-max_total_time="$seconds" -print_final_stats=1 -artifact_prefix="$build/artifacts/")
if (( jobs > 1 )); then
  # -fork keeps fuzzing in child processes and stops at the first crash.
  args+=(-fork="$jobs")
fi
marker="$build/.run_started"
touch "$marker"
start=$SECONDS
"$build/fuzz_validate" "${args[@]}" "$build/corpus" >"$log" 2>&1 || rc=$?
elapsed=$(( SECONDS - start ))

# Executions: libFuzzer's final stats, or (fork mode) the last "#N" progress line.
runs="$(grep -oE 'stat::number_of_executed_units: *[0-9]+' "$log" | grep -oE '[0-9]+$' | tail -1 || true)"
if [[ -z "$runs" ]]; then
  runs="$(grep -oE '^#[0-9]+' "$log" | tail -1 | tr -d '#' || true)"
fi
runs="${runs:-0}"
rate=""
(( elapsed > 0 )) && rate="$(( runs / elapsed ))"
# Artifacts written by this run only (older ones stay for replay).
crashes="$(find "$build/artifacts" -type f -newer "$marker" -name '*-*' | wc -l)"
if (( rc != 0 )) && (( crashes == 0 )); then crashes=1; fi

if (( rc != 0 )); then
  grep -E 'accepted an invalid|ERROR|runtime error|SUMMARY' "$log" | head -20 >&2 || true
  echo "see $log and $build/artifacts/ (replay: $build/fuzz_validate <artifact>)" >&2
fi
echo "fuzz_validate: ${runs} runs, ${crashes} crashes${rate:+ (${rate} runs/s over ${elapsed}s)}"
exit $(( rc != 0 ))
