#!/usr/bin/env bash
# Installs what the C++ build needs when it is missing. Fresh Debian/Ubuntu machines (CI) get
# Debian packages through apt; machines without network use .deb files carried in .debs/
# (see scripts/fetch_debs.sh), unpacked into .deps/ and found through CMAKE_PREFIX_PATH.
#   scripts/deps.sh          what the build needs (every make target)
#   scripts/deps.sh --fuzz   also clang and libFuzzer, for the fuzz step of `make test` / `make fuzz`
# The build alone never needs clang, so `make bench` runs on a GPU machine without it.
set -uo pipefail
cd "$(dirname "$0")/.."
have_header() { [ -e "/usr/include/$1" ] || [ -e ".deps/usr/include/$1" ]; }
missing=()
have_header nlohmann/json.hpp || missing+=(nlohmann-json3-dev)
have_header CLI/CLI.hpp || missing+=(libcli11-dev)
have_header fmt/format.h || missing+=(libfmt-dev)
have_header gtest/gtest.h || missing+=(libgtest-dev)
command -v cmake >/dev/null || missing+=(cmake)
command -v ninja >/dev/null || missing+=(ninja-build)
if [ "${1:-}" = --fuzz ]; then   # libFuzzer targets (tests/fuzz)
  command -v clang++ >/dev/null || missing+=(clang)
  compgen -G "/usr/lib/llvm-*/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a" >/dev/null || missing+=(libclang-rt-14-dev)
fi
[ ${#missing[@]} -eq 0 ] && exit 0
echo "deps: missing ${missing[*]}"
if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ] && timeout 120 apt-get update -qq >/dev/null 2>&1; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null && exit 0
fi
if compgen -G ".debs/*.deb" >/dev/null; then
  echo "deps: unpacking carried .debs into .deps/"
  for d in .debs/*.deb; do dpkg -x "$d" .deps || exit 1; done
  exit 0
fi
echo "deps: cannot install ${missing[*]} (no apt access and no .debs/)" >&2
exit 1
