#!/bin/bash
# GPT pretraining on several nodes under SLURM: one torchrun per node, rendezvous at the
# first node, TP inside a node, DP across nodes. SLURM sends SIGTERM before it takes the
# nodes back (at the time limit, or on preemption with --signal): --exit-signal-handler
# then saves a checkpoint at the next step boundary and exits 0; --requeue starts the job
# again, and --load continues from that checkpoint. Submit: sbatch examples/slurm_pretrain.sh
#SBATCH --job-name=tpcore-gpt
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=16
#SBATCH --time=04:00:00
#SBATCH --signal=TERM@120
#SBATCH --requeue
#SBATCH --output=tpcore-gpt-%j.log

set -euo pipefail
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
CKPT=${CKPT:-checkpoints/gpt}

# torchrun forwards SIGTERM to its workers; `exec` lets srun's signal reach torchrun.
srun --kill-on-bad-exit=1 bash -c "exec torchrun \
    --nnodes $SLURM_NNODES --nproc_per_node $GPUS_PER_NODE \
    --rdzv_backend c10d --rdzv_endpoint $HEAD_NODE:29500 --rdzv_id $SLURM_JOB_ID \
    --max-restarts 3 \
    examples/pretrain_gpt.py --config examples/gpt_small.yaml \
    --tensor-parallel-size $GPUS_PER_NODE --global-batch-size 64 --bf16 \
    --save $CKPT --load $CKPT --save-interval 1000 --save-interval-minutes 30 \
    --exit-signal-handler"
