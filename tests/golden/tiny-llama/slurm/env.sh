# shellcheck shell=bash
# Environment of one node of job tiny-llama (cluster: slurm), rendered by shardctl.
# Runtime values are the cluster's own variables, expanded on the node when this runs.
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
