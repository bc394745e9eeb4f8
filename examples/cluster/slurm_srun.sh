#!/bin/bash
# ds4sci training on a SLURM cluster, one task per GPU started by `srun` alone (no torchrun).
#
# Submit from the repository (or wherever CONFIG's relative paths hold): `sbatch examples/cluster/slurm_srun.sh`.
# srun starts every rank itself; ds4sci reads its rank, world size and local rank from SLURM_PROCID, SLURM_NTASKS
# and SLURM_LOCALID, the tasks per node from SLURM_STEP_TASKS_PER_NODE, and meets at the first host of the step's
# node list on port 20000 + job id % 10000 (set MASTER_ADDR / MASTER_PORT to override). A missing or garbled
# variable stops the run with one line naming it. `--resume auto` makes a requeued job continue from the newest
# checkpoint in train.out_dir, which must be on storage every node sees. Change the #SBATCH lines (account,
# partition, nodes, tasks = GPUs per node, time), the environment activation, and CONFIG; pass extra
# `--set KEY=VALUE` overrides in DS4SCI_ARGS, e.g.
#   sbatch --export=ALL,CONFIG=my.yaml,DS4SCI_ARGS="--set train.out_dir=/scratch/me/run1" slurm_srun.sh
# Tensor- and Ulysses-parallel groups must fit inside one node (parallel.tp x parallel.ulysses <= tasks per node):
# ds4sci refuses them otherwise.
#SBATCH --job-name=ds4sci
#SBATCH --account=CHANGE_ME
#SBATCH --partition=gpu
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=8
#SBATCH --time=04:00:00
#SBATCH --output=%x-%j.out
set -euo pipefail

# Change: load your environment (the virtualenv or conda environment where ds4sci is installed).
# source /path/to/venv/bin/activate

CONFIG=${CONFIG:-examples/configs/demo_ecoli_sp2.yaml}   # change: your config
read -r -a EXTRA <<< "${DS4SCI_ARGS:-}"                  # extra arguments, e.g. --set train.out_dir=...

srun python -m ds4sci.cli train "$CONFIG" --resume auto "${EXTRA[@]}"
