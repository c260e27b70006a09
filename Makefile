# Set-up and everyday targets. `make demo` and `make test` each install what is
# missing first (Debian packages as root, Python packages into build/venv).
BUILD   := build
VENV    := $(BUILD)/venv
PY      := $(VENV)/bin/python
# The second Megatron-Core line (0.17+, tested with 0.19.2) needs Python 3.12.
VENV312 := $(BUILD)/venv312
PY312   := $(VENV312)/bin/python
PYTHON312 := $(shell scripts/find-python312.sh)
JOBS    ?= $(shell nproc)
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1

.PHONY: all sysdeps pydeps pydeps312 build python python312 test test-cpp test-python demo-host-bound \
        test-python312 test-asan test-tsan test-fuzz test-aarch64 wheel test-wheel demo demo-cpp demo-hf bench clean

all: build

sysdeps:
	@scripts/install-system-deps.sh

pydeps: sysdeps $(VENV)/.installed

$(VENV)/.installed: requirements-dev.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-dev.txt
	touch $@

# megatron-core 0.19.2 in a Python 3.12 venv, when this machine has a 3.12.
pydeps312: sysdeps
ifneq ($(PYTHON312),)
	@$(MAKE) --no-print-directory $(VENV312)/.installed
endif

$(VENV312)/.installed: requirements-mcore019.txt
	$(PYTHON312) -m venv $(VENV312)
	$(PY312) -m pip install -q --upgrade pip
	$(PY312) -m pip install -q -r requirements-mcore019.txt
	touch $@

build: sysdeps
	cmake --preset release >/dev/null
	cmake --build --preset release -j $(JOBS)

# The Python package, built by scikit-build-core into the venv (its own
# incremental CMake build under build/python/).
python: pydeps
	$(PY) -m pip install -q --no-build-isolation .

test-cpp: build
	ctest --preset release -j $(JOBS)

test-python: python
	$(PY) -m pytest -q -rs tests/python

python312: pydeps312
ifneq ($(PYTHON312),)
	$(PY312) -m pip install -q --no-build-isolation .
endif

# The whole Python suite again on Python 3.12 with megatron-core 0.19.2. A
# machine without a Python 3.12 cannot test the 0.17+ line: it says so.
# PY312_TESTS narrows the 3.12 run (CI: the tests that touch Megatron-Core or
# ms-swift, whose version is what this run adds); by default it is every test.
PY312_TESTS ?= tests/python
test-python312: python312
ifneq ($(PYTHON312),)
	$(PY312) -m pytest -q -rs $(PY312_TESTS)
else
	@echo "NOT TESTED: megatron-core 0.17+ (no Python 3.12 on this machine; install one, e.g. with pyenv)"
endif

test: test-cpp test-python test-python312

# Release wheels (manylinux, the libraries they need bundled) for the Python
# versions present, and an sdist: build/wheel/. See docs/install.md.
WHEEL_DIR := $(BUILD)/wheel
wheel: pydeps pydeps312
	scripts/build-wheels.sh $(WHEEL_DIR) $(PY) $(if $(PYTHON312),$(PY312))

# Each wheel installed into a fresh venv and tested from outside the source tree
# (WHEEL_TESTS: which tests; CI runs a short list).
WHEEL_TESTS ?= tests/python
test-wheel: wheel
	scripts/test-wheel.sh $(wildcard $(WHEEL_DIR)/leanstep-*-cp311-*.whl) $(PY) $(VENV) \
		$(BUILD)/wheel-venv $(WHEEL_TESTS)
ifneq ($(PYTHON312),)
	scripts/test-wheel.sh $(wildcard $(WHEEL_DIR)/leanstep-*-cp312-*.whl) $(PY312) $(VENV312) \
		$(BUILD)/wheel-venv312 $(WHEEL_TESTS)
endif

# The C++ library and tests cross-built for aarch64 and run under qemu-user:
# 4 KiB and 64 KiB pages, SVE at four vector lengths, bitwise outputs diffed
# against x86-64's (scripts/test-aarch64.sh). AARCH64_AREAS narrows pass 1 to
# some areas' tests, plus the harness and the host-memory tests (CI: grad
# rmsnorm moe); by default, all. AARCH64_SVE_BITS narrows the SVE lengths of
# pass 3 (CI: 128 256, the two that expose targets of their own). AARCH64_OWN_TARGETS=1
# (CI) runs, in passes 2 and 3, only the Highway targets each pass alone exercises.
AARCH64_AREAS ?=
AARCH64_SVE_BITS ?=
AARCH64_OWN_TARGETS ?=
test-aarch64: sysdeps
	AARCH64_AREAS="$(AARCH64_AREAS)" AARCH64_SVE_BITS="$(AARCH64_SVE_BITS)" \
	AARCH64_OWN_TARGETS="$(AARCH64_OWN_TARGETS)" JOBS=$(JOBS) scripts/test-aarch64.sh

test-asan: sysdeps
	cmake --preset asan >/dev/null
	cmake --build --preset asan -j $(JOBS)
	ctest --preset asan -j $(JOBS)

test-tsan: sysdeps
	cmake --preset tsan >/dev/null
	cmake --build --preset tsan -j $(JOBS) --target tsan_tests
	ctest --preset tsan -j $(JOBS) --no-tests=error

# libFuzzer targets (tests/fuzz: step logs, configs, plans/diffs, safetensors)
# under ASan + UBSan, each for FUZZ_SECONDS from its committed seed corpus
# (tests/fuzz/corpus/<target>; new inputs go to build/fuzz/work, findings to
# build/fuzz/findings). Any finding fails the target.
FUZZ_SECONDS ?= 45
FUZZ_TARGETS := steplog config plan safetensors
test-fuzz: sysdeps
	cmake --preset fuzz >/dev/null
	cmake --build --preset fuzz -j $(JOBS)
	@for t in $(FUZZ_TARGETS); do \
	  mkdir -p $(BUILD)/fuzz/work/$$t $(BUILD)/fuzz/findings; \
	  echo "fuzz_$$t: $(FUZZ_SECONDS) s from tests/fuzz/corpus/$$t"; \
	  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
	  $(BUILD)/fuzz/tests/fuzz/fuzz_$$t -max_total_time=$(FUZZ_SECONDS) -timeout=10 -rss_limit_mb=2048 \
	    -max_len=8192 -print_final_stats=1 -artifact_prefix=$(BUILD)/fuzz/findings/$$t- \
	    $(BUILD)/fuzz/work/$$t tests/fuzz/corpus/$$t 2>$(BUILD)/fuzz/$$t.log \
	    || { tail -n 60 $(BUILD)/fuzz/$$t.log; echo "fuzz_$$t: FINDING (input in $(BUILD)/fuzz/findings/)"; exit 1; }; \
	  grep -E "^(stat::number_of_executed_units|Done)" $(BUILD)/fuzz/$$t.log | tr '\n' ' '; echo; \
	done
	@echo "fuzzing: 0 findings"

# The main job: real Megatron-Core MoE-LoRA training on 2 gloo CPU ranks
# (python -m leanstep.megatron.train --help), at EP 1 and EP 2: a
# counterbalanced crossover of baseline, rmsnorm, grad and all, an audit of
# one step per condition, the baseline-vs-all agreement. megatron-core 0.16.1
# (Python 3.11), then 0.19.2 when this machine has a Python 3.12.
DEMO_DIR := $(BUILD)/demo
# The main job on built-in defaults, then its host-bound configuration (below), then the
# Hugging Face job: about 2.5 + 2 minutes a line and 0.5 here (2-core VM), 10 in all.
# This VM's speed drifts by up to 2x within days; the run counts fit its fast state.
demo: python python312
	@rm -rf $(DEMO_DIR) && mkdir -p $(DEMO_DIR)
	$(PY) -m leanstep.megatron.train --out $(DEMO_DIR)/megatron-0.16
ifneq ($(PYTHON312),)
	$(PY312) -m leanstep.megatron.train --out $(DEMO_DIR)/megatron-0.19
else
	@echo "NOT RUN: megatron-core 0.17+ (no Python 3.12 on this machine)"
endif
	$(MAKE) --no-print-directory demo-host-bound INSTALLED=1
	$(MAKE) --no-print-directory demo-hf INSTALLED=1

# The demo's parts install the package first when run alone; inside `make demo`
# (INSTALLED=1) it was installed once above (each install costs about 15 s).
DEMO_INSTALLS = $(if $(INSTALLED),,python python312)
DEMO_INSTALL = $(if $(INSTALLED),,python)

# The host-bound configuration of the main job (the seed's rank shape at tiny widths,
# 816 LoRA tensors per rank): its crossover at EP 1 on each Megatron-Core line, where
# leanstep's host path, not the kernels, decides. It compares baseline and all (and the
# A/A), the arms the host-path issue judges, in 12 runs of 3 cycles: 72 timed steps of
# each (60 with all five conditions in 10 runs), 4 runs of each at every matched position
# (2), closer in time (a cycle of 6 steps, not 10), in 20 steps a run, not 32, so that
# `make demo` fits 12 minutes in this VM's slow state too. The default job above keeps
# the per-family arms. About 2 minutes a line.
HOST_BOUND := --config host-bound --phases crossover --ep 1 --conditions baseline,all \
	--runs 12 --cycles 3
demo-host-bound: $(DEMO_INSTALLS)
	$(PY) -m leanstep.megatron.train $(HOST_BOUND) --out $(DEMO_DIR)/megatron-0.16-host-bound
ifneq ($(PYTHON312),)
	$(PY312) -m leanstep.megatron.train $(HOST_BOUND) --out $(DEMO_DIR)/megatron-0.19-host-bound
else
	@echo "NOT RUN: megatron-core 0.17+ (no Python 3.12 on this machine)"
endif

# The C++ training step, the example for C++ callers of the library: the same
# crossover on leanstep's own C++ model, 2 MPI ranks.
DEMO_MPI := mpirun -np 2 --oversubscribe -x OMP_NUM_THREADS=1 -x OPENBLAS_NUM_THREADS=1
# The Hugging Face example job: Qwen3-MoE LoRA on the HF Trainer, crossover of
# leanstep's RMSNorm swap, clip and experts backend (about 30 s here).
demo-hf: $(DEMO_INSTALL)
	$(PY) -m leanstep.transformers.train --out $(DEMO_DIR)/transformers

demo-cpp: build
	@mkdir -p $(DEMO_DIR)/cpp
	$(DEMO_MPI) $(BUILD)/release/leanstep train --config examples/tiny-moe/tiny.json \
	  --crossover examples/tiny-moe/crossover-plan.json --log $(DEMO_DIR)/cpp/steps.jsonl

bench: build python
	$(BUILD)/release/leanstep bench grad
	$(PY) bench/peers.py
	$(PY) bench/host_overhead.py --json

clean:
	rm -rf $(BUILD)/release $(BUILD)/debug $(BUILD)/asan $(BUILD)/tsan
