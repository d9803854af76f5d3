"""torchrun's process management with real processes on this CPU (gloo): a killed rank, a failing rank's
traceback, distributed=none refused, two agents as two nodes, scripts/torchrun.sh, sweeps under torchrun.

Every multi-process test here starts a ``torchrun`` of its own running ``python -m runner`` and reads back what
rank 0 wrote. runner's data parallelism itself (DDP and FSDP against one process, custom data, the global
figures) runs on the two ranks of one torchrun for all its tests: tests/test_two_ranks.py.

Helpers (``launch``, ``distributed``) get fast in-process tests at the end.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import TINY, compose_cfg, job_dirs, live_metrics, read_summary
from runner import REPO_ROOT, distributed, launch
from runner.errors import ConfigError
from runner.measure import hardware
from runner.techniques import parallel, precision

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]  # `torchrun` of this interpreter

TINY_MLP = '''
import torch
from torch import nn


class TinyMLP(nn.Sequential):
    """3x16x16 -> 32 -> classes; no BatchNorm, no dropout: its gradient is the same however the batch is split."""

    def __init__(self, num_classes: int = 10):
        super().__init__(nn.Flatten(), nn.Linear(3 * 16 * 16, 32), nn.ReLU(), nn.Linear(32, num_classes))


class FailsInTraining(TinyMLP):
    """Takes the data (the build-time check runs in eval mode) and raises in its first training forward."""

    def forward(self, x):
        if self.training:
            raise RuntimeError("a bug in the model's training forward")
        return super().forward(x)
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(root: Path, **extra: str) -> dict[str, str]:
    """Subprocess environment: one OpenMP thread per process (2 cores), the tiny model and the checkout
    under test importable (not another worktree's installed copy), a private TMPDIR (so leftovers of
    ranks > 0 can be checked), torchrun/venv scripts on PATH."""
    tmp = root / "tmp"
    tmp.mkdir(exist_ok=True)
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "HYDRA_FULL_ERROR": "1",
        "TMPDIR": str(tmp),
        "PYTHONPATH": os.pathsep.join([str(root / "pymod"), str(REPO_ROOT)]),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        **extra,
    }


def make_root(path: Path) -> Path:
    (path / "pymod").mkdir(parents=True, exist_ok=True)
    (path / "pymod" / "tiny_mlp.py").write_text(TINY_MLP)
    return path


def torchrun(
    *args: str, cwd: Path, launcher: list[str] | None = None, timeout: float = 240
) -> subprocess.CompletedProcess:
    cmd = [*(launcher or [*TORCHRUN, "--standalone", "--nproc-per-node=2"]), "-m", "runner", *args]
    return subprocess.run(cmd, cwd=cwd, env=child_env(cwd), capture_output=True, text=True, timeout=timeout)


def only_job(root: Path, proc: subprocess.CompletedProcess) -> dict:
    """The one job folder under ``root/outputs`` (fails listing them all otherwise) and its summary."""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    dirs = job_dirs(root)
    assert len(dirs) == 1, f"expected one job folder, found {dirs}"
    assert not list((root / "tmp").glob("runner-rank*")), "a rank > 0 left its scratch folder behind"
    return read_summary(dirs[0])


@pytest.mark.cli
def test_scripts_torchrun_sh_runs_n_processes_and_adds_ddp(tmp_path):
    """``scripts/torchrun.sh N overrides``: N first, the overrides after, ``distributed=ddp`` added when no override
    picks the distributed group (the README's one-node command; tests/test_two_ranks.py checks what DDP computes)."""
    root = make_root(tmp_path)
    proc = subprocess.run(
        [str(REPO_ROOT / "scripts" / "torchrun.sh"), "2", *TINY],
        cwd=root,
        env=child_env(root),
        capture_output=True,
        text=True,
        timeout=240,
    )
    s = only_job(root, proc)
    assert s["world_size"] == 2 and s["techniques"]["ddp"] == "applied", s["techniques"]
    assert s["parameters"]["identical_across_ranks"] is True


@pytest.mark.slow
def test_two_agents_as_two_nodes_train_together(tmp_path):
    """Two torchrun agents on this machine, c10d rendezvous on 127.0.0.1 at a free port, join timeout 60 s."""
    root = make_root(tmp_path)
    port = free_port()
    agent = [
        *TORCHRUN,
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id=test-{port}",
        "--rdzv-conf=join_timeout=60",
        "--max-restarts=0",
        "-m",
        "runner",
        "distributed=ddp",
        *TINY,
        "trainer.max_steps=20",
    ]
    procs = [
        subprocess.Popen(
            agent, cwd=root, env=child_env(root), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for _ in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], "\n\n".join(o[-4000:] for o in outputs)
    s = only_job(root, subprocess.CompletedProcess([], 0, "", ""))
    assert s["world_size"] == 2 and s["nodes"] == 2 and s["steps"] == 20
    assert s["parameters"]["identical_across_ranks"] is True


def _children(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    kids.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                pass
    return kids


def _rank_of(pid: int) -> int | None:
    try:
        env = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
    except OSError:
        return None
    ranks = [int(e[5:]) for e in env if e.startswith(b"RANK=")]
    return ranks[0] if ranks else None


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the worker processes through /proc")
def test_killing_one_rank_fails_the_job_fast_with_its_traceback(tmp_path):
    """SIGTERM rank 1 mid-run: torchrun stops rank 0 and exits non-zero within seconds (not after the
    300 s collective timeout); rank 1's Python stack at the moment it died is in its log; no summary."""
    root = make_root(tmp_path)
    logs = tmp_path / "logs"
    cmd = [
        *TORCHRUN,
        "--standalone",
        "--nproc-per-node=2",
        "--redirects=3",
        f"--log-dir={logs}",
        "-m",
        "runner",
        "distributed=ddp",
        *TINY,
        "trainer.max_steps=1000000",
        "trainer.log_every=1",
        "trainer.eval_every=1000000",
        # SIGTERM kills here; with checkpoint.signals it would checkpoint and stop (test_resume)
        "checkpoint.signals=[]",
    ]
    proc = subprocess.Popen(
        cmd, cwd=root, env=child_env(root), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 180
        victim = None
        while time.monotonic() < deadline and proc.poll() is None:  # training is under way: rank 0 logs rows
            metrics = live_metrics(root)
            if metrics and len(metrics[0].read_text().splitlines()) >= 3:
                victim = next((pid for pid in _children(proc.pid) if _rank_of(pid) == 1), None)
                break
            time.sleep(0.2)
        assert victim is not None, f"training never got under way (rc={proc.poll()})"
        killed = time.monotonic()
        os.kill(victim, signal.SIGTERM)
        output = proc.communicate(timeout=120)[0]
        took = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            for pid in _children(proc.pid):
                os.kill(pid, signal.SIGKILL)
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    assert took < 60, f"the job took {took:.0f} s to fail after rank 1 died"
    assert "rank      : 1" in output and "SIGTERM" in output and f"PID {victim}" in output, output[-4000:]
    rank1 = next(logs.rglob("attempt_0/1/stderr.log")).read_text()
    assert "(most recent call first)" in rank1 and "runner/engine/train.py" in rank1, rank1[-4000:]
    assert not list((root / "outputs").rglob("summary.json"))
    assert not list((root / "tmp").glob("runner-rank*")), "rank 1's scratch folder outlived it"


@pytest.mark.slow
def test_a_failing_rank_s_traceback_reaches_torchrun_s_summary(tmp_path):
    """An exception in the ranks (a model that raises in its training forward) is printed in full
    (HYDRA_FULL_ERROR) and recorded by @record, so torchrun's "Root Cause" shows the traceback."""
    root = make_root(tmp_path)
    proc = torchrun("distributed=ddp", *TINY, "model._target_=tiny_mlp.FailsInTraining", cwd=root)
    assert proc.returncode != 0
    root_cause = proc.stderr.split("Root Cause", 1)
    assert len(root_cause) == 2, proc.stderr[-4000:]
    assert "RuntimeError" in root_cause[1] and "runner/engine/train.py" in root_cause[1], root_cause[1][-3000:]
    assert "error_file: <N/A>" not in root_cause[1]
    assert not list((root / "outputs").rglob("summary.json"))


@pytest.mark.slow
def test_distributed_none_under_torchrun_is_refused(tmp_path):
    root = make_root(tmp_path)
    proc = torchrun(*TINY, cwd=root)  # distributed=none by default
    assert proc.returncode != 0
    assert "launched as 2 processes (torchrun) but distributed=none" in proc.stderr, proc.stderr[-3000:]


# ----------------------------------------------------------------------------- fast, in process


def test_discover_reads_torchrun_and_srun_and_ignores_the_batch_script():
    torchrun_env = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "GROUP_WORLD_SIZE": "2", "SLURM_PROCID": "0"}
    assert launch.discover(torchrun_env) == launch.Layout(
        rank=3, local_rank=1, world_size=4, nodes=2, launcher="torchrun"
    )
    srun_env = {
        "SLURM_PROCID": "1",
        "SLURM_LOCALID": "0",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_NTASKS": "2",
        "SLURM_STEP_NODELIST": "gpu[07-08]",
        "SLURM_JOB_ID": "1234",
    }
    layout = launch.discover(srun_env)
    assert (layout.rank, layout.world_size, layout.nodes, layout.launcher) == (1, 2, 2, "srun")
    assert layout.master_addr == "gpu07" and layout.master_port == 20000 + 1234
    assert launch.discover({**srun_env, "MASTER_PORT": "29500"}).master_port == 29500
    batch_script = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "n[1-2]"}
    assert launch.discover(batch_script) == launch.Layout()
    with pytest.raises(ConfigError, match="outside the world"):
        launch.discover({"RANK": "2", "WORLD_SIZE": "2"})


def test_expand_nodelist():
    assert launch.expand_nodelist("n[1-3,7],gpu-a[08-10],login") == [
        "n1",
        "n2",
        "n3",
        "n7",
        "gpu-a08",
        "gpu-a09",
        "gpu-a10",
        "login",
    ]
    assert launch.expand_nodelist("node-[01-02]-ib") == ["node-01-ib", "node-02-ib"]
    with pytest.raises(ConfigError):
        launch.expand_nodelist("n[1-x]")


def test_ranks_above_zero_get_a_scratch_folder_and_no_hydra_copy():
    assert launch.hydra_overrides(launch.Layout()) == []
    overrides = launch.hydra_overrides(launch.Layout(rank=1, world_size=2))
    scratch = Path(overrides[0].split("=", 1)[1])
    assert scratch.is_dir() and "hydra.output_subdir=null" in overrides
    assert f"hydra.sweep.dir={scratch}" in overrides


@pytest.mark.parametrize(
    "overrides,env,message",
    [
        (["distributed=none"], {"RANK": "0", "WORLD_SIZE": "2"}, "distributed=none"),
        (["distributed=dp"], {"RANK": "0", "WORLD_SIZE": "2"}, "cannot run as 2 processes"),
        (["distributed=fsdp", "distributed.sync_batchnorm=true"], {}, "works with distributed=ddp only"),
        (["distributed=ddp", "distributed.backend=nccl"], {}, "needs CUDA"),
        (["distributed=ddp", "distributed.backend=tcp"], {}, "is not one of"),
        (["distributed=ddp", "distributed.timeout_s=0"], {}, "must be > 0"),
    ],
)
def test_impossible_combinations_are_config_errors(overrides, env, message, monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_WORLD_SIZE", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    cfg = compose_cfg(*overrides)
    with pytest.raises(ConfigError, match=message):
        distributed.setup(cfg.distributed, cfg.trainer.device)
    assert not torch.distributed.is_initialized()


def test_sync_batchnorm_on_cpu_is_skipped_with_the_reason(tmp_path):
    from runner.engine.train import train

    summary = train(compose_cfg("distributed=ddp", "distributed.sync_batchnorm=true"), job_dir=tmp_path)
    assert summary["techniques"]["sync_batchnorm"].startswith("skipped: SyncBatchNorm only runs on CUDA")
    assert summary["techniques"]["ddp"] == "applied"


def test_dp_warns_that_ddp_is_faster(tmp_path):
    from runner.engine.train import train

    with pytest.warns(UserWarning, match="slower than DistributedDataParallel"):
        summary = train(compose_cfg("distributed=dp"), job_dir=tmp_path)
    assert summary["techniques"]["dp"].startswith("skipped: ")  # no CUDA here


def test_no_sync_skips_the_all_reduce_on_all_but_the_last_micro_batch():
    """The engine's pattern (forward inside ``no_sync``, backward after it) reduces once per step.

    A one-rank DDP counts its bucket reductions through a communication hook.
    """
    cfg = compose_cfg("distributed=ddp")
    env = distributed.setup(cfg.distributed, "cpu")
    try:
        torch.manual_seed(0)
        model, _ = parallel.wrap(
            torch.nn.Linear(4, 2), cfg.distributed, env, precision.build(cfg.precision, env.device), {}
        )
        calls = []

        def count(state, bucket):
            calls.append(1)
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut

        model.register_comm_hook(None, count)
        for use_no_sync, expected in ((True, 1), (False, 2)):
            calls.clear()
            for micro in range(2):
                last = micro == 1 or not use_no_sync
                with parallel.no_sync(model, last=last):
                    loss = model(torch.randn(3, 4)).sum()
                loss.backward()
            assert len(calls) == expected, (use_no_sync, calls)
    finally:
        distributed.teardown()


def test_reduce_figures_single_process_passes_through():
    env = distributed.Env(rank=0, local_rank=0, world_size=1, nodes=1, device=torch.device("cpu"))
    totals = {
        "samples_per_sec": 10.0,
        "step_time_ms_median": 1.0,
        "step_time_ms_p90": 2.0,
        "measured_steps": 3,
        "measured_time_s": 0.3,
        "data_wait_fraction": 0.1,
    }
    assert distributed.reduce_figures(totals, 5.0, env) == {**totals, "peak_memory_mb": 5.0}


def test_fsdp_mixed_precision_follows_the_built_precision():
    """FSDP all-gathers in the dtype the precision group computes in on this device, decided once by
    ``precision.build`` (amp on a CPU without native bf16 is skipped there, so FSDP stays fp32 too)."""
    cpu = torch.device("cpu")

    def policy(name):
        return parallel.fsdp_mixed_precision(
            precision.build(compose_cfg(f"precision={name}").precision, cpu).compute_dtype
        )

    assert policy("bf16").param_dtype == torch.bfloat16 and policy("bf16").reduce_dtype == torch.float32
    assert policy("fp32") is None and policy("tf32") is None
    amp = policy("amp")
    assert (amp.param_dtype == torch.bfloat16) if hardware.cpu_has_native_bf16() else amp is None


@pytest.mark.filterwarnings("ignore:precision=bf16")  # emulated bf16 on this CPU
def test_fsdp_bf16_trains_a_batchnorm_model(tmp_path):
    """bf16 all-gathers with BatchNorm layers kept in fp32 (their fp32 running statistics would clash)."""
    from runner.engine.train import train

    summary = train(compose_cfg("distributed=fsdp", "precision=bf16", "trainer.max_steps=2"), job_dir=tmp_path)
    assert summary["techniques"]["fsdp_mixed_precision"] == "applied"
    assert summary["train_loss"] == summary["train_loss"]  # not NaN
    assert summary["parameters"]["dtensor_count"] == summary["parameters"]["count"]


# ------------------------------------------------------------------------ interleaved sweeps under torchrun

INTERLEAVED = [
    "-m",
    "hydra/launcher=interleaved",
    *[o for o in TINY if not o.startswith("trainer.max_steps")],
    "trainer.max_steps=2000",
    "interleave.slice_steps=2",
    "interleave.resume_steps=1",
    "interleave.min_passes=2",
    "interleave.max_passes=2",
    "interleave.processes=1",
]


@pytest.mark.cli
@pytest.mark.waits  # interleaved jobs: one runs its timed slice while the others wait
def test_an_interleaved_sweep_under_torchrun_runs_each_job_on_every_rank(tmp_path, short_tmp):
    """``torchrun --nproc-per-node=2 -m runner -m hydra/launcher=interleaved distributed=ddp trainer.seed=0,1``:
    each job (seed 0, seed 1, the reference's copy) is a 2-rank DDP job whose ranks were forked by the two ranks'
    conductors and paused together: rank 1's conductor mirrored rank 0's every start, slice and finish (a rank
    one step ahead or behind would hang DDP's all-reduce until distributed.timeout_s fails the job). Rank 0 alone
    writes the record and the report; rank 1 leaves nothing behind."""
    root = make_root(tmp_path)
    sweep = root / "sweep"
    proc = subprocess.run(
        [
            *TORCHRUN,
            "--standalone",
            "--nproc-per-node=2",
            "-m",
            "runner",
            *INTERLEAVED,
            "distributed=ddp",
            "distributed.timeout_s=60",
            "trainer.seed=0,1",
            f"hydra.sweep.dir={sweep}",
        ],
        cwd=root,
        env=child_env(root, TMPDIR=str(short_tmp)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    from runner.compare import record

    r = record.load(sweep)
    assert set(r["jobs"]) == {"0", "1", "0-aa"} and {j["status"] for j in r["jobs"].values()} == {"measured"}
    for name, job in r["jobs"].items():
        summary = read_summary(sweep / name)
        assert summary["world_size"] == 2, summary
        measured = sum(s["steps"] + s["resume_steps"] for s in r["slices"] if s["job"] == name)
        assert job["steps"] == 1 + r["slice_steps"] + measured, (name, job, measured)  # warm-up, settling, measured
    assert {s["pass"] for s in r["slices"]} == {0, 1}
    assert (sweep / "report.csv").is_file() and proc.stdout.count("interleave: 3 jobs") == 1  # rank 0 prints
    assert "each of 2 ranks (torchrun)" in proc.stdout
    assert not list(short_tmp.glob("runner-rank*")), "rank 1 left its scratch sweep behind"


@pytest.mark.cli
def test_an_interleaved_sweep_under_torchrun_needs_distributed_jobs(tmp_path):
    root = make_root(tmp_path)
    proc = torchrun(*INTERLEAVED, "trainer.seed=0,1", f"hydra.sweep.dir={root / 'sweep'}", cwd=root)
    assert proc.returncode != 0
    assert (
        "distributed=none: every job of an interleaved sweep under torchrun runs on all the ranks; add "
        "distributed=ddp" in proc.stderr
    ), proc.stderr[-3000:]
    assert not (root / "sweep" / "0").exists()  # refused before any job was prepared
