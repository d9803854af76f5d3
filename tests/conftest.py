"""Shared fixtures: a compose helper that forces a tiny CPU job, the CLI, tiny real-format datasets.

Tests run real components: the real loaders on CIFAR-format/ImageFolder files they write themselves,
the embedded MNIST, ``../shared/data`` where present (skipped where absent), real subprocesses.
"""

from __future__ import annotations

import copy
import csv
import functools
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import DictConfig

from runner import REPO_ROOT
from runner.techniques import variants

variants.register()

# Subprocesses (the CLI, torchrun workers) import the runner of this checkout, not whichever checkout an
# editable install points at (a git worktree shares the virtualenv of the main one).
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)

SHARED_DATA = REPO_ROOT.parent / "shared" / "data"

# The compile caches' signing key (runner/techniques/compile_cache.py): the tests' own, never the user's; every test
# process and the jobs they start share it (a test of another user's key sets its own)
os.environ["RUNNER_COMPILE_CACHE_KEY"] = str(Path(tempfile.gettempdir()) / f"runner-tests-{os.getuid()}" / "cache.key")


def pytest_collection_modifyitems(config, items):
    """The tests marked ``longest`` first, the rest in their order. xdist's workers take tests in collection order
    (``--dist loadgroup``), so a 3-minute test collected last (the speed tuner's, test_tune_speed.py) keeps one
    worker busy while the other idles; taken first, it runs beside the short ones.

    A test marked ``world_size(n)`` runs on each rank of one ``torchrun --nproc-per-node=n -m pytest -m world_size``
    (tests/test_two_ranks.py); anywhere else (``WORLD_SIZE`` is not n) it skips, saying how to run it."""
    items.sort(key=lambda item: item.get_closest_marker("longest") is None)
    for item in items:
        marker = item.get_closest_marker("world_size")
        if marker is not None and os.environ.get("WORLD_SIZE") != str(marker.args[0]):
            n, path = marker.args[0], item.path.relative_to(config.rootpath)
            command = f"python -m torch.distributed.run --standalone --nproc-per-node={n} -m pytest -m world_size -n 0"
            item.add_marker(pytest.mark.skip(reason=f"runs on each rank of `{command} {path}` (.ci/run)"))


def pytest_collection_finish(session):
    session.config.stash[_RANKS_RUN] = bool(os.environ.get("TORCHELASTIC_RUN_ID")) and any(
        item.get_closest_marker("world_size") for item in session.items
    )


def pytest_unconfigure(config):
    """Each rank of ``torchrun ... -m pytest -m world_size`` waits for the others before it exits: torchrun stops
    every rank once one exits non-zero, which would cut short the report of a rank still writing it."""
    if config.stash.get(_RANKS_RUN, False):
        rank_barrier("pytest exits")


_RANKS_RUN = pytest.StashKey[bool]()


@functools.cache
def _agent_store():
    """This torchrun's agent store (``MASTER_ADDR:MASTER_PORT``; runner's own jobs set up process groups of their
    own on it), keys under the run id."""
    import torch.distributed as dist

    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=300)
    )
    return dist.PrefixStore(f"runner-tests/{os.environ['TORCHELASTIC_RUN_ID']}", store)


def rank_barrier(name: str, value: str = "") -> list[str]:
    """Wait until every rank of this torchrun called ``rank_barrier(name)`` (``name``: used once in the run); returns
    the ``value`` each rank gave, by rank. A rank that never comes fails the others after 300 s."""
    store, world = _agent_store(), int(os.environ["WORLD_SIZE"])
    store.set(f"{name}/{os.environ['RANK']}", value)
    keys = [f"{name}/{rank}" for rank in range(world)]
    store.wait(keys)
    return [store.get(key).decode() for key in keys]


#: Overrides that make any job tiny and quiet: synthetic 16x16 data, 4 steps, no W&B, one intra-op thread (with
#: two, xdist's two workers put four threads on two cores and a small step runs ~30x slower).
TINY = [
    "trainer.num_threads=1",
    "data=synthetic",
    "data.shape=[3,16,16]",
    "data.train_size=256",
    "data.eval_size=64",
    "dataloader.batch_size=16",
    "trainer.max_steps=4",
    "trainer.warmup_steps=1",
    "trainer.log_every=2",
    "trainer.eval_max_batches=2",
    "trainer.progress=off",
    "trainer.device=cpu",
    "logger=none",
]


#: What TINY's ``trainer.num_threads=1`` adds to a summary's ``techniques``.
ONE_THREAD = {"num_threads": "applied"}

#: TINY without its synthetic-data keys: the loop's settings, for jobs on another dataset
TINY_LOOP = [o for o in TINY if not o.startswith(("data=", "data."))]

#: Overrides for a tiny language model (add ``data.path=<a text>``): a 2-layer, 2-head, 32-wide GPT on
#: windows of 16 characters; with TINY's 16 windows per batch and 4 steps.
TINY_GPT = [
    "task=language_model",
    "model=gpt",
    "data=text",
    "data.block_size=16",
    "model.n_layer=2",
    "model.n_head=2",
    "model.n_embd=32",
    "task.sample_tokens=20",
]

#: Real text for the tiny language model's tests (Shakespeare's first lines; ~30 distinct characters).
TEXT = """First Citizen:
Before we proceed any further, hear me speak.

All:
Speak, speak.

First Citizen:
You are all resolved rather to die than to famish?

All:
Resolved. resolved.

First Citizen:
First, you know Caius Marcius is chief enemy to the people.
"""


def make_tiny_text(path: Path, repeats: int = 20) -> Path:
    """Write ``TEXT`` ``repeats`` times to ``path`` (UTF-8): ~5,000 characters, 10 % of them for validation."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(TEXT * repeats, encoding="utf-8")
    return path


@pytest.fixture
def tiny_text(tmp_path) -> Path:
    return make_tiny_text(tmp_path / "text" / "input.txt")


def compose_cfg(*overrides: str, tiny: bool = True) -> DictConfig:
    """Compose ``conf/config.yaml`` with ``TINY`` (unless ``tiny=False``) and then ``overrides``. When the
    overrides pick another dataset (``data=text``, ``data=custom``), TINY's synthetic-only keys are left out:
    each dataset's schema has only its own keys."""
    tiny_keys = TINY if tiny else []
    if any(o.startswith("data=") and o != "data=synthetic" for o in overrides):
        tiny_keys = [k for k in tiny_keys if not k.startswith(("data=", "data."))]
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():  # inside a Hydra app: its own config folder and search path
        return variants.compose([*tiny_keys, *overrides])
    return copy.deepcopy(_composed((*tiny_keys, *overrides)))  # a copy: the test may change it


@functools.cache
def _composed(overrides: tuple[str, ...]) -> DictConfig:
    """``variants.compose`` (as runner's tools compose), once per list of overrides in a test process: a quarter of
    the suite's composes repeat an earlier one exactly, at ~0.2 s of CPU each. A compose that fails is not kept."""
    return variants.compose(list(overrides))


@pytest.fixture
def spy(monkeypatch):
    """A ``technique_helpers.Spy``: records what the engine's parts saw (calls, dtypes, optimizer steps).

    Defined here rather than imported into each test module, so the modules that use it hold no unused
    import that shadows the fixture argument (ruff F401/F811)."""
    from technique_helpers import Spy

    return Spy(monkeypatch)


@pytest.fixture
def cfg_factory():
    return compose_cfg


def run_cli(
    *args: str, cwd: Path, env: dict | None = None, timeout: float = 300, module: str = "runner"
) -> subprocess.CompletedProcess:
    """Run ``python -m runner ARGS`` in ``cwd`` (outputs/ lands there); returns the finished process.

    The checkout under test comes first on ``PYTHONPATH``: from a folder outside it, ``python -m runner``
    would otherwise import whichever copy is installed (an editable install of another worktree).
    """
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    full_env = {
        **os.environ,
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "HYDRA_FULL_ERROR": "1",
        "PYTHONPATH": path,
        **(env or {}),
    }
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout
    )


def run_here(*args: str, cwd: Path, env: dict | None = None, module: str = "runner") -> subprocess.CompletedProcess:
    """``python -m MODULE ARGS`` in this process (``runner.__main__.run``, or the tool's ``main(argv)``), in
    ``cwd``: the exit status, stdout and stderr that ``run_cli`` returns, without a new interpreter's seconds of
    imports. For the command line's behaviour (exit statuses, the one ``error:`` line, what a run writes);
    ``run_cli`` (tier ``cli``) for what needs a process of its own: signals, torchrun, an installed wheel, what a
    process imports, ``PYTHONPATH``."""
    import contextlib
    import importlib
    import io

    run = importlib.import_module("runner.__main__").run if module == "runner" else importlib.import_module(module).main
    out, err = io.StringIO(), io.StringIO()
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    os.environ.update({"WANDB_MODE": "offline", "WANDB_SILENT": "true", **(env or {})})
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = run(list(args))
            except SystemExit as e:  # argparse's usage errors
                code = e.code if isinstance(e.code, int) else 1
    finally:
        from hydra.core.hydra_config import HydraConfig

        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        HydraConfig.instance().cfg = None  # as a new process has it: no later test sees this run's Hydra config
    return subprocess.CompletedProcess(["python", "-m", "runner", *args], code, out.getvalue(), err.getvalue())


def job_dirs(root: Path) -> list[Path]:
    """Every job folder (one holding ``.hydra/``) under ``root/outputs``, oldest first."""
    return sorted((p.parent for p in (root / "outputs").rglob(".hydra")), key=lambda p: p.stat().st_mtime)


def live_metrics(root: Path) -> list[Path]:
    """Every ``metrics.jsonl`` under ``root/outputs`` while its jobs still run: a checkpoint's ``.partial`` folder
    renamed mid-walk (FileNotFoundError) or an outputs/ not there yet gives an empty list; the caller polls again."""
    try:
        return list((root / "outputs").rglob("metrics.jsonl"))
    except FileNotFoundError:
        return []


def read_summary(job_dir: Path) -> dict:
    return json.loads((job_dir / "summary.json").read_text())


def metrics_rows(job_dir: Path) -> list[dict]:
    """Every row of ``<job_dir>/metrics.jsonl``, in order."""
    return [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]


def read_csv(path: Path) -> list[dict[str, str]]:
    """A CSV file the report or a tuner wrote, one dict per row (values as written)."""
    with path.open() as f:
        return list(csv.DictReader(f))


def run_tiny(job_dir: Path, *overrides: str) -> dict:
    """Train ``compose_cfg(*overrides)`` (a tiny CPU job) in this process into ``job_dir``; its summary."""
    from runner.engine.train import train  # imported on use: collecting the tests stays light

    job_dir.mkdir(parents=True, exist_ok=True)
    return train(compose_cfg(*overrides), job_dir=job_dir)


#: Marks a test that needs a CUDA device; it skips cleanly elsewhere.
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture
def shared_data() -> Path:
    """``../shared/data`` (real CIFAR-10 and MNIST); skips the test where it is absent."""
    if not (SHARED_DATA / "cifar-10-batches-py").is_dir():
        pytest.skip(f"{SHARED_DATA} is not present (real datasets live outside a fresh clone)")
    return SHARED_DATA


def make_tiny_cifar(root: Path, n_train: int = 100, n_test: int = 40, seed: int = 0) -> Path:
    """Write a CIFAR-10-format dataset (python pickles, torchvision's layout) under ``root``."""
    rng = np.random.default_rng(seed)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for name in names:
        n = n_test if name == "test_batch" else n_train // 5
        batch = {"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), "labels": rng.integers(0, 10, n).tolist()}
        with open(folder / name, "wb") as f:
            pickle.dump(batch, f)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": [f"class{i}" for i in range(10)]}, f)
    return root


def make_tiny_imagefolder(root: Path, classes=("cat", "dog", "fish"), per_class: int = 8, size: int = 20) -> Path:
    """Write ``root/{train,val}/<class>/*.png`` with random RGB images of ``size`` x ``size`` pixels."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for c in classes:
            d = root / split / c
            d.mkdir(parents=True)
            for i in range(per_class):
                Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(d / f"{i}.png")
    return root


@pytest.fixture
def tiny_cifar(tmp_path) -> Path:
    return make_tiny_cifar(tmp_path / "cifar")


@pytest.fixture
def tiny_imagefolder(tmp_path) -> Path:
    return make_tiny_imagefolder(tmp_path / "images")


@pytest.fixture
def short_tmp():
    """A short TMPDIR for runs that start the job server: multiprocessing's forkserver binds a Unix socket in the
    temp folder, whose path may hold 107 bytes at most, and pytest-xdist's temporary folders are longer."""
    path = Path(tempfile.mkdtemp(prefix="rt-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)
