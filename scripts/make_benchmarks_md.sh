#!/usr/bin/env bash
# Assemble BENCHMARKS.md from the per-benchmark sections bench/*.md (each backed by bench/results/*.json).
set -euo pipefail
cd "$(dirname "$0")/.."
{
  cat <<'HEAD'
# Benchmarks

Every figure here comes from a JSON record under `bench/results/` (device, date, commit, exact command, rows).
GPU timings are medians of back-to-back calls on the lent H200 (jax 0.11.2, Pallas-Triton); floors use the copy
and bf16-matmul ceilings measured in the same run. Timings never appear in tests. Each section below is kept as
`bench/<name>.md` and this file is rebuilt by `bash scripts/make_benchmarks_md.sh`.
HEAD
  for f in bench/tree.md bench/moe_gemm.md bench/verify_attn.md bench/convert.md bench/e2e.md; do
    [ -f "$f" ] || continue
    printf '\n---\n\n'
    sed 's/^# /## /' "$f"
  done
} > BENCHMARKS.md
echo "BENCHMARKS.md: $(wc -l < BENCHMARKS.md) lines"
