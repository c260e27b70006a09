#!/usr/bin/env bash
# Installs the Debian 12 packages leanstep needs, only those missing.
set -euo pipefail
packages=(
  cmake g++ make pkg-config
  libgtest-dev libbenchmark-dev libhwy-dev nlohmann-json3-dev libcli11-dev libfmt-dev libdlpack-dev
  libopenmpi-dev openmpi-bin libopenblas-dev
  python3 python3-venv python3-dev
  clang libclang-rt-14-dev libomp-dev
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
echo "installing system packages: ${missing[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "need root (or sudo) to install: ${missing[*]}" >&2; exit 1; }
  SUDO=sudo
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
