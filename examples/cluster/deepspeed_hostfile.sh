#!/bin/bash
# ds4sci training with DeepSpeed's launcher and a hostfile (nodes reached by passwordless ssh, pdsh by default).
#
# Run on the first node: `bash examples/cluster/deepspeed_hostfile.sh`. HOSTFILE names one node per line with its
# GPUs, `node01 slots=4` (lines starting with # are comments); the launcher starts `slots` ranks on each node over
# ssh and ds4sci reads DeepSpeed's RANK / LOCAL_RANK / WORLD_SIZE. The first host is the master. A hostfile of one
# node (`localhost slots=4`) runs locally, without ssh. `--resume auto` makes a rerun continue from the newest
# checkpoint in train.out_dir, which must be on storage every node sees. Inside a batch job, write the hostfile from
# the scheduler's node list (SLURM: `scontrol show hostnames | sed 's/$/ slots=4/' > hostfile`). Change HOSTFILE,
# the environment activation, and CONFIG; pass extra `--set KEY=VALUE` overrides in DS4SCI_ARGS, e.g.
#   HOSTFILE=hostfile CONFIG=my.yaml DS4SCI_ARGS="--set train.out_dir=/scratch/me/run1" bash deepspeed_hostfile.sh
# Tensor- and Ulysses-parallel groups must fit inside one node (parallel.tp x parallel.ulysses <= slots):
# ds4sci refuses them otherwise.
set -euo pipefail

# Change: load your environment (the same path on every node: the launcher runs this interpreter there).
# source /path/to/venv/bin/activate

HOSTFILE=${HOSTFILE:-hostfile}                           # change: your hostfile
CONFIG=${CONFIG:-examples/configs/demo_ecoli_sp2.yaml}   # change: your config
read -r -a EXTRA <<< "${DS4SCI_ARGS:-}"                  # extra arguments, e.g. --set train.out_dir=...

HOSTS=$(grep -Ev '^[[:space:]]*(#|$)' "$HOSTFILE" | awk '{print $1}')
HEAD=$(head -n 1 <<< "$HOSTS")
# DeepSpeed checks ssh to the first host before it knows it will launch locally: skip that check for one node.
SSH_CHECK=()
if [[ $(wc -l <<< "$HOSTS") -eq 1 ]]; then
    SSH_CHECK=(--no_ssh_check)
fi

deepspeed --hostfile "$HOSTFILE" --master_addr "$HEAD" --master_port "${MASTER_PORT:-29500}" "${SSH_CHECK[@]}" \
    --module ds4sci.cli train "$CONFIG" --resume auto "${EXTRA[@]}"
