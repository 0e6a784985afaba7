#!/usr/bin/env bash
# Multi-node training under SLURM: one task per node, each runs `accelerate launch scripts/train.py`, which
# starts one process per GPU of its node; the arguments are those of `draftsmith train`. Submit from the
# repository root (the output dir must be on a shared filesystem: rank 0 writes, every rank reads on resume):
#   sbatch --nodes 2 scripts/slurm_train.sh medusa --config configs/smollm2-135m/medusa.yaml
# ACCELERATE_CONFIG picks the preset (default multi_gpu_ddp.yaml; fsdp.yaml or deepspeed_zero3.yaml for
# targets larger than one GPU); its num_processes / machine_rank / main_process_ip are overridden here.
#SBATCH --job-name=draftsmith-train
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
set -euo pipefail

CONFIG=${ACCELERATE_CONFIG:-configs/accelerate/multi_gpu_ddp.yaml}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MAIN_HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MAIN_PORT=${MAIN_PORT:-29500}

# single quotes: $SLURM_NODEID is expanded by each node's own shell, not here
srun --kill-on-bad-exit=1 bash -c 'exec accelerate launch --config_file "$0" \
    --num_machines "$SLURM_NNODES" --machine_rank "$SLURM_NODEID" \
    --num_processes $(( SLURM_NNODES * $1 )) \
    --main_process_ip "$2" --main_process_port "$3" --rdzv_backend static \
    scripts/train.py "${@:4}"' "$CONFIG" "$GPUS_PER_NODE" "$MAIN_HOST" "$MAIN_PORT" "$@"
