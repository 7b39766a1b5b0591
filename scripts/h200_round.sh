#!/usr/bin/env bash
# One measurement round on the lent H200, in device calls made back to back (the machine stays warm
# only ~30 s between calls; FA4 travels in three parts, ../shared/tools/fa4-carry.sh).
#
# Here, first:
#   bash ../shared/tools/fa4-carry.sh                  # .fa4a .fa4b .fa4c (FA4 4.0.0b36 and quack 0.6.5)
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download -q --no-deps liger-kernel==0.8.5 -d .whl      # Liger-Kernel, 0.3 MB
#   mkdir -p .fi && echo /.fi/ >> .git/info/exclude                      # FlashInfer 0.6.0, 19 MB
#   python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .fi flashinfer-python==0.6.0 nvidia-cudnn-frontend
# On the device (the run tool), C = the commit being measured (the device's copy has no usable git):
#   call 1, carry [".fa4a", ".debs"]:  bash scripts/h200_round.sh 1 C   build, GPU tests, check tables   (~350-450 s)
#   call 2, carry [".fa4b"]:           bash scripts/h200_round.sh 2 C   CUDA pytest, memcheck, deterministic
#                                                                      backward's cost, host overhead,
#                                                                      transformers generate           (~360 s)
#   call 3, carry [".fa4c"]:           bash scripts/h200_round.sh 3 C   FA4 and quack installed; prefill and
#                                                                      head dims with FA4              (~450 s)
#   call 9, no carry (after 3):        bash scripts/h200_round.sh 9 C   the backward bench with FA4     (~200 s)
#   call 4, carry [".fi"]:             bash scripts/h200_round.sh 4 C   FlashInfer installed; decode grid, masks
#                                                                      (~380 s: the whole grid took 268 s
#                                                                      at 793b0a9)
#   call 5, no carry:                  bash scripts/h200_round.sh 5 C   fused (quack, Liger)              (~300 s)
#   call 6, no carry (after 3):        bash scripts/h200_round.sh 6 C   fused and decode GPU tests in three
#                                                                      shards, the fused kernels' knobs
#                                                                      against a copy and quack, decode at
#                                                                      head dims 128/96/80/64  (~250 s)
#   call 7, no carry (after 1):        bash scripts/h200_round.sh 7 C   prefill A/B probes, one process per
#                                                                      head dim: the lean-mask configs
#                                                                      against the general ones, the _k96
#                                                                      twins against the whole class
#                                                                      (~250 s)
#   call 8, no carry (cold is fine):   bash scripts/h200_round.sh 8 C   the pending items: build, backward and
#                                                                      rotary-attention GPU tests, deterministic
#                                                                      cost, ncu of decode at d96 and d128
#                                                                      (L2 requests against sectors)  (~250 s)
#   call 10, no carry (cold is fine):  bash scripts/h200_round.sh 10 C  the package only, the training path's CUDA
#                                                                      tests and host time, deterministic
#                                                                      groups, short non-causal probes (~200 s)
# The run tool carries at most 64 MiB: the tracked tree (~29 MB, most of it reports/) plus .fa4b
# (37 MB) is past it, so move reports/raw_* and reports/numerics aside for call 2 (the device needs
# no report) and put them back after.
# The five calls need ~29 minutes plus the start, more than a round's 30 device minutes once a start
# is refused or a machine is taken back: run phase 1 and then the phases the change needs.
# Each phase prints a short table last and leaves at most 8 files under $OUT (logs, and the report
# folders as one tarball per phase: unpack with `tar xzf` into reports/ and name the raw folder by
# commit and date). A phase that finds its machine cold says so and stops (start again at phase 1).
set -uo pipefail
phase=${1:?phase 1..10}
commit=${2:?commit}
export PYTHONUNBUFFERED=1 FLASHCPP_GIT_COMMIT=$commit
OUT=${OUT:?run through the device tool: OUT is its output folder}
case $phase in
  1 | 2 | 3 | 4 | 5 | 6 | 7 | 8 | 9 | 10) ;;
  *)
    echo "h200_round.sh: phase must be 1 to 10; got '$phase'" >&2
    exit 2
    ;;
esac
mkdir -p "$OUT"
repo=$(pwd)
summary=$OUT/summary.txt
: > "$summary"
say() { echo "$*" | tee -a "$summary"; }
warm_or_stop() {
  if [ ! -x build/flashcpp ] || ! python3 -c "import flashcpp" 2> /dev/null; then
    say "phase $phase: this machine has no build from phase 1 (it was given back between the calls): start again at phase 1"
    exit 3
  fi
}
fa4_path() {
  export PYTHONPATH=/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
  [ -d /tmp/liger ] && export PYTHONPATH=/tmp/liger:$PYTHONPATH
  return 0
}
pack() {  # pack NAME DIR...: one tarball of report folders
  local name=$1
  shift
  tar czf "$OUT/$name.tgz" -C "$OUT" "$@" 2> /dev/null && rm -rf "${@/#/$OUT/}"
}

case $phase in
  1)
    mkdir -p /tmp/fa4 && cp .fa4a/* /tmp/fa4/ 2> /dev/null
    # With the configs that wait for a measurement (CMake FLASHCPP_SM90_EXPERIMENTS: named only, the
    # automatic choices are the shipped build's), for phase 7's A/B.
    make build JOBS=16 FLASHCPP_GIT_COMMIT="$commit" CMAKE_ARGS=-DFLASHCPP_SM90_EXPERIMENTS=ON > "$OUT/build.txt" 2>&1 ||
      { tail -30 "$OUT/build.txt"; exit 1; }
    say "$(tail -2 "$OUT/build.txt" | head -1)"
    (python3 -m pip install --no-build-isolation --no-deps -q -Cbuild-dir=build-py \
      -Ccmake.define.FLASHCPP_SM90_EXPERIMENTS=ON . > "$OUT/pip.txt" 2>&1
     echo "pip rc $?" >> "$OUT/pip.txt") &
    # Three shards side by side on the one GPU: the whole suite ran past 280 s in one process on an
    # H100 host (e5f49c3), and tests check values, not timings. With two, shard 0 stopped at 280 s
    # (5d5621a: Prefill.CourseShapes alone took 119 s beside the other shard) and got 360; the lean
    # and Q K^T twin tests add more cases (every lean and _k config against its twin).
    shards=()
    for shard in 0 1 2; do
      GTEST_TOTAL_SHARDS=3 GTEST_SHARD_INDEX=$shard timeout 360 ./build/flashcpp_gpu_tests > "$OUT/gpu_tests_$shard.txt" 2>&1 &
      shards+=($!)
    done
    wait "${shards[@]}"
    for shard in 0 1 2; do
      say "gpu tests shard $shard: $(grep -E '^\[  (PASSED|FAILED) |tests ran' "$OUT/gpu_tests_$shard.txt" | tr '\n' ' ')"
    done
    for area in attention backward decode fused; do
      timeout 120 ./build/flashcpp check --backend cuda --area $area --json "$OUT/check_$area.json" > "$OUT/check_$area.txt" 2>&1
      say "check $area rc $?: $(tail -1 "$OUT/check_$area.txt")"
    done
    wait
    say "$(tail -1 "$OUT/pip.txt")"
    tar czf "$OUT/checks.tgz" -C "$OUT" $(cd "$OUT" && ls check_*) && rm -f "$OUT"/check_*
    ;;
  2)
    cp .fa4b/* /tmp/fa4/ 2> /dev/null
    warm_or_stop
    (cd /tmp && timeout 200 python3 -m pytest -q -p no:cacheprovider "$repo/tests/python" -k "cuda or CUDA or backward or transformers" \
      > "$OUT/pytest_cuda.txt" 2>&1; echo "pytest rc $?" >> "$OUT/pytest_cuda.txt")
    say "$(tail -2 "$OUT/pytest_cuda.txt" | tr '\n' ' ')"
    timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 ./build/flashcpp_gpu_tests \
      --gtest_filter='BackwardGpu.VarlenZeroesUncoveredRows:BackwardGpu.NanInQueryReachesItsRowAndTheKvHead' \
      > "$OUT/memcheck.txt" 2>&1
    say "memcheck rc $?: $(grep 'ERROR SUMMARY' "$OUT/memcheck.txt")"
    # Deterministic mode's cost against the default, bitwise repeat checked (phase 8 has it too).
    (cd /tmp && timeout 90 python3 "$repo/scripts/bwd_ab.py" sm90ws,sm90ws+det 1,2,0,3 > "$OUT/bwd_det.txt" 2>&1)
    say "bwd det rc $?"
    grep -E "TF/s|repeat" "$OUT/bwd_det.txt" >> "$summary"
    (cd /tmp && timeout 150 python3 -m flashcpp.bench.host_overhead --device cuda --out "$OUT/integrations" \
      > "$OUT/host_overhead.log" 2>&1)
    say "host overhead rc $?"
    (cd /tmp && timeout 120 python3 -m flashcpp.bench.hf_generate --device cuda --out "$OUT/integrations" \
      > "$OUT/hf_generate.log" 2>&1)
    say "transformers rc $?: $(grep -c 'equal to' "$OUT/hf_generate.log") architectures compared"
    pack phase2 integrations
    ;;
  3)
    warm_or_stop
    # shellcheck disable=SC1091
    source .fa4c/install.sh > "$OUT/fa4_install.txt" 2>&1
    say "$(tail -1 "$OUT/fa4_install.txt")"
    if ls .whl/*.whl > /dev/null 2>&1; then
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/liger .whl/*.whl > /dev/null 2>&1
    fi
    fa4_path
    cd /tmp || exit 1
    # With FA4 in the process the prefill sweep took longer than 240 s (1025a9f, H100), and the head
    # dims longer than 90 s: the backward bench has a phase of its own (9).
    timeout 400 python3 -m flashcpp.bench prefill --out "$OUT/prefill" > "$OUT/bench_prefill.log" 2>&1
    say "prefill rc $?"
    timeout 170 python3 -m flashcpp.bench headdims --out "$OUT/headdims" > "$OUT/bench_headdims.log" 2>&1
    say "headdims rc $?"
    pack phase3 prefill headdims hopper
    ;;
  10)
    # A short cold call (~200 s after the start) for the pending CPU-side changes: the package alone
    # (no make build), the training path's CUDA tests (the eager autograd formulas on the C++ fast
    # paths), its host time against SDPA, what sets deterministic mode's cost (the groups alone, and
    # deterministic mode in one group per head), and the lean persistent twin on the non-causal short
    # rows.
    python3 -m pip install --no-build-isolation --no-deps -q -Cbuild-dir=build-py . > "$OUT/pip.txt" 2>&1
    say "pip rc $?"
    (cd /tmp && timeout 90 python3 -m pytest -q -p no:cacheprovider "$repo/tests/python/test_autograd_fast_path.py" \
      "$repo/tests/python/test_backward_torch.py" "$repo/tests/python/test_attention_fast_path.py" \
      "$repo/tests/python/test_varlen_fast_path.py" -k "cuda or CUDA" > "$OUT/pytest.txt" 2>&1)
    say "pytest rc $?: $(tail -1 "$OUT/pytest.txt")"
    (cd /tmp && timeout 60 python3 "$repo/scripts/train_host_probe.py" > "$OUT/train_host.txt" 2>&1)
    say "train host rc $?"
    cat "$OUT/train_host.txt" >> "$summary"
    (cd /tmp && timeout 70 python3 "$repo/scripts/bwd_ab.py" sm90ws,sm90ws+g5,sm90ws+det,sm90ws+g32+det 0 \
      > "$OUT/bwd_groups.txt" 2>&1)
    say "bwd groups rc $?"
    grep -E "TF/s|repeat" "$OUT/bwd_groups.txt" >> "$summary"
    mkdir -p "$OUT/probes"
    (cd /tmp && timeout 60 python3 "$repo/scripts/prefill_probe.py" --shape 16,32,512,128 --shape 8,16,1024,128 \
      --reps 15 --configs auto,sm90_m128n128s2p_lean,sm90_m128n128s2p_lean_persist --out "$OUT/probes/short.csv" \
      > "$OUT/probes/short.txt" 2>&1)
    say "probe short rc $?"
    grep -v skipped "$OUT/probes/short.txt" >> "$summary"
    (cd /tmp && timeout 60 python3 -m flashcpp.bench.host_overhead --device cuda --out "$OUT/integrations" \
      > "$OUT/host_overhead.log" 2>&1)
    say "host overhead rc $?"
    (cd /tmp && timeout 90 python3 -m flashcpp.bench.hf_generate --device cuda --out "$OUT/integrations" \
      > "$OUT/hf_generate.log" 2>&1)
    say "transformers rc $?: $(grep -c 'equal to' "$OUT/hf_generate.log") architectures compared"
    pack phase10 integrations probes
    ;;
  9)
    warm_or_stop
    fa4_path
    cd /tmp || exit 1
    timeout 240 python3 -m flashcpp.bench backward --out "$OUT/backward" > "$OUT/bench_backward.log" 2>&1
    say "backward rc $?"
    grep -E "^b[0-9]" "$OUT/bench_backward.log" | cut -c1-120 >> "$summary"
    pack phase9 backward
    ;;
  4)
    warm_or_stop
    fa4_path
    if ls .fi/*.whl > /dev/null 2>&1; then  # FlashInfer (apache-tvm-ffi comes with FA4's wheels)
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fi .fi/*.whl /tmp/fa4/apache_tvm_ffi*.whl \
        > /dev/null 2>&1 && export PYTHONPATH=/tmp/fi:$PYTHONPATH
    fi
    cd /tmp || exit 1
    timeout 300 python3 -m flashcpp.bench decode --grid --grid-max-seconds 280 --out "$OUT/decode" > "$OUT/bench_decode_grid.log" 2>&1
    say "decode grid rc $?"
    timeout 90 python3 -m flashcpp.bench masks --quick --out "$OUT/masks" > "$OUT/bench_masks.log" 2>&1
    say "masks rc $?"
    pack phase4 decode masks
    ;;
  5)
    warm_or_stop
    fa4_path
    cd /tmp || exit 1
    timeout 290 python3 -m flashcpp.bench fused --out "$OUT/fused" > "$OUT/bench_fused.log" 2>&1  # > 200 s since the new fusions
    say "fused rc $?"
    pack phase5 fused
    ;;
  6)
    warm_or_stop
    fa4_path
    # Three shards side by side (the fused suite alone ran past 150 s in one process).
    i=0
    pids=()
    for f in 'FusedGpuRotary.DesignSize:FusedGpuRmsNorm.DesignSizeEveryPath' \
      'FusedGpuRotary.*:FusedGpuPaths.*:FusedGpuQkNormRope.*:FusedGpuRmsNorm.OddSizes:-FusedGpuRotary.DesignSize' \
      'FusedGpuRmsNorm.StridedMisalignedInPlace:DecodeGpu.*:-DecodeGpu.CourseShapes'; do
      timeout 240 ./build/flashcpp_gpu_tests --gtest_filter="$f" > "$OUT/gtest_$i.txt" 2>&1 &
      pids+=($!)
      i=$((i + 1))
    done
    wait "${pids[@]}"
    for j in 0 1 2; do
      say "gpu tests $j: $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/gtest_$j.txt" | tr '\n' ' ')"
    done
    (cd /tmp && timeout 200 python3 "$repo/scripts/fused_knobs.py" > "$OUT/knobs.txt" 2>&1)
    say "fused knobs rc $?"
    cat "$OUT/knobs.txt" >> "$summary"
    (cd /tmp && timeout 120 python3 -c "import sys; from flashcpp.bench import decode
sys.exit(decode.run(quick=True, out='$OUT/headdim_decode', cases=decode.HEADDIM_CASES))" > "$OUT/headdim_decode.log" 2>&1)
    say "head-dim decode rc $?"
    grep "at d128" "$OUT/headdim_decode.log" >> "$summary"
    pack phase6 headdim_decode
    ;;
  7)
    warm_or_stop
    # The lean-mask configs (causal and sequence-end masks only) against the general ones: d64's
    # 192-row tile (the automatic choice on this tree) and its persistent twin against the 128-row
    # persistent twin; the named-only lean twins at d128 and d256. The probe skips a config that
    # does not take a shape and prints each output's largest difference from the first config's
    # (0 between a lean config and its general twin: they give the same bits).
    probe() {  # probe NAME CONFIGS SHAPE...
      local name=$1 cfgs=$2
      shift 2
      local args=()
      for s in "$@"; do args+=(--shape "$s"); done
      mkdir -p "$OUT/probes"
      (cd /tmp && timeout 150 python3 "$repo/scripts/prefill_probe.py" "${args[@]}" --reps 15 --configs "$cfgs" \
        --out "$OUT/probes/$name.csv" > "$OUT/probes/$name.txt" 2>&1)
      say "probe $name rc $?"
      grep -v skipped "$OUT/probes/$name.txt" >> "$summary"
    }
    probe d64 auto,sm90_m192n128s4p,sm90_m192n128s4p_lean,sm90_m192n128s4p_lean_persist,sm90_m128n128s4p_persist \
      2,16,4096,64 2,16,4096,64,c 2,16,16384,64 2,16,16384,64,c 1,8,2048,64 1,8,2048,64,c 4,32,2048,64,c 16,32,1024,64,c
    probe d128 auto,sm90_m128n128s2p,sm90_m128n128s2p_lean,sm90_m128n128s2p_persist,sm90_m128n128s2p_lean_persist \
      4,32,4096,128 4,32,4096,128,c 1,16,16384,128 1,16,16384,128,c 16,32,512,128,c 8,16,1024,128,c 1,64,8192,128,8,c
    probe d256 auto,sm90_m128n64s2p,sm90_m128n64s2p_lean,sm90_m128n64s2p_persist,sm90_m128n64s2p_lean_persist \
      1,16,4096,256 1,16,4096,256,c
    # The 128 class's _k96 twins (Q K^T over 6 of 8 k16 steps) against the whole-class configs at
    # head dims 96 and 80 (bench headdims' shapes; the automatic choice takes the twins).
    probe k96 sm90_m128n128s2p_k96,sm90_m128n128s2p,sm90_m128n128s2p_k96_persist,sm90_m128n128s2p_persist \
      1,16,4096,96 1,16,4096,96,c 1,16,4096,80 1,16,4096,80,c 4,32,4096,96,c 2,32,2048,80,8
    pack phase7 probes
    ;;
  8)
    # One cold call for the pending items (~250 s): the build and its Python package, the backward and
    # rotary-attention GPU tests, deterministic mode's cost (bwd_ab.py, bitwise repeat checked), and
    # ncu of decode at head dim 96, contiguous against page 16 (the paged step ran 1.09x faster at
    # 3873b71). Run it on the tree under test (wip-det-writer for the writer change).
    make build JOBS=16 FLASHCPP_GIT_COMMIT="$commit" > "$OUT/build.txt" 2>&1 || { tail -30 "$OUT/build.txt"; exit 1; }
    say "$(tail -2 "$OUT/build.txt" | head -1)"
    (python3 -m pip install --no-build-isolation --no-deps -q -Cbuild-dir=build-py . > "$OUT/pip.txt" 2>&1
     echo "pip rc $?" >> "$OUT/pip.txt") &
    timeout 200 ./build/flashcpp_gpu_tests --gtest_filter='BackwardGpu.*:RotaryAttentionGpu.*' > "$OUT/gpu_tests.txt" 2>&1
    say "gpu tests: $(grep -E '^\[  (PASSED|FAILED) |tests ran' "$OUT/gpu_tests.txt" | tr '\n' ' ')"
    wait
    say "$(tail -1 "$OUT/pip.txt")"
    (cd /tmp && timeout 120 python3 "$repo/scripts/bwd_ab.py" sm90ws,sm90ws+det 1,2,0,3 > "$OUT/bwd_det.txt" 2>&1)
    say "bwd det rc $?"
    grep -E "TF/s|repeat" "$OUT/bwd_det.txt" >> "$summary"
    # What sets deterministic mode's cost: the grid's groups alone (default mode in groups of 5, as
    # deterministic mode runs (2,16,4096,64)), and deterministic mode with other group sizes.
    (cd /tmp && timeout 120 python3 "$repo/scripts/bwd_ab.py" \
      sm90ws,sm90ws+g5,sm90ws+det,sm90ws+g2+det,sm90ws+g8+det,sm90ws+g32+det 0,1 > "$OUT/bwd_groups.txt" 2>&1)
    say "bwd groups rc $?"
    grep -E "TF/s" "$OUT/bwd_groups.txt" >> "$summary"
    # Decode at d96 against d128 (reports/decode "ncu of the split kernel"): L2 read requests and
    # sectors per step (equal requests at 3:4 sectors would say requests, not bytes, set the step),
    # and the excess shared wavefronts and stalls per instruction from the source page.
    for d in 96 128; do
      (cd /tmp && timeout 90 ncu -k regex:decode_split --set full --import-source yes -c 1 \
        --metrics lts__t_requests_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_read.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum \
        -o "$OUT/ncu_d$d" python3 "$repo/scripts/decode_ncu.py" 16,32,8,8192,$d,0 --calls 2 > "$OUT/ncu_d${d}_run.txt" 2>&1)
      say "ncu d$d rc $?"
      ncu -i "$OUT/ncu_d$d.ncu-rep" --page raw --csv 2> /dev/null | python3 -c "import csv,sys
r=list(csv.reader(sys.stdin)); h=r[0]
for k in ('gpu__time_duration.sum','lts__t_requests_srcunit_tex_op_read.sum','lts__t_sectors_srcunit_tex_op_read.sum','l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum'):
  print('d$d', k, r[2][h.index(k)] if k in h else 'missing')" >> "$summary"
      ncu -i "$OUT/ncu_d$d.ncu-rep" --page source --print-source sass --csv 2> /dev/null | gzip > "$OUT/ncu_d${d}_src.csv.gz"
      rm -f "$OUT/ncu_d$d.ncu-rep"
    done
    ;;
esac
cat "$summary"
