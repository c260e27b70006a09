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

# The Python package, built by scikit-build-core into the venv.
python: pydeps build
	@if [ -f pyproject.toml ]; then $(PY) -m pip install -q --no-build-isolation . ; fi

test-cpp: build
	ctest --preset release -j $(JOBS)

test-python: python
	@if ls tests/python/test_*.py >/dev/null 2>&1; then $(PY) -m pytest -q tests/python; else echo "no Python tests"; fi

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

bench: python
	$(BUILD)/release/leanstep bench grad
	@if [ -f bench/peers.py ]; then $(PY) bench/peers.py; fi

clean:
	rm -rf $(BUILD)/release $(BUILD)/debug $(BUILD)/asan $(BUILD)/tsan
