#!/usr/bin/env bash
# Create .venv with Python >= 3.12 and install k26jax with its test extras. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."

usable() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1; }

find_python() {
  local c candidates=(python3.12 python3.13)
  if command -v pyenv >/dev/null 2>&1; then
    candidates+=("$(pyenv root)"/versions/3.1[2-9]*/bin/python3)
  fi
  candidates+=(/usr/bin/python3.13 /usr/bin/python3.12 /usr/local/bin/python3.13 /usr/local/bin/python3.12 python3)
  for c in "${candidates[@]}"; do
    if usable "$c"; then echo "$c"; return 0; fi
  done
  return 1
}

if [ ! -x .venv/bin/python ] || ! usable .venv/bin/python; then
  py=$(find_python) || { echo "setup: no Python >= 3.12 found (tried python3.12, python3.13, pyenv versions, /usr/bin/python3.13)" >&2; exit 1; }
  echo "setup: using $py ($("$py" --version))"
  rm -rf .venv
  "$py" -m venv .venv
fi
stamp=.venv/.k26jax-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[test,train]"
  touch "$stamp"
fi
echo "setup: .venv ready ($(.venv/bin/python --version))"
