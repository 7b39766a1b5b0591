#!/usr/bin/env bash
# CI steps of the Python package (called by `make test`): install the build/test dependencies,
# build and install the package with the CUDA kernels off (CPU backend only, keeps CI short),
# run the Python tests. Exits with pytest's code; "no tests collected" (5) counts as a failure.
#   PYTHON=python3.12 python/ci_test.sh     # another interpreter
#   FLASHCPP_PY_BUILD_DIR=/tmp/b python/ci_test.sh
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-python3}"
build_dir="${FLASHCPP_PY_BUILD_DIR:-$root/build-py}"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore

echo "== python: build dependencies"
"$py" -m pip install --quiet nanobind scikit-build-core numpy ml_dtypes pytest

echo "== python: package build (FLASHCPP_CUDA=OFF, build dir $build_dir)"
start=$(date +%s)
"$py" -m pip install --no-build-isolation --no-deps \
  -Ccmake.define.FLASHCPP_CUDA=OFF -Cbuild-dir="$build_dir" "$root"
echo "python package build took $(( $(date +%s) - start )) s"

echo "== python: tests"
set +e
"$py" -m pytest "$root/tests/python" -q -p no:cacheprovider
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: treating as a failure"
  rc=1
fi
exit "$rc"
