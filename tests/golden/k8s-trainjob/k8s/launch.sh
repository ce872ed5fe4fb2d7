#!/usr/bin/env bash
# Starts the ranks of one node of job k8s-tiny-v2 with torchrun (cluster: k8s).
# Rendered by shardctl: run it once per node; edit the job spec, not this file.
set -euo pipefail

# The folder of this script: the files the launcher reads lie beside it.
SHARDCTL_RENDER_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)"
export SHARDCTL_RENDER_DIR

export OMP_NUM_THREADS=1
export PYTHONUNBUFFERED=1
# the run contract (docs/reference/run-contract.md)
export SHARDCTL_JOB_NAME=k8s-tiny-v2
export SHARDCTL_RUN_DIR=/shardctl/runs/k8s-tiny-v2
export SHARDCTL_CHECKPOINT_DIR=/shardctl/runs/k8s-tiny-v2/checkpoints
export SHARDCTL_SPEC=/etc/shardctl/job.yaml
# watchdog: empty = derived while the job runs
export SHARDCTL_HANG_TIMEOUT_S=''
export SHARDCTL_STARTUP_TIMEOUT_S=''
export SHARDCTL_COLLECTIVE_TIMEOUT_S=1800
export SHARDCTL_NNODES="${PET_NNODES:?set by the torch plugin of Kubeflow Trainer in TrainJob pods}"
export SHARDCTL_NODE_RANK="${PET_NODE_RANK:?set by the torch plugin of Kubeflow Trainer in TrainJob pods}"
export SHARDCTL_NPROC_PER_NODE="${PET_NPROC_PER_NODE:?set by the torch plugin of Kubeflow Trainer in TrainJob pods}"
export MASTER_ADDR="${PET_MASTER_ADDR:?set by the torch plugin of Kubeflow Trainer in TrainJob pods}"
export MASTER_PORT="${PET_MASTER_PORT:?set by the torch plugin of Kubeflow Trainer in TrainJob pods}"
# where the node agent keeps this node's starts and restarts ('': nowhere)
export SHARDCTL_POD_COUNTS=/shardctl/runs/k8s-tiny-v2/.attempts
# the pod's exit code carries the decision: 0 done, 128-255 restart, 1-127 stop
export SHARDCTL_EXIT_CODES=kubernetes
# restarts of this node after a crash or a hang (k8s.backoff_limit; 0 with neither k8s.pvc nor an s3:// checkpoint.dir)
export SHARDCTL_POD_RESTARTS=6

exec "${SHARDCTL_PYTHON:-python3}" -m shardctl.orchestrator.clusters.k8s --watch-hangs -- \
    "${SHARDCTL_PYTHON:-python3}" -m shardctl.orchestrator.launch_wrapper \
    torchrun \
    --nnodes "${SHARDCTL_NNODES}" \
    --nproc-per-node "${SHARDCTL_NPROC_PER_NODE}" \
    --rdzv-backend c10d \
    --rdzv-endpoint "${MASTER_ADDR}":"${MASTER_PORT}" \
    --rdzv-id k8s-tiny-v2 \
    -m shardctl.train /etc/shardctl/job.yaml
