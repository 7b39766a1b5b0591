#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (libFuzzer + ASan + UBSan, no recovery) and runs each:
#   fuzz_validate         flashcpp::validate() of attention (tests/fuzz/fuzz_validate.cc)
#   fuzz_decode_validate  flashcpp::validate() of decode (tests/fuzz/fuzz_decode_validate.cc)
#   fuzz_fused_validate   the fused ops' validate() (tests/fuzz/fuzz_fused_validate.cc)
#   fuzz_engine_parsers   safetensors header/index and config.json parsers (tests/fuzz/fuzz_engine_parsers.cc)
#
#   tests/fuzz/run_fuzz.sh [BUILD_DIR]        (default build/fuzz)
#   FUZZ_SECONDS=600 tests/fuzz/run_fuzz.sh   (total fuzzing time, split evenly; default 60 s)
#   FUZZ_JOBS=2 ...                           (parallel fuzzing processes per target; default 1)
#   FUZZ_RUN_JOBS=1 ...                       (targets run at once; default 2)
#
# Each target's corpus lives in BUILD_DIR/corpus (validate), BUILD_DIR/corpus_decode,
# BUILD_DIR/corpus_fused or BUILD_DIR/corpus_engine and grows across runs; crash inputs land in
# BUILD_DIR/artifacts/, artifacts_decode/, artifacts_fused/ or artifacts_engine/. Every target always runs; the exit status is non-zero on
# any crash, sanitizer report or oracle trap.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
build="${1:-build/fuzz}"
case "$build" in /*) ;; *) build="$root/$build" ;; esac
seconds="${FUZZ_SECONDS:-60}"
jobs="${FUZZ_JOBS:-1}"
# A quarter each; attention's validate gets what the division leaves.
seconds_engine=$(( seconds / 4 ))
seconds_decode=$(( seconds / 4 ))
seconds_fused=$(( seconds / 4 ))
seconds_validate=$(( seconds - seconds_engine - seconds_decode - seconds_fused ))
(( seconds_engine > 0 )) || seconds_engine=1
(( seconds_decode > 0 )) || seconds_decode=1
(( seconds_fused > 0 )) || seconds_fused=1

cxx="${CXX_FUZZ:-}"
if [[ -z "$cxx" ]]; then
  for c in clang++-14 clang++; do
    if command -v "$c" >/dev/null 2>&1; then cxx="$c"; break; fi
  done
fi
if [[ -z "$cxx" ]]; then
  echo "run_fuzz: no clang++ found (libFuzzer needs clang); set CXX_FUZZ" >&2
  exit 2
fi

# Header-only dependencies (nlohmann-json, fmt): system ones, or those scripts/deps.sh unpacked.
incs=(-I include -I src)
[[ -d "$root/.deps/usr/include" ]] && incs+=(-isystem "$root/.deps/usr/include")
flags=(-std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all)

mkdir -p "$build/corpus" "$build/artifacts" "$build/corpus_engine" "$build/artifacts_engine" "$build/seed_engine" \
  "$build/corpus_decode" "$build/artifacts_decode" "$build/corpus_fused" "$build/artifacts_fused"
echo "run_fuzz: building fuzz_validate, fuzz_decode_validate, fuzz_fused_validate and fuzz_engine_parsers with $cxx into $build"
# The four targets, each a list of sources. Every source is compiled once, to an object,
# FUZZ_BUILD_JOBS (2) at a time, in the order first named here (so the engine's two JSON parsers,
# about 35 s each, start first); then the four links. One clang process per target compiled its
# sources one after another, and the engine target's two long ones set the stage's length.
targets=(
  "fuzz_engine_parsers src/engine/safetensors.cc src/engine/config.cc src/core/names.cc cmake/fmt_compiled.cc tests/fuzz/fuzz_engine_parsers.cc"
  "fuzz_validate src/core/validate.cc src/core/names.cc tests/fuzz/fuzz_validate.cc"
  "fuzz_decode_validate src/core/decode_validate.cc src/core/names.cc tests/fuzz/fuzz_decode_validate.cc"
  "fuzz_fused_validate src/core/fused_validate.cc src/core/decode_validate.cc src/core/names.cc tests/fuzz/fuzz_fused_validate.cc"
)
build_jobs="${FUZZ_BUILD_JOBS:-2}"
objs="$build/obj"
mkdir -p "$objs"
obj_of() { local o="${1//\//_}"; echo "$objs/${o%.cc}.o"; }
sources=()
for t in "${targets[@]}"; do
  for src in ${t#* }; do [[ " ${sources[*]} " == *" $src "* ]] || sources+=("$src"); done
done
rm -f "$objs"/*.o  # a failed compile leaves no object, so the check below sees it
for src in "${sources[@]}"; do
  while (( $(jobs -rp | wc -l) >= build_jobs )); do wait -n || true; done
  (cd "$root" && "$cxx" "${flags[@]}" "${incs[@]}" -c "$src" -o "$(obj_of "$src")") &
done
wait
for src in "${sources[@]}"; do
  [[ -f "$(obj_of "$src")" ]] || { echo "run_fuzz: compiling $src failed (see above)" >&2; exit 2; }
done
for t in "${targets[@]}"; do
  o=()
  for src in ${t#* }; do o+=("$(obj_of "$src")"); done
  "$cxx" "${flags[@]}" "${o[@]}" -o "$build/${t%% *}" || { echo "run_fuzz: linking ${t%% *} failed (see above)" >&2; exit 2; }
done

# Seeds and a dictionary for the engine parsers (first byte: 3 = JSON header, 0 = raw file,
# 1 = index, 2 = config; see fuzz_engine_parsers.cc).
seed="$build/seed_engine"
printf '\103{"__metadata__":{"format":"pt"},"a":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,12]},"b":{"dtype":"F32","shape":[],"data_offsets":[12,16]}}' >"$seed/header_json"
printf '\377{"model.norm.weight":{"dtype":"F16","shape":[4],"data_offsets":[8,16]},"e":{"dtype":"I64","shape":[0,5],"data_offsets":[0,0]}}' >"$seed/header_json_data"
hdr='{"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'
printf "\\000\\$(printf %03o ${#hdr})\\000\\000\\000\\000\\000\\000\\000%s01234567" "$hdr" >"$seed/header_raw"
printf '\001{"metadata":{"total_size":16},"weight_map":{"a":"model-00001-of-00002.safetensors","b":"model-00002-of-00002.safetensors"}}' >"$seed/index"
printf '\002{"architectures":["LlamaForCausalLM"],"model_type":"llama","vocab_size":128256,"hidden_size":2048,"intermediate_size":8192,"num_hidden_layers":16,"num_attention_heads":32,"num_key_value_heads":8,"head_dim":64,"rms_norm_eps":1e-05,"rope_theta":500000.0,"rope_scaling":{"factor":32.0,"high_freq_factor":4.0,"low_freq_factor":1.0,"original_max_position_embeddings":8192,"rope_type":"llama3"},"max_position_embeddings":131072,"tie_word_embeddings":true,"bos_token_id":128000,"eos_token_id":[128001,128008,128009],"torch_dtype":"bfloat16","hidden_act":"silu"}' >"$seed/config_llama32"
printf '\002{"vocab_size":32000,"hidden_size":4096,"intermediate_size":11008,"num_hidden_layers":32,"num_attention_heads":32,"rope_scaling":null}' >"$seed/config_min"
cat >"$build/engine.dict" <<'EOF'
"\"dtype\""
"\"shape\""
"\"data_offsets\""
"\"__metadata__\""
"\"F32\""
"\"F16\""
"\"BF16\""
"\"I64\""
"\"BOOL\""
"\"F8_E4M3\""
"\"weight_map\""
"\"rope_scaling\""
"\"rope_type\""
"\"type\""
"\"llama3\""
"\"default\""
"\"factor\""
"\"low_freq_factor\""
"\"high_freq_factor\""
"\"original_max_position_embeddings\""
"\"architectures\""
"\"model_type\""
"\"llama\""
"\"mistral\""
"\"sliding_window\""
"\"head_dim\""
"\"num_key_value_heads\""
"\"num_attention_heads\""
"\"hidden_size\""
"\"eos_token_id\""
"\"rope_parameters\""
"18446744073709551615"
"9223372036854775807"
"4294967296"
"-1"
"1e308"
"null"
"true"
"[0,0]"
EOF

# run_one NAME SECONDS CORPUS ARTIFACTS SEED_DIR_OR_EMPTY [extra libFuzzer flags...]
# Prints one summary line; returns non-zero on a crash.
run_one() {
  local name="$1" secs="$2" corpus="$3" artifacts="$4" seeds="$5"
  shift 5
  local log="$build/$name.log" marker="$build/.$name.started" rc=0
  local args=(-max_total_time="$secs" -print_final_stats=1 -artifact_prefix="$artifacts/")
  # -fork keeps fuzzing in child processes and stops at the first crash.
  (( jobs > 1 )) && args+=(-fork="$jobs")
  echo "$name: running for ${secs}s (log: $log)"
  touch "$marker"
  local start=$SECONDS
  # The corpus directory comes first: libFuzzer writes new inputs into the first one only.
  local dirs=("$corpus")
  [[ -n "$seeds" ]] && dirs+=("$seeds")
  "$build/$name" "${args[@]}" "$@" "${dirs[@]}" >"$log" 2>&1 || rc=$?
  local elapsed=$(( SECONDS - start ))
  # Executions: libFuzzer's final stats, or (fork mode) the last "#N" progress line.
  local runs
  runs="$(grep -oE 'stat::number_of_executed_units: *[0-9]+' "$log" | grep -oE '[0-9]+$' | tail -1 || true)"
  [[ -z "$runs" ]] && runs="$(grep -oE '^#[0-9]+' "$log" | tail -1 | tr -d '#' || true)"
  runs="${runs:-0}"
  local rate=""
  (( elapsed > 0 )) && rate="$(( runs / elapsed ))"
  # Artifacts written by this run only (older ones stay for replay).
  local crashes
  crashes="$(find "$artifacts" -type f -newer "$marker" -name '*-*' | wc -l)"
  if (( rc != 0 )) && (( crashes == 0 )); then crashes=1; fi
  if (( rc != 0 )); then
    grep -E 'accepted an invalid|ERROR|runtime error|SUMMARY' "$log" | head -20 >&2 || true
    echo "see $log and $artifacts/ (replay: $build/$name <artifact>)" >&2
  fi
  echo "$name: ${runs} runs, ${crashes} crashes${rate:+ (${rate} runs/s over ${elapsed}s)}"
  return $(( rc != 0 ))
}

# Two targets at a time by default (FUZZ_RUN_JOBS=1: one after another): each still gets its own
# seconds, and the stage's wall time halves on a machine with two cores.
status=0
run_jobs="${FUZZ_RUN_JOBS:-2}"
running=()
finish() { for pid in "${running[@]}"; do wait "$pid" || status=1; done; running=(); }
start() {  # start NAME ARGS...: run_one in the background, after the running ones when run_jobs are busy
  (( ${#running[@]} >= run_jobs )) && finish
  run_one "$@" &
  running+=($!)
}
start fuzz_validate "$seconds_validate" "$build/corpus" "$build/artifacts" ""
start fuzz_decode_validate "$seconds_decode" "$build/corpus_decode" "$build/artifacts_decode" ""
start fuzz_fused_validate "$seconds_fused" "$build/corpus_fused" "$build/artifacts_fused" ""
start fuzz_engine_parsers "$seconds_engine" "$build/corpus_engine" "$build/artifacts_engine" "$seed" \
  -dict="$build/engine.dict"
finish
exit "$status"
