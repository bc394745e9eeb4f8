#!/bin/bash
# ds4sci training on a SLURM cluster, one torchrun agent per node (`srun torchrun`, c10d rendezvous).
#
# Submit from the repository (or wherever CONFIG's relative paths hold): `sbatch examples/cluster/slurm_torchrun.sh`.
# srun starts one torchrun per node; the agents meet at the first node of the allocation (c10d rendezvous) and each
# starts GPUS_PER_NODE ranks, so ds4sci sees torchrun's RANK / LOCAL_RANK / WORLD_SIZE. `--resume auto` makes the
# command line restartable: a requeued job (`sbatch --requeue`, `scontrol requeue`) continues from the newest
# checkpoint in train.out_dir, which must be on storage every node sees. Change the #SBATCH lines (account,
# partition, nodes, GPUs per node, time), GPUS_PER_NODE to match, the environment activation, and CONFIG; pass
# extra `--set KEY=VALUE` overrides in DS4SCI_ARGS, e.g.
#   sbatch --export=ALL,CONFIG=my.yaml,DS4SCI_ARGS="--set train.out_dir=/scratch/me/run1" slurm_torchrun.sh
# Tensor- and Ulysses-parallel groups must fit inside one node (parallel.tp x parallel.ulysses <= GPUS_PER_NODE):
# ds4sci refuses them otherwise.
#SBATCH --job-name=ds4sci
#SBATCH --account=CHANGE_ME
#SBATCH --partition=gpu
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=32
#SBATCH --time=04:00:00
#SBATCH --output=%x-%j.out
set -euo pipefail

# Change: load your environment (the virtualenv or conda environment where ds4sci is installed).
# source /path/to/venv/bin/activate

GPUS_PER_NODE=${GPUS_PER_NODE:-4}                        # change: as --gpus-per-node above
CONFIG=${CONFIG:-examples/configs/demo_ecoli_sp2.yaml}   # change: your config
read -r -a EXTRA <<< "${DS4SCI_ARGS:-}"                  # extra arguments, e.g. --set train.out_dir=...

# The rendezvous host: the first node of the allocation (ds4sci's own expansion where scontrol is absent).
if command -v scontrol > /dev/null; then
    HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
else
    HEAD=$(python -c 'import sys; from ds4sci.distributed.launch import expand_nodelist
print(expand_nodelist(sys.argv[1])[0])' "$SLURM_JOB_NODELIST")
fi
# One port per job (as ds4sci picks for srun alone), so two jobs sharing a node do not collide.
PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 10000))}

srun --ntasks="$SLURM_NNODES" --ntasks-per-node=1 \
    torchrun --nnodes="$SLURM_NNODES" --nproc-per-node="$GPUS_PER_NODE" \
    --rdzv-id="$SLURM_JOB_ID" --rdzv-backend=c10d --rdzv-endpoint="$HEAD:$PORT" \
    -m ds4sci.cli train "$CONFIG" --resume auto "${EXTRA[@]}"
