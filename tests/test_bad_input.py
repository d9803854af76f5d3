"""Bad input through the real CLI: non-zero exit, one message naming the key or path and the fix, no result.

Each case runs ``python -m runner`` in a fresh folder the way a user would (``HYDRA_FULL_ERROR`` unset),
then checks stderr and that no ``summary.json`` exists anywhere under ``outputs/``.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

from conftest import TINY, make_tiny_cifar, run_cli
from runner import REPO_ROOT

USER_ENV = {"HYDRA_FULL_ERROR": "0"}  # what a user sees: Hydra's compact messages, no stack trace


def run_bad(tmp_path: Path, *overrides: str):
    """Run the CLI with TINY + ``overrides`` in ``tmp_path/work``; assert the shared failure contract."""
    cwd = tmp_path / "work"
    cwd.mkdir()
    proc = run_cli(*TINY, *overrides, cwd=cwd, env=USER_ENV, timeout=120)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert list((cwd / "outputs").rglob("summary.json")) == []
    assert list(cwd.rglob("*.wandb")) == [] and not (cwd / "wandb").exists()
    return proc


def config_error(proc) -> str:
    """The single ``error: ...`` line a ConfigError prints (exit status 2)."""
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_unknown_group_option(tmp_path):
    proc = run_bad(tmp_path, "model=foo")
    assert "Could not find 'model/foo'" in proc.stderr
    assert "Available options in 'model'" in proc.stderr and "resnet18" in proc.stderr


def test_wrong_value_type(tmp_path):
    proc = run_bad(tmp_path, "dataloader.batch_size=abc")
    assert "Value 'abc' of type 'str' could not be converted to Integer" in proc.stderr
    assert "full_key: dataloader.batch_size" in proc.stderr


def test_misspelt_key(tmp_path):
    proc = run_bad(tmp_path, "trainer.max_step=3")
    assert "Could not override 'trainer.max_step'" in proc.stderr


def test_missing_cifar10_without_download(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    msg = config_error(run_bad(tmp_path, "data=cifar10", f"data.root={empty}", "data.download=false"))
    assert str(empty / "cifar-10-batches-py") in msg
    assert "data.root" in msg and "data.download=true" in msg


def test_missing_mnist_without_download(tmp_path):
    msg = config_error(run_bad(tmp_path, "data=mnist", f"data.root={tmp_path / 'nowhere'}"))
    assert str(tmp_path / "nowhere" / "MNIST" / "raw") in msg
    assert "data.root" in msg and "data.download=true" in msg


def test_missing_imagefolder(tmp_path):
    msg = config_error(run_bad(tmp_path, "data=imagefolder", f"data.root={tmp_path / 'images'}"))
    assert str(tmp_path / "images" / "train") in msg and "data.root" in msg


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_cifar10_batch(tmp_path, damage):
    root = make_tiny_cifar(tmp_path / "cifar")
    bad = root / "cifar-10-batches-py" / ("data_batch_3" if damage == "truncate" else "test_batch")
    if damage == "truncate":
        bad.write_bytes(bad.read_bytes()[:500])
    else:
        bad.write_bytes(b"this is not a pickle" * 10)
    msg = config_error(run_bad(tmp_path, "data=cifar10", f"data.root={root}"))
    assert f"corrupt dataset file {bad}:" in msg
    assert "fresh copy" in msg and "data.download=true" in msg


def test_corrupt_mnist_gz(tmp_path):
    raw = tmp_path / "mnist" / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for gz in (REPO_ROOT / "data" / "MNIST" / "raw").glob("*.gz"):  # the archives only, not extracted files
        shutil.copy(gz, raw)
    bad = raw / "t10k-labels-idx1-ubyte.gz"
    bad.write_bytes(bad.read_bytes()[:100])
    msg = config_error(run_bad(tmp_path, "data=mnist", f"data.root={tmp_path / 'mnist'}"))
    assert f"corrupt dataset file {bad}" in msg and "md5" in msg and "restore" in msg


def test_accumulate_steps_below_one(tmp_path):
    msg = config_error(run_bad(tmp_path, "memory=accumulate", "memory.accumulate_steps=0"))
    assert "memory.accumulate_steps=0" in msg and ">= 1" in msg


@pytest.mark.parametrize("size", ["0", "-8"])
def test_batch_size_not_positive(tmp_path, size):
    msg = config_error(run_bad(tmp_path, f"dataloader.batch_size={size}"))
    assert f"dataloader.batch_size={size}" in msg and ">= 1" in msg


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_device_without_cuda(tmp_path):
    msg = config_error(run_bad(tmp_path, "trainer.device=cuda"))
    assert "trainer.device=cuda" in msg and "trainer.device=auto" in msg and "trainer.device=cpu" in msg


def test_slurm_launcher_without_slurm(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"  # PATH with python only: no sbatch/srun, as on a laptop
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(Path(sys.executable))
    monkeypatch.setenv("PATH", str(bin_dir))
    msg = config_error(run_bad(tmp_path, "-m", "hydra/launcher=submitit_slurm"))
    assert "hydra/launcher=submitit_slurm" in msg and "sbatch" in msg and "drop hydra/launcher=submitit_slurm" in msg
