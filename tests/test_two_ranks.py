"""runner's data parallelism on two ranks of ONE torchrun: DDP and FSDP vs one process, custom data, global figures.

Run it (``.ci/run`` does; xdist off, as each rank is one pytest process)::

    python -m torch.distributed.run --standalone --nproc-per-node=2 -m pytest -m world_size -n 0 tests/test_two_ranks.py

Each rank runs this pytest session, and every test runs on both ranks at once, in the same order: a job of two
processes is ``runner.__main__.run(argv)`` called on both ranks (as ``conftest.run_here`` runs the command line in
the pytest process), so the ranks' interpreters start and import torch once for all the tests instead of one
``torchrun`` per test. The ranks share one folder per test (``shared``: under the temp folder, named by the torchrun
run id and the test); both read what rank 0 wrote after ``conftest.rank_barrier`` (over the torchrun agent's store).
Outside a 2-process torchrun (``WORLD_SIZE`` is not 2) every test skips (the ``world_size`` marker,
tests/conftest.py). What torchrun's process management does (a killed rank, a failing rank's traceback, two agents
as two nodes, sweeps under torchrun, scripts/torchrun.sh) is tested in tests/test_distributed.py, one torchrun per
test.

What "the same training" means here: a job of 2 ranks x micro-batch 16 x 2 accumulation steps must follow the
loss curve of 1 process x micro-batch 32 x 2 steps (global batch 64 either way). The training set is exactly one
global batch (64 samples), so every optimizer step sees all of it, whatever order the samplers draw it in; the
model (``TinyMLP``, tests/test_distributed.py) has no BatchNorm and no dropout, whose statistics and masks would
legitimately differ per rank. What remains is float summation order: TOLERANCE bounds it. The one-process run is
rank 0's alone, in this process, with the torchrun variables hidden.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from conftest import TINY, TINY_LOOP, job_dirs, metrics_rows, rank_barrier, read_summary
from runner import distributed, launch
from test_distributed import TINY_MLP

pytestmark = pytest.mark.world_size(2)

RANK = int(os.environ.get("RANK", "0"))
#: per-step loss and final parameter norm, 2 ranks vs 1 process on the same global batch: relative difference
TOLERANCE = 1e-5  # observed: 2.4e-7 (float32 summation order); a wrong gradient scale shows at 1e-2

#: the equivalence runs: TINY's data (3x16x16 synthetic), one global batch of 64 samples, 20 steps
SAME_DATA = [
    "data.train_size=64",
    "trainer.max_steps=20",
    "trainer.log_every=1",
    "trainer.eval_every=20",
    "model._target_=tiny_mlp.TinyMLP",
    "memory.accumulate_steps=2",
    "optimizer.lr=0.05",
]
#: a rank that dies or hangs fails the other's collectives within a minute, not runner's default 300 s
TIMEOUT = "distributed.timeout_s=60"
#: what torchrun tells a worker; hidden for the one-process reference run
TORCHRUN_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_ERROR_FILE",
)


def safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


@pytest.fixture(scope="module")
def shared_root() -> Path:
    """This torchrun's folder for the module's tests, the same on both ranks; rank 0 removes it at the end."""
    root = Path(tempfile.gettempdir()) / f"runner-two-ranks-{safe(os.environ['TORCHELASTIC_RUN_ID'])}"
    yield root
    rank_barrier("end of module")
    if RANK == 0:
        shutil.rmtree(root, ignore_errors=True)


class Folder:
    """One test's folder, the same on both ranks, with ``pymod/tiny_mlp.py``."""

    def __init__(self, root: Path, name: str) -> None:
        self.name = safe(name)
        self.path = root / self.name
        (self.path / "pymod").mkdir(parents=True, exist_ok=True)
        if RANK == 0:
            (self.path / "pymod" / "tiny_mlp.py").write_text(TINY_MLP)
        self.barrier("ready")

    def barrier(self, step: str, value: str = "") -> list[str]:
        return rank_barrier(f"{self.name}/{step}", value)


@pytest.fixture
def shared(shared_root, request) -> Folder:
    return Folder(shared_root, request.node.nodeid)


def run_job(folder: Folder, job: str, *args: str, alone: bool = False) -> Path:
    """``python -m runner ARGS`` in this process, from ``folder.path/job``, with ``tiny_mlp`` and that folder
    importable (``python -m`` puts the folder it runs from first on ``sys.path``); on both ranks, one job of two
    processes, unless ``alone`` (rank 0 only, as one process: torchrun's variables hidden). Both ranks start it
    together and fail together: exit status 0 on each rank, and no scratch folder of rank 1's left. Returns the
    folder it ran from."""
    root, tmp = folder.path / job, folder.path / job / "tmp"  # tmp: where rank 1's scratch job folder goes
    status, outcome = None, "exit status 0"
    folder.barrier(f"{job} starts")  # both ranks start the same job: each joins its process group, none other
    try:
        if not alone or RANK == 0:
            tmp.mkdir(parents=True, exist_ok=True)
            saved_cwd, saved_path, saved_tmp = os.getcwd(), list(sys.path), tempfile.tempdir
            with pytest.MonkeyPatch.context() as mp:
                for key in TORCHRUN_VARS if alone else ():
                    mp.delenv(key, raising=False)
                mp.setenv("WANDB_MODE", "offline")
                mp.setenv("WANDB_SILENT", "true")
                sys.path[:0] = [str(root), str(folder.path / "pymod")]
                tempfile.tempdir = str(tmp)
                os.chdir(root)
                try:
                    from runner.__main__ import run

                    status = run(list(args))
                finally:
                    os.chdir(saved_cwd)
                    sys.path[:] = saved_path
                    tempfile.tempdir = saved_tmp
            outcome = f"exit status {status}"
    except BaseException as e:
        outcome = f"{type(e).__name__}: {e}"
        raise
    finally:  # even after a failure, so the other rank fails this test too and both go on to the next
        outcomes = folder.barrier(f"{job} ends", outcome)
    assert outcomes == ["exit status 0"] * 2, (
        f"{job}: "
        + "; ".join(f"rank {rank}: {o}" for rank, o in enumerate(outcomes))
        + " (each rank's output: its captured output)"
    )
    if "-m" not in args:  # a multirun's rank 1 keeps its scratch sweep folder until the process exits (atexit)
        assert not list(tmp.glob("runner-rank*")), "a rank > 0 left its scratch folder behind"
    return root


def only_job(root: Path) -> Path:
    """The one job folder under ``root/outputs`` (fails listing them all otherwise)."""
    dirs = job_dirs(root)
    assert len(dirs) == 1, f"expected one job folder, found {dirs}"
    return dirs[0]


def losses(job_dir: Path) -> list[float]:
    return [r["loss"] for r in metrics_rows(job_dir) if "loss" in r]


def assert_same_losses(a: list[float], b: list[float]) -> None:
    assert len(a) == len(b) == 20
    worst = max(abs(x - y) / max(1.0, abs(y)) for x, y in zip(a, b))
    assert worst <= TOLERANCE, f"per-step losses differ by up to {worst:.2e} (> {TOLERANCE}):\n{a}\n{b}"
    assert a[-1] < a[0] * 0.9, f"the loss did not go down: {a}"  # it trained, so the match is not trivial


@pytest.fixture(scope="module")
def runs(shared_root) -> dict[str, tuple[Path, dict]]:
    """One process (batch 32, rank 0 alone) vs DDP and FSDP on the 2 ranks (batch 16 each); 20 steps each."""
    folder = Folder(shared_root, "runs")
    roots = {
        "single": run_job(folder, "single", *TINY, *SAME_DATA, "dataloader.batch_size=32", alone=True),
        "ddp": run_job(
            folder,
            "ddp",
            "distributed=ddp",
            TIMEOUT,
            *TINY,
            *SAME_DATA,
            "dataloader.batch_size=16",
            "trainer.reference_samples_per_sec=1000",
        ),
        "fsdp": run_job(folder, "fsdp", "distributed=fsdp", TIMEOUT, *TINY, *SAME_DATA, "dataloader.batch_size=16"),
    }
    return {name: (only_job(root), read_summary(only_job(root))) for name, root in roots.items()}


def test_ddp_two_processes_one_job_folder_identical_replicas(runs):
    _, s = runs["ddp"]
    assert s["world_size"] == 2 and s["nodes"] == 1 and s["steps"] == 20
    assert s["global_batch_size"] == 64 and s["micro_batch_size"] == 16 and s["accumulate_steps"] == 2
    assert s["techniques"]["ddp"] == "applied"
    assert s["scaling_efficiency"] == pytest.approx(s["samples_per_sec"] / (2 * 1000))
    p = s["parameters"]
    assert len(p["sha256_by_rank"]) == 2 and p["identical_across_ranks"] is True, p
    assert p["dtensor_count"] == 0


def test_ddp_loss_matches_one_process_with_the_same_global_batch(runs):
    (single_dir, single), (ddp_dir, ddp) = runs["single"], runs["ddp"]
    assert single["global_batch_size"] == ddp["global_batch_size"] == 64
    assert_same_losses(losses(ddp_dir), losses(single_dir))
    assert ddp["parameters"]["l2_norm"] == pytest.approx(single["parameters"]["l2_norm"], rel=TOLERANCE)


def test_fsdp_parameters_are_sharded_dtensors_and_consistent(runs):
    (single_dir, single), (fsdp_dir, fsdp) = runs["single"], runs["fsdp"]
    assert fsdp["world_size"] == 2 and fsdp["techniques"]["fsdp"] == "applied"
    p = fsdp["parameters"]
    assert p["dtensor_count"] == p["count"] == 4  # two Linear layers: weight + bias each
    assert p["numel"] / 2 <= p["local_numel"] < p["numel"], p  # rank 0 stores its shard only
    assert p["identical_across_ranks"] is True  # the all-gathered full parameters agree on both ranks
    assert p["l2_norm"] == pytest.approx(single["parameters"]["l2_norm"], rel=TOLERANCE)
    assert_same_losses(losses(fsdp_dir), losses(single_dir))


def test_ddp_two_processes_on_custom_data(shared):
    """Under torchrun each rank imports my_data from the run folder, draws its DistributedSampler share of
    the same data, and the replicas stay identical."""
    from test_custom_data import readme_example

    module, _ = readme_example()
    (shared.path / "custom").mkdir(exist_ok=True)
    if RANK == 0:
        (shared.path / "custom" / "my_data.py").write_text(module)
    shared.barrier("my_data.py")
    root = run_job(
        shared,
        "custom",
        "distributed=ddp",
        TIMEOUT,
        *TINY_LOOP,
        "data=custom",
        "data._target_=my_data.tabular",
        "data.n_train=1024",
        "data.n_eval=256",
        "model=mlp",
        "model.hidden=32",
        "trainer.max_steps=8",
    )
    s = read_summary(only_job(root))
    assert s["world_size"] == 2 and s["techniques"]["ddp"] == "applied" and s["global_batch_size"] == 32
    assert s["parameters"]["identical_across_ranks"] is True
    assert s["config"]["data"]["_target_"] == "my_data.tabular"


def test_a_multirun_of_ddp_jobs_runs_each_job_on_both_ranks(shared):
    """``torchrun --nproc-per-node=2 -m runner -m distributed=ddp trainer.seed=0,1`` (Hydra's basic launcher): each
    rank runs the jobs one after another in one process, each job a process group of its own; the second must not
    read the first's rendezvous keys from torchrun's store (``runner.distributed.attempt_store``)."""
    sweep = shared.path / "sweep" / "jobs"
    run_job(shared, "sweep", "-m", "distributed=ddp", TIMEOUT, *TINY, "trainer.seed=0,1", f"hydra.sweep.dir={sweep}")
    for seed in (0, 1):
        s = read_summary(sweep / str(seed))
        assert s["world_size"] == 2 and s["steps"] == 4 and s["config"]["trainer"]["seed"] == seed, s
        assert s["parameters"]["identical_across_ranks"] is True


def test_reduce_figures_are_global_over_two_processes(shared):
    """samples/s over the slowest rank's time, the slowest rank's step times, the largest peak memory. The process
    group is torchrun's two ranks, joined as runner joins it (``shared``: both ranks got here first)."""
    layout = launch.discover()
    timeout = timedelta(seconds=60)
    dist.init_process_group(
        "gloo",
        store=distributed.attempt_store(layout, timeout),
        rank=layout.rank,
        world_size=layout.world_size,
        timeout=timeout,
    )
    try:
        rank = layout.rank
        env = distributed.Env(rank=rank, local_rank=rank, world_size=2, nodes=1, device=torch.device("cpu"))
        # rank 1 is the slow one (2 s for the same 10 steps) and has the larger peak memory
        totals = {
            "samples_per_sec": 64 * 10 / (1.0 + rank),
            "step_time_ms_median": 100.0 * (1 + rank),
            "step_time_ms_p90": 150.0 * (1 + rank),
            "measured_steps": 10,
            "measured_time_s": 1.0 + rank,
            "data_wait_fraction": 0.1,
        }
        r = distributed.reduce_figures(totals, peak_memory_mb=100.0 + 50 * rank, env=env)
    finally:
        dist.destroy_process_group()
    assert r["samples_per_sec"] == pytest.approx(320.0)  # 640 samples in the slowest rank's 2 s
    assert (r["step_time_ms_median"], r["step_time_ms_p90"], r["peak_memory_mb"]) == (200.0, 300.0, 150.0)
    assert r["measured_time_s"] == 2.0


#: the Shakespeare GPT (the embedded text), narrowed: 50 steps of 12 windows of 32 characters, every loss logged
GPT = [
    "+experiment=shakespeare_char",
    *TINY_LOOP,
    "model.n_layer=2",
    "model.n_embd=64",
    "data.block_size=32",
    "trainer.max_steps=50",
    "scheduler.warmup_steps=5",
    "trainer.log_every=1",
    "trainer.eval_every=50",
    "task.sample_tokens=0",
]
#: tensor parallelism's per-step losses against one process's on the same batches (issue 59: 1e-3); observed 5e-7
TP_TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def tp_runs(shared_root) -> dict[str, tuple[Path, dict]]:
    """The GPT and an MLP in one process (rank 0 alone) and split over both ranks (distributed=tp), the GPT in two
    pipeline stages (distributed=pp, 1F1B and GPipe): the ranks of a split draw the same batches, so the global
    batch is one rank's."""
    folder = Folder(shared_root, "tp_runs")
    mlp = [
        *TINY,
        "data.train_size=64",
        "trainer.max_steps=20",
        "trainer.log_every=1",
        "trainer.eval_every=20",
        "model=mlp",
        "model.hidden=32",
        "dataloader.batch_size=32",
        "optimizer.lr=0.05",
    ]
    roots = {
        "gpt": run_job(folder, "gpt", *GPT, alone=True),
        "gpt_tp": run_job(folder, "gpt_tp", "distributed=tp", TIMEOUT, *GPT),
        "mlp": run_job(folder, "mlp", *mlp, alone=True),
        "mlp_tp": run_job(folder, "mlp_tp", "distributed=tp", TIMEOUT, *mlp),
        "gpt_pp": run_job(folder, "gpt_pp", "distributed=pp", TIMEOUT, *GPT),
        "gpt_gpipe": run_job(
            folder,
            "gpt_gpipe",
            "distributed=pp",
            "distributed.pp_schedule=gpipe",
            "distributed.pp_microbatches=2",
            TIMEOUT,
            *GPT,
        ),
    }
    return {name: (only_job(root), read_summary(only_job(root))) for name, root in roots.items()}


@pytest.mark.parametrize("model", ["gpt", "mlp"])
def test_tensor_parallel_trains_as_one_process_on_the_same_batches(tp_runs, model):
    (one_dir, one), (tp_dir, tp) = tp_runs[model], tp_runs[f"{model}_tp"]
    assert tp["techniques"]["tp"] == "applied" and tp["world_size"] == 2
    assert tp["global_batch_size"] == one["global_batch_size"]  # one model copy: its two ranks share each batch
    a, b = losses(tp_dir), losses(one_dir)
    assert len(a) == len(b) == (50 if model == "gpt" else 20) and a[-1] < a[0] * 0.9, (a, b)
    worst = max(abs(x - y) for x, y in zip(a, b))
    assert worst <= TP_TOLERANCE, f"per-step losses differ by up to {worst:.2e}:\n{a}\n{b}"
    assert tp["eval_loss"] == pytest.approx(one["eval_loss"], abs=TP_TOLERANCE)  # each eval batch counted once
    p, plan = tp["parameters"], tp["technique_details"]["tensor_parallel"]
    assert p["identical_across_ranks"] is True and p["dtensor_count"] == p["count"], p
    assert p["local_numel"] < p["numel"], p  # each rank holds its half of the split layers only
    assert plan["split_layers"] == (8 if model == "gpt" else 2), plan  # GPT: 4 Linear layers in each of 2 blocks
    assert p["l2_norm"] == pytest.approx(one["parameters"]["l2_norm"], rel=1e-4)
    a, b = (load_file(str(d / "model.safetensors")) for d in (one_dir, tp_dir))  # full, in the model's own order
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=TP_TOLERANCE) for k in a)


#: a pipeline's per-step losses against one process's on the same batches (issue 59: 1e-2); observed 5e-7
PP_TOLERANCE = 1e-2


@pytest.mark.parametrize("run", ["gpt_pp", "gpt_gpipe"])
def test_pipeline_parallel_trains_as_one_process_on_the_same_batches(tp_runs, run):
    """Two stages (one block each), the batch of 12 in micro-batches (4, or 2 with GPipe): the tied embedding's
    gradient summed between the stages and the clipping norm taken over both keep it one process's training."""
    (one_dir, one), (pp_dir, pp) = tp_runs["gpt"], tp_runs[run]
    assert pp["techniques"]["pp"] == "applied" and pp["global_batch_size"] == one["global_batch_size"]
    details = pp["technique_details"]["pipeline_parallel"]
    assert details["stages"] == 2 and details["schedule"] == ("gpipe" if run == "gpt_gpipe" else "1f1b")
    assert pp["parameters"]["identical_across_ranks"] is None  # the ranks hold different stages
    a, b = losses(pp_dir), losses(one_dir)
    worst = max(abs(x - y) for x, y in zip(a, b))
    assert len(a) == 50 and worst <= PP_TOLERANCE, f"per-step losses differ by up to {worst:.2e}:\n{a}\n{b}"
    assert pp["eval_loss"] == pytest.approx(one["eval_loss"], abs=PP_TOLERANCE)  # the last stage's output, shared
    w1, w2 = (load_file(str(d / "model.safetensors")) for d in (one_dir, pp_dir))  # every stage's weights
    assert w1.keys() == w2.keys() and all(torch.allclose(w1[k], w2[k], atol=PP_TOLERANCE) for k in w1)
