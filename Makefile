# flashcpp — top-level entry points (see README.md).
#   make test      install what is missing, build, run every CPU test (what CI runs)
#   make run       build and run `flashcpp check` (CUDA if a GPU is present, else the CPU backend)
#   make gpu-test  on an NVIDIA machine: build, GPU tests, correctness reports
#   make bench     on an NVIDIA machine: peers vs flashcpp, reports/<area>/benchmark.{csv,png}
SHELL := /bin/bash
BUILD ?= build
JOBS ?= $(shell nproc)
FUZZ_SECONDS ?= 60
CUDA ?= $(shell command -v nvcc >/dev/null 2>&1 && echo ON || echo OFF)
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes || echo no)
PYTHON ?= python3
# Header-only dependencies unpacked from carried .deb files (machines without network).
DEPS_PREFIX := $(CURDIR)/.deps/usr
CMAKE_ARGS ?=
CMAKE_PREFIX := $(if $(wildcard $(DEPS_PREFIX)),-DCMAKE_PREFIX_PATH=$(DEPS_PREFIX),)
GPU_AREA ?= prefill

.PHONY: all deps configure build test run gpu-test bench fuzz python-test clean
all: build

deps:
	bash scripts/deps.sh

$(BUILD)/build.ninja:
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHCPP_CUDA=$(CUDA) $(CMAKE_PREFIX) $(CMAKE_ARGS)

configure: deps $(BUILD)/build.ninja

build: configure
	@start=$$(date +%s); cmake --build $(BUILD) -j $(JOBS) || exit 1; \
	echo "build: $$(( $$(date +%s) - start )) s (CUDA=$(CUDA), jobs=$(JOBS))"

test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) --timeout 600
	./$(BUILD)/flashcpp check --backend cpu --quick --json $(BUILD)/cpu_correctness_report.json
	FUZZ_SECONDS=$(FUZZ_SECONDS) bash tests/fuzz/run_fuzz.sh $(BUILD)/fuzz
	bash python/ci_test.sh

run: build
ifeq ($(HAS_GPU),yes)
	./$(BUILD)/flashcpp check --backend cuda --quick
else
	./$(BUILD)/flashcpp check --backend cpu --quick
endif

# ---- NVIDIA machine ----------------------------------------------------------------------
gpu-test: build
	mkdir -p reports/$(GPU_AREA)
	./$(BUILD)/flashcpp_gpu_tests
	./$(BUILD)/flashcpp check --backend cuda --full --json reports/$(GPU_AREA)/correctness_report.json

bench: build
	$(PYTHON) -m pip install --no-build-isolation --no-deps -q . 2>&1 | tail -2
	$(PYTHON) -m flashcpp.bench $(GPU_AREA)

fuzz:
	FUZZ_SECONDS=$(FUZZ_SECONDS) bash tests/fuzz/run_fuzz.sh $(BUILD)/fuzz

clean:
	rm -rf $(BUILD) build-py
