#!/usr/bin/env bash
# One device call for decode work (the run tool, carry [".debs"]): build, the decode and engine GPU
# tests, compute-sanitizer over the fp8, padded-head-dim and paged cases, a decode_probe A/B set and
# the fp8 bench, each step's output under $OUT (at most 8 files) and a short table last. ~250 s on a
# warm-started H200 (build 60-70 s, pip 50 s beside the tests).
#   bash scripts/decode_round.sh C [PROBE_ARGS...]
# C labels the build (the device's copy has no usable git). PROBE_ARGS replace the default probe:
# the fp8-vs-bf16 shapes of reports/decode ("FP8"); for a split-rule A/B pass for example
#   --shape 1,32,8,2048,128,0 --shape 4,32,8,512,64,0 --kinds bf16 --splits 0,2,8
set -uo pipefail
C=${1:?commit label}
shift
OUT=${OUT:?run through the device tool: OUT is its output folder}
repo=$(pwd)
make build JOBS=16 FLASHCPP_GIT_COMMIT="$C" > "$OUT/build.txt" 2>&1 || { tail -30 "$OUT/build.txt"; exit 1; }
tail -2 "$OUT/build.txt" | head -1
(FLASHCPP_GIT_COMMIT=$C python3 -m pip install --no-build-isolation --no-deps -q -Cbuild-dir=build-py . > /tmp/pip.txt 2>&1
 echo "pip rc $?" >> /tmp/pip.txt) &
timeout 200 ./build/flashcpp_gpu_tests --gtest_filter='DecodeGpu.*:EngineGpu.*:FusedGpuRopeAppendFp8.*' > "$OUT/gpu_tests.txt" 2>&1
echo "gpu tests rc $?: $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/gpu_tests.txt" | tr '\n' ' ')"
grep -E '^\[  FAILED' "$OUT/gpu_tests.txt" | head
timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 ./build/flashcpp_gpu_tests \
  --gtest_filter='DecodeGpu.Fp8CacheIsAttentionOverTheDequantizedCache:DecodeGpu.Fp8CacheAtPaddedHeadDims:DecodeGpu.HeadDimVDiffersFromHeadDim:DecodeGpu.PagedRandomPageOrder' \
  > "$OUT/memcheck.txt" 2>&1
echo "memcheck rc $?: $(grep 'ERROR SUMMARY' "$OUT/memcheck.txt")"
wait
tail -1 /tmp/pip.txt
cd /tmp || exit 1
if [ $# -eq 0 ]; then
  set -- --kinds bf16,fp8
  for s in 1,32,8,131072,128,0 8,32,8,8192,128,0 8,16,2,32768,64,0 8,8,1,16384,256,0 16,32,8,8192,128,16; do
    set -- "$@" --shape "$s"
  done
fi
timeout 150 python3 "$repo/scripts/decode_probe.py" "$@" --out "$OUT/probe.csv" > "$OUT/probe.txt" 2>&1
echo "probe rc $?"
FLASHCPP_GIT_COMMIT=$C timeout 150 python3 -m flashcpp.bench.decode_fp8 --out "$OUT/fp8" > "$OUT/bench_fp8.txt" 2>&1
echo "bench fp8 rc $?"
cut -c1-130 "$OUT/probe.txt"
grep "bench decode_fp8\] b" "$OUT/bench_fp8.txt" | cut -c1-120
