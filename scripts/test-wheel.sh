#!/usr/bin/env bash
# Tests an installed wheel, not the source tree: a fresh venv gets the wheel
# (and nothing of leanstep else), imports it from outside the repository, checks
# what its extension links, and runs the Python tests against it.
#   - Third-party packages (numpy, torch, megatron-core, ...) come from DEPS_VENV
#     through a .pth file, listed after the venv's own site-packages, so the
#     wheel's leanstep is the one imported (checked).
#   - ldd of the installed extension may name only glibc's libraries, libstdc++
#     and libgcc_s besides what the wheel bundles in leanstep.libs/.
# Usage: scripts/test-wheel.sh WHEEL PYTHON DEPS_VENV VENV [PYTEST ARGS ...]
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
wheel=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
python=$2
deps_venv=$(cd "$3" && pwd)
venv=$4
shift 4
tests=()
for arg in "$@"; do  # paths are given from the repository root
  if [[ -e "$root/$arg" ]]; then tests+=("$root/$arg"); else tests+=("$arg"); fi
done
[[ ${#tests[@]} -gt 0 ]] || tests=("$root/tests/python")

rm -rf "$venv"
"$python" -m venv "$venv"
venv=$(cd "$venv" && pwd)
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
deps_site=$("$deps_venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# The wheel first: with the other venv visible, pip would find its leanstep installed.
"$venv/bin/python" -m pip install -q --no-deps "$wheel"
echo "$deps_site" > "$site/_leanstep_test_deps.pth"

cd "$(mktemp -d)"  # nothing of the source tree on the path
where=$("$venv/bin/python" -c 'import leanstep, os; print(os.path.dirname(leanstep.__file__))')
if [[ "$where" != "$site/leanstep" ]]; then
  echo "test-wheel: leanstep was imported from $where, not from the wheel in $site" >&2
  exit 1
fi
ext=$(ls "$where"/_leanstep*.so)
echo "installed: $where"
ldd "$ext" | "$venv/bin/python" -c '
import os, re, sys
bundled = os.path.realpath(sys.argv[1])
system = re.compile(r"(linux-vdso|ld-linux[-\w.]*|libc|libm|libpthread|libdl|librt|libstdc\+\+|libgcc_s)\.so")
bad = []
for line in sys.stdin:
    name, _, rest = line.strip().partition(" => ")
    path = rest.split(" (")[0].strip()
    if system.match(os.path.basename(name)):
        continue
    if path and path != "not found" and os.path.realpath(path).startswith(bundled + os.sep):
        continue
    bad.append(line.strip())
if bad:
    sys.exit("test-wheel: the installed extension needs libraries outside the wheel:\n  "
             + "\n  ".join(bad))
' "$site/leanstep.libs"
ldd "$ext" | sed 's/^/  ldd: /'
"$venv/bin/python" -m pytest -q -rs -p no:cacheprovider --rootdir "$root" -c "$root/pyproject.toml" \
  "${tests[@]}"
