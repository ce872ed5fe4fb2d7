#!/usr/bin/env bash
# Starts the ranks of one node of job tiny-llama with torchrun (cluster: slurm).
# Rendered by shardctl: run it once per node; edit the job spec, not this file.
set -euo pipefail

# The folder of this script: the files the launcher reads lie beside it.
SHARDCTL_RENDER_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)"
export SHARDCTL_RENDER_DIR

export OMP_NUM_THREADS=1
export PYTHONUNBUFFERED=1
# the run contract (docs/reference/run-contract.md)
export SHARDCTL_JOB_NAME=tiny-llama
export SHARDCTL_RUN_DIR=runs/tiny-llama
export SHARDCTL_CHECKPOINT_DIR=runs/tiny-llama/checkpoints
export SHARDCTL_SPEC="${SHARDCTL_RENDER_DIR:-.}"/job.yaml
# watchdog: empty = derived while the job runs
export SHARDCTL_HANG_TIMEOUT_S=''
export SHARDCTL_STARTUP_TIMEOUT_S=''
export SHARDCTL_COLLECTIVE_TIMEOUT_S=1800
export SHARDCTL_NNODES="${SLURM_JOB_NUM_NODES:?run this script inside a Slurm allocation (srun)}"
# this node's index, set by Slurm
export SHARDCTL_NODE_RANK="${SLURM_NODEID:?run this script inside a Slurm allocation (srun)}"
export SHARDCTL_NPROC_PER_NODE=2
# the first node of the allocation
MASTER_ADDR="$(scontrol show hostnames "${SLURM_JOB_NODELIST:?run this script inside a Slurm allocation (srun)}")"
MASTER_ADDR="${MASTER_ADDR%%[[:space:]]*}"
export MASTER_ADDR
export MASTER_PORT=29500
# a warning waits for the script's handler: half of slurm.signal_delay_s
export SHARDCTL_WARNING_HOLD_S=60
# requeues of this job so far
export SHARDCTL_ATTEMPT="${SLURM_RESTART_COUNT:-0}"

# Hang detection: under shardctl's node agent (it set the heartbeat folder) the agent
# applies the rule and no watchdog runs; run by hand, the node watchdog starts the
# launcher and applies it.
if [[ -n "${SHARDCTL_HEARTBEAT_DIR:-}" ]]; then
  export SHARDCTL_HANG_WATCHER=agent
  set --
else
  set -- "${SHARDCTL_PYTHON:-python3}" -m shardctl.train.watchdog --
fi

exec "$@" \
    "${SHARDCTL_PYTHON:-python3}" -m shardctl.orchestrator.launch_wrapper \
    torchrun \
    --standalone \
    --nnodes 1 \
    --nproc-per-node "${SHARDCTL_NPROC_PER_NODE}" \
    -m shardctl.train "${SHARDCTL_RENDER_DIR}"/job.yaml
