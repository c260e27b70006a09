#!/usr/bin/env bash
# Prints the path of a Python 3.12 interpreter (megatron-core 0.17+ needs
# Python >= 3.12), or nothing. pyenv's bare python3.12 shim fails unless
# 3.12 is selected, so ask pyenv for the prefix of an installed 3.12.
set -u
if command -v pyenv >/dev/null 2>&1; then
  for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.[0-9]+)?$' | sort -V -r); do
    prefix=$(pyenv prefix "$v" 2>/dev/null) || continue
    if [ -x "$prefix/bin/python3.12" ]; then echo "$prefix/bin/python3.12"; exit 0; fi
  done
fi
for candidate in python3.12 /usr/bin/python3.12 /usr/local/bin/python3.12; do
  path=$(command -v "$candidate" 2>/dev/null) || continue
  if "$path" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then
    echo "$path"; exit 0
  fi
done
exit 0
