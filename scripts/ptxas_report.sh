#!/usr/bin/env bash
# CUDA compiler launcher (CMakeLists.txt sets it on the kernel library): runs the compile and moves
# ptxas's resource report (-Xptxas=-v: registers, shared/constant memory, stack, spill stores and
# loads per kernel and architecture) out of the build log into one file:
#   ptxas_report.sh [--echo] REPORT COMPILER ARGS...
# Each object's report goes to REPORT.d/<object>.txt (rewritten when the object is rebuilt); REPORT is
# then rebuilt from them all, headed by the count of entry functions and of those that spill.
# Everything else the compiler prints (warnings and errors, ptxas warnings too) stays in the log;
# if the compile fails the whole output goes to the log. --echo (FLASHCPP_PTXAS_VERBOSE=ON) also
# leaves the report lines in the log.
set -uo pipefail
echo_report=0
if [[ "${1:-}" == --echo ]]; then echo_report=1; shift; fi
report="$1"
shift
parts="${report%.txt}.d"

obj="" prev=""
for a in "$@"; do
  [[ "$prev" == -o ]] && obj="$a"
  prev="$a"
done

err="$(mktemp "${TMPDIR:-/tmp}/ptxas_report.XXXXXX")"
"$@" 2>"$err"
rc=$?
# ptxas -v lines: "ptxas info    : ..." and the indented "N bytes stack frame, ..." under each
# "Function properties for ..." line.
is_report='^(ptxas info|    [0-9]+ bytes stack frame)'
if (( rc != 0 || echo_report )); then
  cat "$err" >&2
else
  grep -vE "$is_report" "$err" >&2
fi

if [[ -n "$obj" ]] && grep -qE "$is_report" "$err"; then
  mkdir -p "$parts"
  part="$parts/$(printf '%s' "$obj" | tr '/' '_').txt"
  { echo "== $obj"; grep -E "$is_report|^ptxas warning" "$err"; } >"$part.tmp" && mv "$part.tmp" "$part"
  # Rebuild the combined file under a lock (parallel compiles finish together).
  (
    command -v flock >/dev/null && flock 9
    shopt -s nullglob
    files=("$parts"/*.txt)
    entries=$(cat "${files[@]}" | grep -c "Compiling entry function")
    # "Function properties for F" is followed by F's "N bytes stack frame, N bytes spill stores, ..." line.
    spills="$(cat "${files[@]}" | awk '/Function properties for /{f=$NF; next}
      /bytes spill stores/ && !/ 0 bytes spill stores, 0 bytes spill loads/{sub(/^ +/, ""); print f ": " $0}')"
    nspill=0
    [[ -n "$spills" ]] && nspill=$(wc -l <<<"$spills")
    {
      echo "# ptxas resource report (-Xptxas=-v) of the objects in this build: ${entries} entry functions"
      echo "# compiled (one per kernel and architecture), ${nspill} functions with spill stores or loads."
      echo "# Each object's section is rewritten when it is rebuilt (scripts/ptxas_report.sh)."
      if [[ -n "$spills" ]]; then
        echo "# Spilling (one line per function and architecture; c++filt demangles the names):"
        sed 's/^/#   /' <<<"$spills"
      fi
      cat "${files[@]}"
    } >"$report.tmp" && mv "$report.tmp" "$report"
  ) 9>"$parts/.lock"
fi
rm -f "$err"
exit "$rc"
