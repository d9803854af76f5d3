"""runner as an installed package: the wheel carries the configs and the embedded data and runs from
outside the checkout, and a user's own config folder composes with runner's.

The wheel is built from a copy of the checkout's sources (the checkout gets no build/ or egg-info) and
installed into a fresh venv with ``--no-deps``: its dependencies (torch, hydra, ...) come from the test's
own environment through a ``.pth`` line, so nothing is downloaded; the job then imports runner from the
venv's site-packages, not from a checkout. ``.ci/run`` does the same from the shell.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from conftest import job_dirs, read_summary, run_cli
from runner import REPO_ROOT

CONF = REPO_ROOT / "conf"
MNIST = [
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
]


def _setuptools_can_build() -> bool:
    """Whether this environment's setuptools satisfies pyproject's build requirement and builds wheels by
    itself (>= 70.1); then the build needs no isolated environment and no download."""
    try:
        import setuptools
    except ImportError:
        return False
    major, minor = (int(p) for p in setuptools.__version__.split(".")[:2])
    return (major, minor) >= (70, 1)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel ``pip wheel`` builds from a copy of pyproject.toml, README.md, runner/, conf/ and
    data/ (MNIST's extracted files there included: the wheel must leave them out)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(REPO_ROOT / "runner", src / "runner", ignore=ignore)
    shutil.copytree(CONF, src / "conf", ignore=ignore)
    shutil.copytree(REPO_ROOT / "data", src / "data")
    out = tmp_path_factory.mktemp("dist")
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out), str(src)]
    if _setuptools_can_build():
        cmd.insert(cmd.index("--no-deps"), "--no-build-isolation")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (whl,) = out.glob("runner-*.whl")
    return whl


@pytest.mark.cli
def test_wheel_ships_configs_the_embedded_data_and_every_module(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    configs = {f"runner/conf/{p.relative_to(CONF).as_posix()}" for p in CONF.rglob("*.yaml")}
    assert "runner/conf/config.yaml" in configs and configs <= names, sorted(configs - names)
    assert {n for n in names if n.startswith("runner/conf/")} == configs  # YAML only
    data = {n for n in names if n.startswith("runner/embedded_data/")}
    # the MNIST archives, never extracted files, and Tiny Shakespeare (the Shakespeare presets' default)
    shakespeare = "runner/embedded_data/tinyshakespeare/input.txt"
    assert data == {f"runner/embedded_data/MNIST/raw/{n}" for n in MNIST} | {shakespeare}
    # pyproject.toml lists runner's packages by hand (a mapped folder rules out `find`): a subpackage
    # missing there would be missing here
    modules = {f"runner/{p.relative_to(REPO_ROOT / 'runner').as_posix()}" for p in (REPO_ROOT / "runner").rglob("*.py")}
    assert modules <= names, f"not in the wheel (add the package to pyproject.toml): {sorted(modules - names)}"
    assert not any(n.startswith(("tests/", "docs/", "scripts/", "conf/", "data/")) for n in names)


def _venv_with_wheel(wheel: Path, where: Path) -> Path:
    """A fresh venv holding only the wheel (``--no-deps``); this environment's packages are reachable
    through a ``.pth`` line. Returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, timeout=120)
    python = where / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(purelib, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--no-deps",
            "--quiet",
            "--ignore-installed",  # this environment's runner (seen through the .pth) is another copy
            str(wheel),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return python


@pytest.mark.slow  # 40 s on the busy 2-core machine: a fresh venv, the whole MNIST extracted, a 30-step job
def test_installed_wheel_runs_the_main_job_outside_the_checkout(wheel, tmp_path):
    python = _venv_with_wheel(wheel, tmp_path / "venv")
    work, cache = tmp_path / "work", tmp_path / "cache"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RUNNER_DATA_ROOT")}
    env |= {"XDG_CACHE_HOME": str(cache), "WANDB_MODE": "offline", "WANDB_SILENT": "true", "HYDRA_FULL_ERROR": "1"}
    where = subprocess.run(
        [str(python), "-c", "import runner; print(runner.__file__, runner.INSTALLED)"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
    )
    assert where.returncode == 0, where.stderr[-3000:]
    where = where.stdout.split()
    package = Path(where[0]).parent
    assert package.is_relative_to(tmp_path / "venv") and where[1] == "True"
    before = sorted(package.rglob("*"))

    proc = subprocess.run(
        [
            str(python),
            "-m",
            "runner",
            "trainer.max_steps=30",
            "trainer.log_every=10",
            "trainer.eval_max_batches=10",
            "trainer.device=cpu",
            "logger=none",
        ],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (job,) = job_dirs(work)
    s = read_summary(job)
    assert s["steps"] == 30 and s["eval_accuracy"] > 0.5  # mnist_cnn on the installed MNIST learns
    assert s["config"]["data"]["root"] == str(package / "embedded_data")
    # the archives were extracted into the user cache; the installed package was not written to
    assert sorted(p.name for p in (cache / "runner" / "MNIST" / "raw").iterdir()) == [n[:-3] for n in MNIST]
    assert sorted(p for p in package.rglob("*") if "__pycache__" not in p.parts) == [
        p for p in before if "__pycache__" not in p.parts
    ]


# --------------------------------------------------------------------------- a user's own config folder

USER_DATA = """\
# a user's option of runner's data group: it extends runner's schema like runner's own options
defaults: [base_image_data, _self_]
name: synthetic
shape: [1, 12, 12]
num_classes: 10
train_size: 96
eval_size: 32
"""
USER_EXPERIMENT = """\
# @package _global_
defaults:
  - override /data: tiny
  - override /optimizer: adamw
  - _self_
optimizer:
  lr: 0.003
trainer:
  max_steps: 3
  warmup_steps: 1
"""


@pytest.fixture
def user_conf(tmp_path) -> Path:
    """``<tmp>/conf`` with a user's ``data/tiny.yaml`` and ``experiment/mine.yaml`` (README: Your own configs)."""
    conf = tmp_path / "conf"
    (conf / "data").mkdir(parents=True)
    (conf / "experiment").mkdir()
    (conf / "data" / "tiny.yaml").write_text(USER_DATA)
    (conf / "experiment" / "mine.yaml").write_text(USER_EXPERIMENT)
    return conf


QUIET = [
    "dataloader.batch_size=16",
    "trainer.eval_max_batches=1",
    "trainer.progress=off",
    "trainer.device=cpu",
    "logger=none",
]


@pytest.mark.parametrize("how", ["--config-dir", "hydra.searchpath"])
@pytest.mark.slow  # CI budget (durations on 2 cores): `pytest -m slow` runs it
def test_user_config_folder_composes_with_runners(user_conf, tmp_path, how):
    added = ["--config-dir", str(user_conf)] if how == "--config-dir" else [f"hydra.searchpath=[file://{user_conf}]"]
    proc = run_cli(*added, "+experiment=mine", *QUIET, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    config = read_summary(job_dirs(tmp_path)[0])["config"]
    assert config["optimizer"]["_target_"] == "torch.optim.AdamW" and config["optimizer"]["lr"] == 0.003
    assert config["data"]["shape"] == [1, 12, 12] and config["trainer"]["max_steps"] == 3
    assert config["model"]["_target_"] == "runner.models.MnistCNN"  # runner's own default still applies


@pytest.mark.cli
def test_user_options_are_listed_in_help(user_conf, tmp_path):
    proc = run_cli("--config-dir", str(user_conf), "--help", cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    groups = dict(
        line.split(": ", 1)
        for line in proc.stdout.split("== Config groups ==")[1].split("== Config ==")[0].splitlines()
        if ": " in line
    )
    assert "tiny" in groups["data"].split(", ") and "mine" in groups["experiment"].split(", ")


def test_user_option_typo_fails_against_runners_schema(user_conf, tmp_path):
    (user_conf / "data" / "tiny.yaml").write_text(USER_DATA.replace("train_size", "train_sise"))
    proc = run_cli("--config-dir", str(user_conf), "+experiment=mine", *QUIET, cwd=tmp_path, timeout=120)
    assert proc.returncode != 0 and "train_sise" in proc.stderr
    assert not (tmp_path / "outputs").exists() or not any((tmp_path / "outputs").rglob("summary.json"))
