#!/bin/bash

# Parameters
#SBATCH --cpus-per-task=2
#SBATCH --error=runs/k8s-tiny-v2/submitit/%j/%j_0_log.err
#SBATCH --job-name=k8s-tiny-v2
#SBATCH --mem=4G
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --open-mode=append
#SBATCH --output=runs/k8s-tiny-v2/submitit/%j/%j_0_log.out
#SBATCH --requeue
#SBATCH --signal=USR2@120
#SBATCH --time=60
#SBATCH --wckey=submitit

# command
export SUBMITIT_EXECUTOR=slurm
srun --unbuffered --output runs/k8s-tiny-v2/submitit/%j/%j_%t_log.out --error runs/k8s-tiny-v2/submitit/%j/%j_%t_log.err python3 -u -m submitit.core._submit runs/k8s-tiny-v2/submitit/%j
