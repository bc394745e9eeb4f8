#!/bin/bash
# ds4sci training on a PBS cluster with `mpiexec` (ALCF Polaris style: PBS Pro, Cray PALS / MPICH).
#
# Submit from the repository: `qsub examples/cluster/pbs_mpiexec.sh` (the job starts in $PBS_O_WORKDIR).
# mpiexec starts NRANKS_PER_NODE ranks on each node of $PBS_NODEFILE; ds4sci reads its rank and world size from
# PMI_RANK / PMI_SIZE and its local rank from PALS_LOCAL_RANKID (MPICH: MPI_LOCALRANKID), and meets at MASTER_ADDR,
# the first host of $PBS_NODEFILE. `--resume auto` makes a rerun job continue from the newest checkpoint in
# train.out_dir, which must be on storage every node sees (on Polaris: /eagle or /grand, not /local/scratch).
# Change the #PBS lines (project, queue, nodes, file systems, time), NRANKS_PER_NODE (GPUs per node: 4 on Polaris),
# the environment activation, and CONFIG; pass extra `--set KEY=VALUE` overrides in DS4SCI_ARGS, e.g.
#   qsub -v CONFIG=my.yaml,DS4SCI_ARGS="--set train.out_dir=/eagle/me/run1" pbs_mpiexec.sh
# Tensor- and Ulysses-parallel groups must fit inside one node (parallel.tp x parallel.ulysses <= NRANKS_PER_NODE):
# ds4sci refuses them otherwise.
#PBS -N ds4sci
#PBS -A CHANGE_ME
#PBS -q debug
#PBS -l select=2:system=polaris
#PBS -l place=scatter
#PBS -l walltime=01:00:00
#PBS -l filesystems=home:eagle
#PBS -j oe
set -euo pipefail
cd "${PBS_O_WORKDIR:-.}"

# Change: load your environment, e.g. on Polaris
# module use /soft/modulefiles; module load conda; conda activate base; source /path/to/venv/bin/activate

NRANKS_PER_NODE=${NRANKS_PER_NODE:-4}                    # change: GPUs per node
CONFIG=${CONFIG:-examples/configs/demo_ecoli_sp2.yaml}   # change: your config
read -r -a EXTRA <<< "${DS4SCI_ARGS:-}"                  # extra arguments, e.g. --set train.out_dir=...

NNODES=$(sort -u "$PBS_NODEFILE" | wc -l)
NTOTAL=$((NNODES * NRANKS_PER_NODE))
MASTER_ADDR=$(head -n 1 "$PBS_NODEFILE")
export MASTER_ADDR
export MASTER_PORT=${MASTER_PORT:-29500}

# On Polaris add `--depth=8 --cpu-bind depth` (PALS' CPU binding: 8 cores per rank).
mpiexec -n "$NTOTAL" --ppn "$NRANKS_PER_NODE" python -m ds4sci.cli train "$CONFIG" --resume auto "${EXTRA[@]}"
