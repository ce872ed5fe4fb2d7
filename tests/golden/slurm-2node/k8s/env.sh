# shellcheck shell=bash
# Environment of one node of job slurm-2node (cluster: k8s), rendered by shardctl.
# Runtime values are the cluster's own variables, expanded on the node when this runs.
export OMP_NUM_THREADS=1
export PYTHONUNBUFFERED=1
export SHARDCTL_NNODES="${PET_NNODES:?set by the Kubeflow training operator in PyTorchJob pods}"
export SHARDCTL_NODE_RANK="${PET_NODE_RANK:?set by the Kubeflow training operator in PyTorchJob pods}"
export SHARDCTL_NPROC_PER_NODE="${PET_NPROC_PER_NODE:?set by the Kubeflow training operator in PyTorchJob pods}"
export MASTER_ADDR="${MASTER_ADDR:?set by the Kubeflow training operator in PyTorchJob pods}"
export MASTER_PORT="${MASTER_PORT:?set by the Kubeflow training operator in PyTorchJob pods}"
