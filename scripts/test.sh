#!/usr/bin/env bash
# Set up if needed, then run the CPU test suite (8 emulated devices) in 2 worker processes, each test file on one
# (its module fixtures built once): 10 min on CI's 2 cores against 16 in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -n 2 --dist loadfile "$@"
