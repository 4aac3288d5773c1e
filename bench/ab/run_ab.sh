#!/usr/bin/env bash
# Base tree: mkdir -p .ab/base && git archive 8cfe6cf k26jax pallas_kernels convert scripts | tar -x -C .ab/base
# Run on the device with carry [".ab"]: bash bench/ab/run_ab.sh
# The redesign's step A/B on one GPU: base (git archive 8cfe6cf in .ab/base) against this tree, alternating.
set -uo pipefail
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu.txt
python3 -c "import jax, flax; print(jax.__version__, flax.__version__)"
start=$(date +%s)
for round in 1 2; do
  for v in base new; do
    tree=.ab/base; [ $v = new ] && tree=.
    elapsed=$(( $(date +%s) - start ))
    if [ $round = 2 ] && [ $elapsed -gt 300 ]; then echo "skip round 2 ($elapsed s)"; break 2; fi
    JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache_$v JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 \
      timeout 240 python3 bench/ab/ab_step.py --tree $tree --version $v --out $OUT/ab_${v}${round}.json "$@" 2>&1 \
      | grep -v "^W0000\|^I0000" | tail -8
  done
done
echo "total $(( $(date +%s) - start )) s"
