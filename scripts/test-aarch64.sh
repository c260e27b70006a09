#!/usr/bin/env bash
# make test-aarch64: the C++ library and its tests cross-built for 64-bit Arm
# (the Ascend hosts' CPU) and run under qemu-user, in four passes:
#   1. the tests (AARCH64_AREAS, e.g. "grad moe": those areas' test programs,
#      the conformance harness and the host-memory tests; empty: all), 4 KiB pages,
#      qemu's default CPU (NEON, SVE and SVE2 at 512 bits);
#   2. the host-memory tests and the conformance harness with 64 KiB pages
#      (qemu's -p: the guest's sysconf page size);
#   3. the conformance harness with SVE vectors of 128, 256 and 2048 bits
#      (AARCH64_SVE_BITS narrows the list; every Highway target each exposes,
#      listed as it runs);
#   4. the digests of every bitwise conformance output, diffed against the
#      x86-64 build's: arm64 must give the same bits wherever x86-64 is bitwise.
# AARCH64_OWN_TARGETS=1 (CI's short run) narrows the harness in passes 2 and 3 to
# what each pass alone exercises: with 64 KiB pages the best target (the page size
# reaches the allocations, not the vector code), and at an SVE length with a
# Highway target of its own (SVE2_128, SVE_256) that target alone; the
# length-agnostic targets (SVE, SVE2) run at 512 bits in pass 1, and NEON's
# 128-bit code is the same at every length. Under qemu an SVE target costs about
# 28 s a pass at 256 bits, 33 at 512, NEON 3 (measured, 2-core x86-64 host).
# Installs what is missing first (Debian's arm64 packages, as root).
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS=${JOBS:-$(nproc)}
AREAS=${AARCH64_AREAS:-}
SVE_BITS=${AARCH64_SVE_BITS:-128 256 2048}
OWN_TARGETS=${AARCH64_OWN_TARGETS:-}
case $OWN_TARGETS in
  ""|0|1) ;;
  *) echo "AARCH64_OWN_TARGETS: must be empty, 0 or 1, got '$OWN_TARGETS'" >&2; exit 1 ;;
esac
[ "$OWN_TARGETS" = 0 ] && OWN_TARGETS=
# The harness's targets for a pass (LEANSTEP_CONFORMANCE_TARGETS; empty: every one).
page_pass_targets() { [ -n "$OWN_TARGETS" ] && echo SVE2 || true; }
sve_pass_targets() {
  [ -n "$OWN_TARGETS" ] || return 0
  case $1 in 128) echo SVE2_128 ;; 256) echo SVE_256 ;; esac
}
for bits in $SVE_BITS; do
  case $bits in
    128|256|512|1024|2048) ;;
    *) echo "AARCH64_SVE_BITS: each length must be 128, 256, 512, 1024 or 2048 bits, got '$bits'" >&2; exit 1 ;;
  esac
done
# The programs passes 2 to 4 need.
HARNESS=test_dispatch_conformance
HOST_MEMORY=test_core_host_memory

install_missing() {
  local packages=(g++-aarch64-linux-gnu qemu-user-static libhwy-dev:arm64 libgtest-dev:arm64
                  libfmt-dev:arm64 libopenblas-dev:arm64 libgomp1:arm64)
  local missing=()
  for p in "${packages[@]}"; do
    [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" = "install ok installed" ] || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  echo "installing arm64 packages: ${missing[*]}"
  local sudo=""
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || { echo "need root (or sudo) to install: ${missing[*]}" >&2; exit 1; }
    sudo=sudo
  fi
  dpkg --print-foreign-architectures | grep -qx arm64 || $sudo dpkg --add-architecture arm64
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -q
  $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
}

install_missing
QEMU=$(command -v qemu-aarch64-static || command -v qemu-aarch64) ||
  { echo "test-aarch64: no qemu-aarch64-static on PATH (Debian: qemu-user-static)" >&2; exit 1; }
run_arm() { "$QEMU" -L / "$@"; }

cmake --preset aarch64 >/dev/null
labels=()
if [ -z "$AREAS" ]; then
  cmake --build --preset aarch64 -j "$JOBS"
else
  # The areas' test programs (tests/cpp/test_<area>[_<what>].cpp, labelled <area>).
  programs=()
  for area in $AREAS; do
    for src in tests/cpp/test_"$area".cpp tests/cpp/test_"$area"_*.cpp; do
      [ -e "$src" ] && programs+=("$(basename "$src" .cpp)")
    done
  done
  [ ${#programs[@]} -gt 0 ] || { echo "AARCH64_AREAS='$AREAS' names no test program" >&2; exit 1; }
  cmake --build --preset aarch64 -j "$JOBS" --target "${programs[@]}" $HARNESS $HOST_MEMORY
  labels=(-L "^($(echo $AREAS | tr ' ' '|'))\$")
fi

echo "== 1. tests, 4 KiB pages, qemu's default CPU${AREAS:+ (areas: $AREAS, the harness, host memory)}"
ctest --preset aarch64 -j "$JOBS" --no-tests=error "${labels[@]}"
if [ -n "$AREAS" ]; then
  ctest --preset aarch64 -j "$JOBS" --no-tests=error -R '^(Conformance\.|HostPool\.|HostMemory)'
fi

echo "== 2. 64 KiB pages"
# LEANSTEP_EXPECT_PAGE_BYTES: the test checks that the emulated system really
# reports 64 KiB (the huge page stays the host's, read through qemu).
QEMU_PAGESIZE=65536 LEANSTEP_EXPECT_PAGE_BYTES=65536 run_arm build/aarch64/tests/cpp/$HOST_MEMORY --gtest_brief=1
QEMU_PAGESIZE=65536 LEANSTEP_CONFORMANCE_TARGETS="$(page_pass_targets)" \
  run_arm build/aarch64/tests/cpp/$HARNESS --gtest_brief=1 \
  --gtest_filter='Conformance.EveryImplementation*'

echo "== 3. SVE vector lengths"
for bits in $SVE_BITS; do
  bytes=$((bits / 8))
  echo "-- SVE vectors of $bits bits"
  log=build/aarch64/sve-$bits.log
  if ! QEMU_CPU="max,sve-default-vector-length=$bytes" \
      LEANSTEP_CONFORMANCE_TARGETS="$(sve_pass_targets "$bits")" run_arm build/aarch64/tests/cpp/$HARNESS \
      --gtest_brief=1 --gtest_filter='Conformance.EveryImplementation*' >"$log" 2>&1; then
    cat "$log"
    exit 1
  fi
  grep -E "Highway targets run|PASSED" "$log"
done

echo "== 4. bitwise outputs, arm64 against x86-64"
cmake --preset release >/dev/null
cmake --build --preset release -j "$JOBS" --target $HARNESS
digests=build/aarch64/digests
mkdir -p $digests
rm -f $digests/x86_64.txt $digests/aarch64.txt
LEANSTEP_CONFORMANCE_DIGEST=$digests/x86_64.txt build/release/tests/cpp/$HARNESS --gtest_brief=1 \
  --gtest_filter='Conformance.BitwiseOutputs*'
LEANSTEP_CONFORMANCE_DIGEST=$digests/aarch64.txt run_arm build/aarch64/tests/cpp/$HARNESS --gtest_brief=1 \
  --gtest_filter='Conformance.BitwiseOutputs*'
for f in $digests/x86_64.txt $digests/aarch64.txt; do
  [ -s "$f" ] || { echo "test-aarch64: no digests written to $f" >&2; exit 1; }
done
if ! diff -u $digests/x86_64.txt $digests/aarch64.txt; then
  echo "aarch64: bitwise outputs differ from x86-64 (above: op / case / implementation / seed)" >&2
  exit 1
fi
echo "aarch64: $(wc -l <$digests/aarch64.txt) op / case / implementation / seed digests identical to x86-64"
