#!/usr/bin/env bash
# Prints the path of a Python interpreter of at least the version given ($1, e.g. 3.12) and below $2 if given.
# pyenv shims on PATH refuse to run unless their version is selected, so every candidate is actually run.
set -u
want=${1:?usage: find_python.sh MIN [BELOW]}
below=${2:-99.0}
ok() {
  "$1" -c "import sys; v=sys.version_info[:2]; lo=tuple(map(int,'$want'.split('.'))); hi=tuple(map(int,'$below'.split('.'))); sys.exit(0 if lo<=v<hi else 1)" >/dev/null 2>&1
}
candidates=()
for v in 3.14 3.13 3.12 3.11; do candidates+=("python$v"); done
candidates+=(python3)
if command -v pyenv >/dev/null 2>&1; then
  for p in "$(pyenv root)"/versions/3.*/bin/python3; do candidates+=("$p"); done
fi
for p in /usr/bin/python3.* /usr/local/bin/python3.*; do [ -x "$p" ] && candidates+=("$p"); done
for c in "${candidates[@]}"; do
  if ok "$c"; then
    "$c" -c 'import sys; print(sys.executable)'
    exit 0
  fi
done
echo "error: no Python >= $want (and < $below) found; install one (e.g. 'pyenv install $want') and run make again" >&2
exit 1
