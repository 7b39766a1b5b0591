# flashcpp — top-level entry points (see README.md).
#   make test      install what is missing, build, run every CPU test (what CI runs)
#   make run       build and run `flashcpp check` (CUDA if a GPU is present, else the CPU backend)
#   make gpu-test  on an NVIDIA machine: build, GPU tests, correctness reports
#   make bench     on an NVIDIA machine: peers vs flashcpp, reports/<area>/benchmark.{csv,png}
#                  (QUICK=1: the --quick subsets, written under $(BUILD)/bench-quick)
#   make wheel     the manylinux wheel with the CUDA kernels (sm_80, sm_90a) in dist/, its size printed;
#                  make wheel-cpu: the CPU-only wheel (what CI builds and installs). docs/wheel.md
# CMAKE_ARGS goes to cmake's configure, e.g. a kernel family left out of the build (README "Build
# switches"; FLASHCPP_WITH_SM80, _SM90, _DECODE, _FUSED, _ENGINE, all ON by default):
#   make BUILD=build-nosm80 CMAKE_ARGS=-DFLASHCPP_WITH_SM80=OFF
#   make BUILD=build-small CMAKE_ARGS="-DFLASHCPP_WITH_SM80=OFF -DFLASHCPP_WITH_ENGINE=OFF"
# A changed CMAKE_ARGS (or CUDA) configures the build directory again, every switch ON unless
# CMAKE_ARGS turns it off (so a plain `make` after one of these builds every family again), and
# FLASHCPP_SM90_EXPERIMENTS (configs waiting for a GPU measurement) OFF unless CMAKE_ARGS turns it on.
SHELL := /bin/bash
BUILD ?= build
JOBS ?= $(shell nproc)
FUZZ_SECONDS ?= 40
CUDA ?= $(shell command -v nvcc >/dev/null 2>&1 && echo ON || echo OFF)
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes || echo no)
PYTHON ?= python3
# Header-only dependencies unpacked from carried .deb files (machines without network).
DEPS_PREFIX := $(CURDIR)/.deps/usr
CMAKE_ARGS ?=
CMAKE_PREFIX := $(if $(wildcard $(DEPS_PREFIX)),-DCMAKE_PREFIX_PATH=$(DEPS_PREFIX),)
# FLASHCPP_GIT_COMMIT (the label the Python tools read too) wins over the checkout's HEAD: a copy of a
# working tree can carry stale git metadata.
GIT_COMMIT ?= $(or $(FLASHCPP_GIT_COMMIT),$(shell git rev-parse --short=12 HEAD 2>/dev/null || echo unknown))
# make bench QUICK=1: each area's --quick subset (about three minutes on an H200), written under
# $(BUILD)/bench-quick so the shipped full-sweep figures in reports/ are not replaced by a subset.
# Any run written outside reports/ (QUICK=1, or BENCH_OUT=dir) ends with a reproduction check
# against reports/: COMPARE.md, every shared (case, peer) ratio and its drift (tolerance 10%).
# The audit plots, roofline, SUMMARY.md and COMPARE.md come from one process (flashcpp.bench.finish).
QUICK ?=
BENCH_FLAGS := $(if $(QUICK),--quick,)
BENCH_OUT ?= $(if $(QUICK),$(CURDIR)/$(BUILD)/bench-quick,$(CURDIR)/reports)
# The steps run from /tmp: a relative BENCH_OUT is made absolute.
BENCH_DIR := $(abspath $(BENCH_OUT))
# A run written outside reports/ is checked against reports/ (COMPARE.md).
COMPARE_REF := $(if $(filter $(CURDIR)/reports,$(BENCH_DIR)),,$(CURDIR)/reports)
# $(call timed,NAME,COMMAND): run COMMAND, then print "[make bench] NAME: N s".
comma := ,
timed = s=$$(date +%s) && $(2) && echo "[make bench] $(1): $$(( $$(date +%s) - s )) s"
AREA_ENV = FLASHCPP_GIT_COMMIT=$(GIT_COMMIT) $(PYTHON)
IS_HOPPER := $(shell nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | grep -q '^9' && echo yes || echo no)

.PHONY: all deps configure build test run gpu-test bench fuzz python-test wheel wheel-cpu clean FORCE
all: build

deps:
	bash scripts/deps.sh

# The configure arguments that matter (not the commit label: it is written at build time), kept in
# $(BUILD)/configure-args; a change re-runs the configure (otherwise an existing build.ninja keeps
# whatever configuration made it, and `make CMAKE_ARGS=...` on it would silently change nothing).
FAMILIES_ON := $(foreach f,SM80 SM90 DECODE FUSED ENGINE,-DFLASHCPP_WITH_$(f)=ON) -DFLASHCPP_SM90_EXPERIMENTS=OFF
CONFIGURE_ARGS := -DFLASHCPP_CUDA=$(CUDA) $(CMAKE_PREFIX) $(FAMILIES_ON) $(CMAKE_ARGS)
$(BUILD)/configure-args: FORCE
	@mkdir -p $(BUILD); echo '$(CONFIGURE_ARGS)' | cmp -s - $@ || echo '$(CONFIGURE_ARGS)' > $@

$(BUILD)/build.ninja: $(BUILD)/configure-args
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHCPP_GIT_COMMIT=$(GIT_COMMIT) $(CONFIGURE_ARGS)
	@touch $@  # cmake leaves an unchanged build.ninja as it was: newer than the arguments it was made with

configure: deps $(BUILD)/build.ninja

build: configure
	@start=$$(date +%s); FLASHCPP_GIT_COMMIT=$(GIT_COMMIT) cmake --build $(BUILD) -j $(JOBS) || exit 1; \
	echo "build: $$(( $$(date +%s) - start )) s (CUDA=$(CUDA), jobs=$(JOBS))"; \
	if [ -f $(BUILD)/ptxas_report.txt ]; then echo "build: ptxas register report in $(BUILD)/ptxas_report.txt"; fi

# The include-direction check (docs/ARCHITECTURE.md), ctest, flashcpp check (cpu, quick), the
# install check, the fuzzers, the Python tests: each stage's output also in
# $(BUILD)/test-logs/<stage>.log; ends with the verdict line naming each stage with its counts, then "make-test: N passed, N failed, N skipped" (scripts/test_all.sh).
test: build
	@JOBS=$(JOBS) FUZZ_SECONDS=$(FUZZ_SECONDS) bash scripts/test_all.sh $(BUILD)

run: build
ifeq ($(HAS_GPU),yes)
	./$(BUILD)/flashcpp check --backend cuda --quick
else
	./$(BUILD)/flashcpp check --backend cpu --quick
endif

# ---- NVIDIA machine ----------------------------------------------------------------------
# GPU tests of both kernel families, the correctness reports, and the Python package's GPU tests.
gpu-test: build
	mkdir -p reports/prefill reports/hopper
	./$(BUILD)/flashcpp_gpu_tests
	./$(BUILD)/flashcpp check --backend cuda --full --cuda-config sm80 --json reports/prefill/correctness_report.json
ifeq ($(IS_HOPPER),yes)
	./$(BUILD)/flashcpp check --backend cuda --full --cuda-config sm90 --json reports/hopper/correctness_report.json
endif
	mkdir -p reports/decode reports/fused reports/masks reports/numerics
	./$(BUILD)/flashcpp check --backend cuda --quick --json reports/masks/correctness_report.json
	./$(BUILD)/flashcpp check --backend cuda --full --area decode --json reports/decode/correctness_report.json
	./$(BUILD)/flashcpp check --backend cuda --full --area fused --json reports/fused/correctness_report.json
	$(PYTHON) -m pip install --no-build-isolation --no-deps -q -Cbuild-dir=build-py .
	cd /tmp && $(PYTHON) -m pytest -q -p no:cacheprovider $(CURDIR)/tests/python

# Peers vs flashcpp in one process per area; writes reports/{prefill,hopper,fused,decode,masks,engine,integrations,numerics}.
bench: build
	$(PYTHON) -m pip install --no-build-isolation --no-deps -q -Cbuild-dir=build-py .
	mkdir -p $(BENCH_DIR)/numerics
	$(call timed,prefill,cd /tmp && $(AREA_ENV) -m flashcpp.bench prefill $(BENCH_FLAGS) --out $(BENCH_DIR)/prefill)
	$(call timed,fused,cd /tmp && $(AREA_ENV) -m flashcpp.bench fused $(BENCH_FLAGS) --out $(BENCH_DIR)/fused)
	$(call timed,decode,cd /tmp && $(AREA_ENV) -m flashcpp.bench decode $(BENCH_FLAGS) --out $(BENCH_DIR)/decode && $(AREA_ENV) -m flashcpp.bench.decode --grid $(if $(QUICK),--grid-max-seconds 60) --out $(BENCH_DIR)/decode && $(AREA_ENV) -m flashcpp.bench.decode_fp8 $(BENCH_FLAGS) --out $(BENCH_DIR)/decode)
	$(call timed,masks,cd /tmp && $(AREA_ENV) -m flashcpp.bench masks $(BENCH_FLAGS) --out $(BENCH_DIR)/masks)
	$(call timed,backward,cd /tmp && $(AREA_ENV) -m flashcpp.bench backward $(BENCH_FLAGS) --out $(BENCH_DIR)/backward)
	$(call timed,head dims,cd /tmp && $(AREA_ENV) -m flashcpp.bench headdims $(BENCH_FLAGS) --out $(BENCH_DIR)/headdims)
	$(call timed,engine,cd /tmp && $(AREA_ENV) -m flashcpp.bench engine $(BENCH_FLAGS) --flashcpp-bin $(CURDIR)/$(BUILD)/flashcpp --out $(BENCH_DIR)/engine)
	$(call timed,host overhead,cd /tmp && $(AREA_ENV) -m flashcpp.bench.host_overhead --device cuda $(BENCH_FLAGS) --out $(BENCH_DIR)/integrations)
	$(call timed,audit,./$(BUILD)/flashcpp audit --backend cuda $(BENCH_FLAGS) --json $(BENCH_DIR)/numerics/audit.json)
	$(call timed,plots$(comma) roofline$(comma) summary$(if $(COMPARE_REF), and compare),cd /tmp && $(PYTHON) -m flashcpp.bench.finish $(BENCH_DIR) $(if $(COMPARE_REF),--reference $(COMPARE_REF)))

# The wheel (docs/wheel.md; scripts/build_wheel.sh): pip wheel + auditwheel repair into dist/ (a
# manylinux wheel), its size printed. `make wheel` has the CUDA kernels for FLASHCPP_CUDA_ARCHS
# (default "80;90a"; build dir build-wheel-cuda, JOBS compile jobs); `make wheel-cpu` is the CPU-only
# wheel CI builds (python/ci_test.sh builds the same into build-py).
WHEEL_ENV = PYTHON=$(PYTHON) CMAKE_BUILD_PARALLEL_LEVEL=$(JOBS) $(if $(wildcard $(DEPS_PREFIX)),CMAKE_PREFIX_PATH=$(DEPS_PREFIX))
wheel: deps
	$(WHEEL_ENV) bash scripts/build_wheel.sh --cuda

wheel-cpu: deps
	$(WHEEL_ENV) bash scripts/build_wheel.sh --cpu

fuzz:
	bash scripts/deps.sh --fuzz
	FUZZ_SECONDS=$(FUZZ_SECONDS) bash tests/fuzz/run_fuzz.sh $(BUILD)/fuzz

clean:
	rm -rf $(BUILD) build-py build-wheel-cpu build-wheel-cuda
