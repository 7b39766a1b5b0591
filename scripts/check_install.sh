#!/usr/bin/env bash
# Installs the library from a configured build dir into a scratch prefix and builds + runs a
# downstream project that uses find_package(flashcpp) (tests/install).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${1:-build}"
case "$build" in /*) ;; *) build="$root/$build" ;; esac
prefix="$build/install-check/prefix"
rm -rf "$build/install-check"
cmake --install "$build" --prefix "$prefix" > /dev/null
cmake -S "$root/tests/install" -B "$build/install-check/consumer" -G Ninja -DCMAKE_PREFIX_PATH="$prefix" > /dev/null
cmake --build "$build/install-check/consumer" > /dev/null
"$build/install-check/consumer/consumer"
