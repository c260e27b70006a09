# Set-up and everyday targets. `make demo` and `make test` each install what is
# missing first (Debian packages as root, Python packages into build/venv).
BUILD   := build
VENV    := $(BUILD)/venv
PY      := $(VENV)/bin/python
JOBS    ?= $(shell nproc)
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1

.PHONY: all sysdeps pydeps build python test test-cpp test-python test-asan test-tsan demo bench clean

all: build

sysdeps:
	@scripts/install-system-deps.sh

pydeps: sysdeps $(VENV)/.installed

$(VENV)/.installed: requirements-dev.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-dev.txt
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
	$(PY) -m pytest -q tests/python

test: test-cpp test-python

test-asan: sysdeps
	cmake --preset asan >/dev/null
	cmake --build --preset asan -j $(JOBS)
	ctest --preset asan -j $(JOBS)

test-tsan: sysdeps
	cmake --preset tsan >/dev/null
	cmake --build --preset tsan -j $(JOBS) --target tsan_tests
	ctest --preset tsan -j $(JOBS) --no-tests=error

demo: pydeps build
	$(BUILD)/release/leanstep demo

bench: build python
	$(BUILD)/release/leanstep bench grad
	$(PY) bench/peers.py

clean:
	rm -rf $(BUILD)/release $(BUILD)/debug $(BUILD)/asan $(BUILD)/tsan
