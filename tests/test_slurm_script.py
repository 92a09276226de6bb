"""scripts/slurm_train.sh run without SLURM: a fake ``srun`` prints the train.py command it would start."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "slurm_train.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _run(tmp_path: Path, **slurm: str) -> subprocess.CompletedProcess:
    (tmp_path / "srun").write_text('#!/usr/bin/env bash\necho "srun $*"\n')
    (tmp_path / "srun").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(slurm, PATH=f"{tmp_path}{os.pathsep}{env['PATH']}", SLURM_SUBMIT_DIR=str(tmp_path))
    return subprocess.run(["bash", str(SCRIPT), "c.yaml"], env=env, capture_output=True, text=True, timeout=20)


def test_gpus_and_tasks_per_node_that_differ_stop_before_training(tmp_path):
    # sbatch --gpus-per-node=8 over the script's #SBATCH --ntasks-per-node=4: 4 tasks on 8 GPUs.
    result = _run(tmp_path, SLURM_JOB_NUM_NODES="2", SLURM_GPUS_PER_NODE="8", SLURM_NTASKS_PER_NODE="4")
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr == (
        "slurm_train.sh: --gpus-per-node=8 and --ntasks-per-node=4 differ; one task runs per GPU, so pass both with "
        "the same value: sbatch --gpus-per-node=8 --ntasks-per-node=8 ...\n"
    )


@pytest.mark.parametrize("gpus", ["8", "h100:8"])
def test_gpus_per_node_are_the_devices_of_each_node(tmp_path, gpus):
    result = _run(tmp_path, SLURM_JOB_NUM_NODES="2", SLURM_GPUS_PER_NODE=gpus, SLURM_NTASKS_PER_NODE="8")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "nodes=2 devices/node=8 strategy=ddp config=c.yaml",
        "srun python train.py fit --config c.yaml --trainer.num_nodes=2 --trainer.devices=8 "
        "--trainer.accelerator=gpu --trainer.strategy=ddp",
    ]
