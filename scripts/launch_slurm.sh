#!/usr/bin/env bash
# Example: one k26jax job on 2 hosts x 8 GPUs under SLURM, one process per host owning all 8 of its GPUs.
#
#   sbatch scripts/launch_slurm.sh PROGRAM.py [ARGS...]
#
# PROGRAM.py calls k26jax.distributed.initialize() before anything touches a device (see docs/MULTIHOST.md for a
# complete one). Every process runs the same program; process 0 (the first host) also runs the coordination
# service on K26JAX_PORT. Site-specific network settings (the InfiniBand HCAs NCCL should use, the interface for
# its bootstrap) go where marked.
#SBATCH --job-name=k26jax
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=01:00:00
set -euo pipefail

if [ $# -lt 1 ]; then
    echo "usage: sbatch $0 PROGRAM.py [ARGS...]" >&2
    exit 2
fi
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"

head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export K26JAX_COORDINATOR="${head_node}:${K26JAX_PORT:-12355}"
export K26JAX_NUM_PROCESSES="$SLURM_NNODES"
export K26JAX_INIT_TIMEOUT_S="${K26JAX_INIT_TIMEOUT_S:-300}"          # every host must join within this
export K26JAX_HEARTBEAT_TIMEOUT_S="${K26JAX_HEARTBEAT_TIMEOUT_S:-60}"  # a dead host stops the others within this
# Site-specific, for example:
# export NCCL_IB_HCA=mlx5_0,mlx5_1,mlx5_2,mlx5_3,mlx5_4,mlx5_5,mlx5_6,mlx5_7
# export NCCL_SOCKET_IFNAME=eth0

# K26JAX_PROCESS_ID differs per task, so it is read inside each task; --kill-on-bad-exit ends the step when one
# process exits non-zero (e.g. k26jax.distributed.EXIT_PEER_LOST) instead of leaving the other to time out.
srun --ntasks-per-node=1 --kill-on-bad-exit=1 \
    bash -c 'K26JAX_PROCESS_ID=$SLURM_PROCID exec .venv/bin/python "$@"' k26jax "$@"
