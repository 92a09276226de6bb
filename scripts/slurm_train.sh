#!/usr/bin/env bash
# Train with train.py on several nodes under SLURM: one task per GPU, ranks taken from SLURM by Lightning.
#
#   sbatch --nodes=2 --gpus-per-node=4 --ntasks-per-node=4 scripts/slurm_train.sh configs/feng_resnet18_cifar10.yaml \
#       [more train.py args]
#
# The node and GPU counts come from the sbatch options (or the #SBATCH defaults below) and are passed on to
# Lightning as --trainer.num_nodes and --trainer.devices, which must match what SLURM started. One task runs per GPU,
# so --gpus-per-node and --ntasks-per-node go together: to change one, pass both (e.g. --gpus-per-node=8
# --ntasks-per-node=8); the script stops before training when they differ. Extra arguments go to train.py
# (e.g. --trainer.max_epochs=100); the strategy is STRATEGY (default ddp):
#   STRATEGY=fsdp sbatch --nodes=4 scripts/slurm_train.sh CONFIG
# Logs: slurm-<job id>.out.
#SBATCH --job-name=rank_lightning
#SBATCH --nodes=2
#SBATCH --gpus-per-node=4
#SBATCH --ntasks-per-node=4
#SBATCH --cpus-per-task=8
#SBATCH --time=24:00:00
#SBATCH --output=slurm-%j.out
set -euo pipefail

CONFIG=${1:?usage: sbatch [options] scripts/slurm_train.sh CONFIG [train.py arguments]}
shift
NODES=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}
# One task per GPU: the GPUs per node are the devices Lightning uses on each node, and SLURM must start as many tasks.
GPUS=${SLURM_GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-}}
GPUS=${GPUS##*:}  # "a100:4" -> "4"
TASKS=${SLURM_NTASKS_PER_NODE:-${SLURM_TASKS_PER_NODE:-}}
TASKS=${TASKS%%(*}  # "4(x2)" -> "4"
if [[ -z "$GPUS" || -z "$TASKS" ]]; then
    echo "slurm_train.sh: no GPU or task count per node (SLURM_GPUS_PER_NODE='${SLURM_GPUS_PER_NODE:-}'," \
        "SLURM_NTASKS_PER_NODE='${SLURM_NTASKS_PER_NODE:-}'); submit it with sbatch --gpus-per-node=G" \
        "--ntasks-per-node=G" >&2
    exit 2
fi
if [[ "$GPUS" != "$TASKS" ]]; then
    echo "slurm_train.sh: --gpus-per-node=$GPUS and --ntasks-per-node=$TASKS differ; one task runs per GPU," \
        "so pass both with the same value: sbatch --gpus-per-node=$GPUS --ntasks-per-node=$GPUS ..." >&2
    exit 2
fi
DEVICES=$GPUS
STRATEGY=${STRATEGY:-ddp}

cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
echo "nodes=$NODES devices/node=$DEVICES strategy=$STRATEGY config=$CONFIG"
# srun starts one process per task on every node; Lightning's SLURMEnvironment reads SLURM_PROCID, SLURM_LOCALID
# and SLURM_NODEID and uses the first node as the rendezvous host.
srun python train.py fit --config "$CONFIG" \
    --trainer.num_nodes="$NODES" --trainer.devices="$DEVICES" --trainer.accelerator=gpu \
    --trainer.strategy="$STRATEGY" "$@"
