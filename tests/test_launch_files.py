"""The launch files for where users outgrow SLURM (docs/scaling.md): scripts/sky/train.yaml (SkyPilot) and
scripts/k8s/trainjob.yaml (a Kubeflow Trainer v2 TrainJob). No cloud or cluster is reachable from here, so each is
parsed and the runner command it starts is composed with runner's config: a file whose overrides drifted from the
config fails here, not on a rented node."""

from __future__ import annotations

import shlex

import yaml

from conftest import compose_cfg
from runner import REPO_ROOT


def _overrides(command: list[str]) -> list[str]:
    """What follows ``-m runner`` in a command line."""
    at = next(i for i in range(len(command) - 1) if command[i : i + 2] == ["-m", "runner"])
    return command[at + 2 :]


def test_the_skypilot_task_starts_torchrun_per_node_with_composing_overrides():
    task = yaml.safe_load((REPO_ROOT / "scripts" / "sky" / "train.yaml").read_text())
    assert task["num_nodes"] >= 1 and "pip install" in task["setup"]
    run = task["run"].replace("\\\n", " ")
    command = shlex.split(run.splitlines()[-1] if "torch.distributed.run" in run.splitlines()[-1] else run)
    torchrun = " ".join(command)
    for variable in ("SKYPILOT_NUM_NODES", "SKYPILOT_NODE_RANK", "SKYPILOT_NUM_GPUS_PER_NODE", "MASTER_ADDR"):
        assert variable in torchrun, variable
    assert _overrides(command) == ["$OVERRIDES"]
    cfg = compose_cfg(*shlex.split(task["envs"]["OVERRIDES"]), tiny=False)
    assert cfg.distributed.name == "ddp" and cfg.model._target_.endswith("resnet50")


def test_the_trainjob_runs_torchrun_on_the_torch_distributed_runtime_with_composing_overrides():
    job = yaml.safe_load((REPO_ROOT / "scripts" / "k8s" / "trainjob.yaml").read_text())
    assert (job["apiVersion"], job["kind"]) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
    spec = job["spec"]
    assert spec["runtimeRef"]["name"] == "torch-distributed"
    command = spec["trainer"]["command"]
    assert command[0] == "torchrun" and spec["trainer"]["numNodes"] >= 1
    cfg = compose_cfg(*_overrides(command), tiny=False)
    assert cfg.distributed.name == "ddp" and cfg.model._target_.endswith("resnet50")
