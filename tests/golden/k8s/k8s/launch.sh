#!/usr/bin/env bash
# Starts the ranks of one node of job k8s-tiny with torchrun (cluster: k8s).
# Rendered by shardctl: run it once per node; edit the job spec, not this file.
set -euo pipefail

# The folder of this script: the files the launcher reads lie beside it.
SHARDCTL_RENDER_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)"
export SHARDCTL_RENDER_DIR

export OMP_NUM_THREADS=1
export PYTHONUNBUFFERED=1
export SHARDCTL_NNODES="${PET_NNODES:?set by the Kubeflow training operator in PyTorchJob pods}"
export SHARDCTL_NODE_RANK="${PET_NODE_RANK:?set by the Kubeflow training operator in PyTorchJob pods}"
export SHARDCTL_NPROC_PER_NODE="${PET_NPROC_PER_NODE:?set by the Kubeflow training operator in PyTorchJob pods}"
export MASTER_ADDR="${MASTER_ADDR:?set by the Kubeflow training operator in PyTorchJob pods}"
export MASTER_PORT="${MASTER_PORT:?set by the Kubeflow training operator in PyTorchJob pods}"

exec torchrun \
    --nnodes "${SHARDCTL_NNODES}" \
    --nproc-per-node "${SHARDCTL_NPROC_PER_NODE}" \
    --rdzv-backend c10d \
    --rdzv-endpoint "${MASTER_ADDR}":"${MASTER_PORT}" \
    --rdzv-id k8s-tiny \
    -m shardctl.train /etc/shardctl/job.yaml
