#!/bin/bash

# Parameters
#SBATCH --cpus-per-task=1
#SBATCH --job-name=tiny
#SBATCH --no-kill
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
#SBATCH --open-mode=append
#SBATCH --output=/runs/tiny/submitit/%j_0_log.out
#SBATCH --partition=debug
#SBATCH --requeue
#SBATCH --signal=USR2@20
#SBATCH --time=10
#SBATCH --wckey=submitit

# setup
export PYTHONPATH=/src/hpctrain${PYTHONPATH:+:$PYTHONPATH}
export GLOO_SOCKET_IFNAME=lo
export OMP_NUM_THREADS=1

# command
export SUBMITIT_EXECUTOR=slurm
python -u -m submitit.core._submit /runs/tiny/submitit
