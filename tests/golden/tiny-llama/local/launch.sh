#!/usr/bin/env bash
# Starts the ranks of one node of job tiny-llama with torchrun (cluster: local).
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
# this host is every node
export SHARDCTL_NNODES=1
# preset it to start another node of a multi-node spec on this host
export SHARDCTL_NODE_RANK="${SHARDCTL_NODE_RANK:-0}"
export SHARDCTL_NPROC_PER_NODE=2
export MASTER_ADDR=127.0.0.1
export MASTER_PORT=29500
# starts of this run so far, counted by `shardctl submit`
export SHARDCTL_ATTEMPT="${SHARDCTL_ATTEMPT:-0}"

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
