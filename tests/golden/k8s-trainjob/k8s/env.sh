# shellcheck shell=bash
# Environment of one node of job k8s-tiny-v2 (cluster: k8s), rendered by shardctl.
# Runtime values are the cluster's own variables, expanded on the node when this runs.
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
