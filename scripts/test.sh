#!/usr/bin/env bash
# Set up if needed, then run the CPU test suite (8 emulated devices).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
