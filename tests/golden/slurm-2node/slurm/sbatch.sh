#!/bin/bash
# Job slurm-2node, rendered by shardctl: `shardctl submit --cluster slurm` has
# submitit submit exactly this script; submitit's entry point runs the node task.
#SBATCH --cpus-per-task=2
#SBATCH --error=runs/slurm-2node/submitit/%j/%j_0_log.err
#SBATCH --job-name=slurm-2node
#SBATCH --mem=4G
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --open-mode=append
#SBATCH --output=runs/slurm-2node/submitit/%j/%j_0_log.out
#SBATCH --requeue
#SBATCH --signal=USR2@120
#SBATCH --time=20

# SIGUSR2 sent to this shell alone (scancel --batch, --signal=B:...) would end
# it and fail the job: it is written down for every node task, which passes it on
# to the ranks (they save) and requeues the job.
shardctl_warnings=runs/slurm-2node/warnings
shardctl_warning="${shardctl_warnings}/slurm-${SLURM_JOB_ID:-0}-${SLURM_RESTART_COUNT:-0}"
trap 'mkdir -p -- "${shardctl_warnings}" && : > "${shardctl_warning}"' USR2

# command
export SUBMITIT_EXECUTOR=slurm
srun --unbuffered --output runs/slurm-2node/submitit/%j/%j_%t_log.out --error runs/slurm-2node/submitit/%j/%j_%t_log.err env --block-signal=USR2 python3 -u -m submitit.core._submit runs/slurm-2node/submitit/%j &
shardctl_srun=$!
# wait returns early when the trap runs; srun still runs then, so wait again.
while kill -0 "${shardctl_srun}" 2>/dev/null; do wait "${shardctl_srun}"; done
wait "${shardctl_srun}"
