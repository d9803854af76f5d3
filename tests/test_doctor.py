"""The speed doctor (runner/doctor/): its decisions on hand-made summaries (every threshold, cheaply), the
bottleneck it names in real runs that induce one on a CPU, and ``--verify`` through the real CLI.

Induced bottlenecks: a dataset whose ``__getitem__`` sleeps (input-bound), ``trainer.log_every=1`` on a tiny
MLP (sync/overhead-bound), ``debug=anomaly`` (debug tools on). No test asserts a speed: --verify is checked
for consistency (each speed-up is the ratio of the medians it prints), not for what it buys.
"""

from __future__ import annotations

import json
import re

import pytest

from conftest import TINY_LOOP, compose_cfg, job_dirs, run_cli
from runner import doctor
from runner.doctor import Job, diagnose
from runner.engine.train import train

CONFIG = {
    "trainer": {"log_every": 50, "warmup_steps": 5, "max_steps": None, "on_nonfinite": "stop"},
    "dataloader": {"batch_size": 64, "num_workers": 0, "pin_memory": False, "on_device": False},
    "data": {"name": "custom"},
    "debug": {"name": "off"},
    "compile": {"mode": None},
    "precision": {"name": "fp32"},
    "memory": {"checkpointing": False, "accumulate_steps": 1},
}


def summary(config_changes: dict | None = None, **changes):
    """A healthy CPU run: no data wait, 1.3 TFLOP/s while computing, 3 % of memory, logging every 50 steps."""
    config = json.loads(json.dumps(CONFIG))
    for dotted, value in (config_changes or {}).items():
        group, key = dotted.split(".")
        config[group][key] = value
    healthy = {
        "samples_per_sec": 1280.0,
        "step_time_ms_median": 50.0,
        "data_wait_fraction": 0.0,
        "peak_memory_mb": 500.0,
        "memory_limit_mb": 16000.0,
        "flops_per_sample": 1e9,
        "global_batch_size": 64,
        "mfu": None,
        "device": "cpu",
        "log_time_fraction": 0.001,
        "host_syncs_per_step": 0.02,
        "gpu_idle_fraction": None,
        "warnings": [],
        "machine_load": {"cpu_cores": 2, "threads": 2},
        "steps": 100,
        "warmup_steps": 5,
        "measurement": "95 steps measured",
        "config": config,
    }
    return healthy | changes


def categories(findings) -> list[str]:
    return [f.category for f in findings]


def overrides(finding) -> list[list[str]]:
    return [s.overrides for s in finding.suggestions]


# ------------------------------------------------------------------------------ decisions on hand-made summaries


def test_a_healthy_run_has_no_finding():
    assert diagnose(summary()) == []


def test_verify_with_nothing_to_verify_says_so_and_exits_0(tmp_path, capsys):
    """A healthy run's diagnosis suggests no override: ``--verify`` says there is nothing to measure in one line
    and exits 0, running and writing nothing (it exited 2 with an error before)."""
    job = tmp_path / "job"
    job.mkdir()
    (job / "summary.json").write_text(json.dumps(summary()))
    assert doctor.main([str(job), "--verify"]) == 0
    out = capsys.readouterr()
    assert f"nothing to verify: the diagnosis of {job} suggests no override to measure" in out.out
    assert out.err == "" and sorted(p.name for p in job.iterdir()) == ["summary.json"]


@pytest.mark.parametrize(
    "wait, found", [(doctor.DATA_WAIT_FRACTION_MAX - 0.01, False), (doctor.DATA_WAIT_FRACTION_MAX, True)]
)
def test_input_bound_from_the_data_wait_threshold(wait, found):
    assert categories(diagnose(summary(data_wait_fraction=wait))) == (["input-bound"] if found else [])


def test_input_bound_suggestions_follow_the_loader_and_the_device():
    (cpu,) = diagnose(summary(data_wait_fraction=0.5))
    # 2 cores here; a custom dataset's tensors may go to the device too (its builder records whether they did)
    assert overrides(cpu) == [["dataloader.num_workers=2"], ["dataloader=device"]]
    (more,) = diagnose(summary({"dataloader.num_workers": 1, "data.name": "mnist"}, data_wait_fraction=0.5))
    assert overrides(more) == [["dataloader.num_workers=2"], ["dataloader=device"]]
    (gpu,) = diagnose(summary({"dataloader.num_workers": 2}, data_wait_fraction=0.5, device="cuda"))
    assert overrides(gpu) == [
        ["dataloader.pin_memory=true", "dataloader.non_blocking=true"],  # workers = cores
        ["dataloader=device"],
    ]


@pytest.mark.parametrize(
    "log_every, syncs, log_share, found",
    [
        (50, 0.02, doctor.LOG_TIME_FRACTION_MAX - 0.001, False),
        (50, 0.02, doctor.LOG_TIME_FRACTION_MAX, True),
        (2, doctor.SYNCS_PER_STEP_MAX, 0.0, True),
        (3, 1 / 3, 0.0, False),
    ],
)
def test_sync_bound_from_syncs_per_step_and_logging_share(log_every, syncs, log_share, found):
    findings = diagnose(
        summary({"trainer.log_every": log_every}, host_syncs_per_step=syncs, log_time_fraction=log_share)
    )
    assert categories(findings) == (["sync/overhead-bound"] if found else [])
    if found and log_every < 50:
        assert overrides(findings[0])[0] == ["trainer.log_every=50"]  # the cause first


def test_overhead_bound_when_a_cpu_step_does_little_arithmetic():
    floor = doctor.CPU_FLOPS_PER_THREAD_MIN * 2  # 2 threads
    step_ms = 50.0
    at_floor = floor * step_ms / 1e3 / 64  # FLOPs per sample that make the step compute exactly the floor
    assert diagnose(summary(flops_per_sample=at_floor)) == []
    (finding,) = diagnose(summary(flops_per_sample=at_floor * 0.9))
    assert finding.category == "sync/overhead-bound" and "GFLOP/s" in finding.evidence
    assert overrides(finding) == [["dataloader.batch_size=128"], ["compile=default"]]
    assert diagnose(summary(flops_per_sample=at_floor * 0.9, device="cuda")) == []  # judged by the GPU window there


def test_host_launch_bound_only_on_cuda_from_gpu_idle_beyond_data_wait():
    idle = doctor.GPU_IDLE_FRACTION_MAX + 0.1
    (finding,) = diagnose(summary(device="cuda", gpu_idle_fraction=idle))
    assert finding.category == "host/launch-bound"
    assert overrides(finding) == [["compile=reduce-overhead"], ["dataloader.batch_size=128"]]
    # the same idle explained by waiting for data is input-bound, not launch-bound
    assert categories(diagnose(summary(device="cuda", gpu_idle_fraction=idle, data_wait_fraction=0.25))) == [
        "input-bound"
    ]


@pytest.mark.parametrize(
    "fraction, found", [(doctor.MEMORY_FRACTION_MAX - 0.01, False), (doctor.MEMORY_FRACTION_MAX, True)]
)
def test_memory_bound_near_the_device_limit(fraction, found):
    findings = diagnose(summary(device="cuda", peak_memory_mb=fraction * 80000, memory_limit_mb=80000))
    assert categories(findings) == (["memory-bound"] if found else [])
    if found:
        assert overrides(findings[0]) == [
            ["precision=bf16"],
            ["memory=checkpointing"],
            ["dataloader.batch_size=32", "memory.accumulate_steps=2"],
        ]


@pytest.mark.parametrize("update_ms, every, found", [(2.0, 1, False), (2.5, 1, True), (5.0, 2, True), (5.0, 4, False)])
def test_an_ema_costing_more_than_its_threshold_suggests_updating_less_often_with_the_same_horizon(
    update_ms, every, found
):
    s = summary({"trainer.ema_decay": 0.999, "trainer.ema_every": every}, ema_update_ms=update_ms)  # 50 ms steps
    findings = [f for f in diagnose(s) if "EMA" in f.evidence]
    assert bool(findings) == found
    if found:
        ((ema_every, ema_decay),) = overrides(findings[0])
        n = int(ema_every.split("=")[1])
        assert n > every and float(ema_decay.split("=")[1]) == pytest.approx(0.999 ** (n / every), rel=1e-5)


def test_gradient_norm_spikes_are_warned_about_with_clipping_suggested():
    rows = [{"step": 10 * i, "loss": 1.0, "grad_norm": 1.0 + 0.1 * (i % 3)} for i in range(1, 9)]
    assert "gradient spikes" not in categories(diagnose(summary(), metrics=rows))
    rows.append({"step": 90, "loss": 3.0, "grad_norm": 25.0})
    (spikes,) = [f for f in diagnose(summary(), metrics=rows) if f.category == "gradient spikes"]
    assert "step 90" in spikes.evidence and ["optimizer.clip_grad_norm=1.0"] in overrides(spikes)


def test_debug_tools_lead_and_near_ceiling_says_nothing_big_is_left():
    findings = diagnose(summary({"debug.name": "anomaly"}, data_wait_fraction=0.5, mfu=doctor.MFU_HIGH))
    assert categories(findings) == ["debug tools on", "input-bound", "near the hardware ceiling"]
    assert overrides(findings[0]) == [["debug=off"]] and findings[2].suggestions == []
    assert "nothing" in findings[2].evidence


def test_untrustworthy_figures_come_first_and_unmeasured_runs_say_how_to_measure():
    findings = diagnose(summary(warnings=["the machine was busy"], data_wait_fraction=0.9))
    assert categories(findings) == ["untrustworthy", "input-bound"]
    assert "busy" in findings[0].evidence and findings[0].suggestions[0].overrides == []
    (unmeasured,) = diagnose(summary(samples_per_sec=None, measurement="too short to measure"))
    assert unmeasured.category == "not measured"
    assert overrides(unmeasured) == [[f"trainer.max_steps={5 + doctor.VERIFY_MEASURED_STEPS}"]]


def test_a_run_on_a_crowded_cpu_is_suggested_the_threads_that_fit():
    """The threads fought for the cores other processes left free: the untrustworthy finding suggests
    trainer.num_threads at the free cores first (which --verify then measures), then the quiet rerun."""
    busy = {"cpu_cores": 2, "threads": 2, "workers": 0, "load_average_others": 1.2}
    (lead,) = diagnose(summary(warnings=["the machine was busy"], machine_load=busy))
    assert lead.category == "untrustworthy" and overrides(lead) == [["trainer.num_threads=1"], []]
    (gpu,) = diagnose(summary(warnings=["the machine was busy"], machine_load=busy, device="cuda"))
    assert overrides(gpu) == [[]]
    (fits,) = diagnose(summary(warnings=["the machine was busy"], machine_load=busy | {"threads": 1}))
    assert overrides(fits) == [[]]


def test_a_suggestion_replaces_the_jobs_own_value_of_its_key():
    base = ["data=custom", "trainer.log_every=1", "+experiment=fast", "data.shape=[3,16,16]"]
    assert doctor.merge_overrides(base, ["trainer.log_every=50", "debug=off"]) == [
        "data=custom",
        "trainer.log_every=50",
        "+experiment=fast",
        "data.shape=[3,16,16]",
        "debug=off",
    ]
    job = Job(
        folder=None,
        summary={},
        config={},
        overrides=base,
        metrics=[],
        cwd=None,
        searchpath=["file:///my/conf", "pkg://runner.conf"],
    )
    assert doctor.command(job, ["debug=off"]) == (
        "python -m runner --config-dir /my/conf data=custom "
        "trainer.log_every=1 +experiment=fast 'data.shape=[3,16,16]' "
        "debug=off"
    )


def test_a_job_of_several_processes_is_suggested_with_its_launcher():
    """A torchrun job's suggestions rerun it under torchrun with its process count, not as one process."""
    s = summary({"trainer.log_every": 1}, host_syncs_per_step=1.0, world_size=4, nodes=1)
    job = Job(
        folder="outputs/x",
        summary=s,
        config=s["config"],
        overrides=["model=mlp", "trainer.log_every=1"],
        metrics=[],
        cwd=None,
        searchpath=[],
    )
    assert "try: torchrun --nproc-per-node=4 -m runner model=mlp trainer.log_every=50   # " in doctor.render(
        diagnose(s), job
    )
    job.summary = s | {"world_size": 8, "nodes": 2}
    assert doctor.command(job, []).startswith("torchrun --nnodes=2 --nproc-per-node=4 -m runner model=mlp")
    job.summary = s | {"world_size": 1}
    assert doctor.command(job, []).startswith("python -m runner model=mlp")


def test_the_heading_has_no_empty_parentheses_without_figures():
    s = summary(
        samples_per_sec=None,
        step_time_ms_median=None,
        data_wait_fraction=None,
        mfu=None,
        measurement="too short to measure",
    )
    job = Job(folder="outputs/x", summary=s, config=s["config"], overrides=[], metrics=[], cwd=None, searchpath=[])
    assert doctor.render(diagnose(s), job).splitlines()[0] == "speed doctor:"
    s = summary()
    job.summary = s
    assert doctor.render(diagnose(s), job).splitlines()[0].startswith("speed doctor (samples/s ")


def test_the_printed_diagnosis_gives_a_command_per_suggestion_and_points_to_printed_warnings():
    s = summary({"trainer.log_every": 1}, host_syncs_per_step=1.0, warnings=["the machine was busy"])
    job = Job(
        folder="outputs/x",
        summary=s,
        config=s["config"],
        overrides=["model=mlp", "trainer.log_every=1"],
        metrics=[],
        cwd=None,
        searchpath=[],
    )
    text = doctor.render(diagnose(s), job)
    assert "1. untrustworthy: the machine was busy" in text
    assert "try: python -m runner model=mlp trainer.log_every=50   # " in text
    assert "python -m runner.doctor outputs/x --verify" in text and "CUDA check" in text
    shown = doctor.render(diagnose(s), job, warnings_shown=True)  # the summary table printed them already
    assert "the machine was busy" not in shown and "warning(s) above (1 in summary.json)" in shown


def test_bad_folders_get_one_error_line(tmp_path, capsys):
    assert doctor.main([str(tmp_path / "nowhere")]) == 2
    assert doctor.main([str(tmp_path)]) == 2  # a folder without summary.json
    (tmp_path / "summary.json").write_text("{not json")
    assert doctor.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3 and all(line.startswith("error: ") for line in err), err
    assert "is not a folder" in err[0] and "no summary.json" in err[1] and "cannot be read" in err[2]


# ------------------------------------------------------------------------------ induced bottlenecks, real runs

SLOW_DATA = '''
import time

import torch
from torch.utils.data import Dataset, TensorDataset


class Slow(Dataset):
    """Rows of a fixed tensor, each taking ``sleep_s`` to load (an expensive decode)."""

    classes = ["a", "b", "c"]

    def __init__(self, n, sleep_s):
        self.x = torch.randn(n, 8, generator=torch.Generator().manual_seed(0))
        self.y = torch.arange(n) % 3
        self.sleep_s = sleep_s

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        time.sleep(self.sleep_s)
        return self.x[i], int(self.y[i])


def slow(sleep_s: float = 0.01):
    return Slow(128, sleep_s), Slow(16, 0.0)


def fast():
    """The same rows as TensorDatasets: nothing to wait for."""
    x, y = torch.randn(160, 8, generator=torch.Generator().manual_seed(0)), torch.arange(160) % 3
    return TensorDataset(x[:128], y[:128]), TensorDataset(x[128:], y[128:])
'''


def tiny_mlp(*overrides: str, target: str = "user_data.tabular"):
    return compose_cfg(
        *TINY_LOOP,
        "data=custom",
        f"data._target_={target}",
        "model=mlp",
        "model.hidden=16",
        "checkpoint.at_end=false",
        *overrides,
        tiny=False,
    )


def bottlenecks(findings) -> list:
    """The findings about the run's speed (the machine's load is this shared machine's, not the run's)."""
    return [f for f in findings if f.category != "untrustworthy"]


def test_a_dataset_that_sleeps_is_input_bound_and_workers_are_suggested(tmp_path, monkeypatch):
    (tmp_path / "doctor_slow_data.py").write_text(SLOW_DATA)
    monkeypatch.syspath_prepend(str(tmp_path))
    # 8 items x 10 ms of sleep per batch against a tiny MLP's step: waiting dominates even on a busy machine
    s = train(
        tiny_mlp("dataloader.batch_size=8", "trainer.max_steps=6", target="doctor_slow_data.slow"),
        job_dir=tmp_path / "job",
    )
    top = bottlenecks(diagnose(s))[0]
    assert top.category == "input-bound" and f"{s['data_wait_fraction']:.3f}" in top.evidence
    assert top.suggestions[0].overrides == [f"dataloader.num_workers={min(4, s['machine_load']['cpu_cores'])}"]


def test_logging_every_step_of_a_tiny_model_is_sync_overhead_bound(tmp_path):
    s = train(tiny_mlp("trainer.log_every=1", "trainer.max_steps=20"), job_dir=tmp_path)
    top = bottlenecks(diagnose(s))[0]
    assert top.category == "sync/overhead-bound" and "trainer.log_every=1" in top.evidence
    assert top.suggestions[0].overrides == ["trainer.log_every=50"]
    assert any(sug.overrides == ["dataloader.batch_size=32"] for sug in top.suggestions)  # TINY: batch 16


def test_anomaly_detection_is_named_as_a_debug_tool_left_on(tmp_path):
    s = train(tiny_mlp("debug=anomaly", "trainer.max_steps=3"), job_dir=tmp_path)
    top = bottlenecks(diagnose(s))[0]
    assert top.category == "debug tools on" and top.suggestions[0].overrides == ["debug=off"]


@pytest.mark.slow  # CI budget (durations on 2 cores): `pytest -m slow` runs it
@pytest.mark.waits  # --verify's interleaved slices: half its wall time waits
def test_every_run_ends_with_the_diagnosis_and_verify_measures_a_suggestion(tmp_path):
    """Through the CLI: the run prints its diagnosis; `--verify --top 1`, started where the job ran (so its data
    module is found there, as in the job; tests/test_trust.py: never from elsewhere), reruns the job and its first
    suggestion interleaved (runner/compare/), and reports the figures it measured."""
    (tmp_path / "doctor_slow_data.py").write_text(SLOW_DATA)
    job_overrides = [
        *TINY_LOOP,
        "data=custom",
        "data._target_=doctor_slow_data.fast",
        "model=mlp",
        "model.hidden=16",
        "trainer.log_every=1",
        "trainer.max_steps=12",
        # one thread fits any load: on a busy machine (CI's other worker) the busy-machine finding
        # (trainer.num_threads=<free cores>) would otherwise lead the diagnosis
        "trainer.num_threads=1",
    ]
    run = run_cli(*job_overrides, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "speed doctor (" in run.stdout and "sync/overhead-bound" in run.stdout, run.stdout[-2000:]
    assert "trainer.log_every=50" in run.stdout
    (job,) = job_dirs(tmp_path)
    out = tmp_path / "verify"
    proc = run_cli(
        str(job),
        "--verify",
        "--top",
        "1",
        "--minutes",
        "0.2",
        "--steps",
        "4",
        "--out",
        str(out),
        "--allow-target",
        "doctor_slow_data",
        cwd=tmp_path,
        module="runner.doctor",
    )  # the user's own module (runner.trust)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    record = json.loads((out / "verify.json").read_text())
    base, sugg = record["trials"]
    assert sugg["overrides"] == ["trainer.log_every=50"] and record["design"] == "interleaved"
    # measured interleaved beside the job's rerun and its copy (the A/A), through runner/compare/
    interleaved = json.loads((out / "interleave.json").read_text())
    assert interleaved["reference"] == "job" and interleaved["aa"] == "job-aa" and interleaved["slice_steps"] == 4
    assert {name for name in interleaved["jobs"]} == {"job", "job-aa", "s1"}
    assert all((out / name / "summary.json").is_file() for name in ("job", "job-aa", "s1"))
    assert record["aa"] is not None and record["aa"]["ci_low"] <= record["aa"]["speedup"] <= record["aa"]["ci_high"]
    assert base["verdict"] == "reference" and base["speedup"] == 1.0 and base["samples_per_sec"] > 0
    assert sugg["samples_per_sec"] > 0 and sugg["ci_low"] <= sugg["speedup"] <= sugg["ci_high"]
    assert sugg["verdict"] in ("helps", "hurts", "no measurable effect")
    # the printed table shows the same figures
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| trainer.log_every=50 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert float(cells[1].replace(",", "")) == pytest.approx(sugg["samples_per_sec"], abs=0.05)
    assert float(cells[2]) == pytest.approx(sugg["speedup"], abs=0.0005) and cells[4] == sugg["verdict"]
    assert re.search(r"\| the job \(rerun\) \| [\d,.]+ \| 1\.000 \| – \| reference \|", proc.stdout)


def test_a_suggestion_from_a_job_run_with_a_config_dir_runs_as_printed_from_another_folder(tmp_path):
    """A job that ran with ``--config-dir my-configs model=tiny`` (a model option of the user's own): the doctor's
    suggested command, read back from the job folder, carries the config folder (absolute) and the job's overrides,
    and runs as printed from another folder."""
    import shlex

    from conftest import TINY, run_here
    from runner.doctor.job import load_job

    (tmp_path / "my-configs" / "model").mkdir(parents=True)
    (tmp_path / "my-configs" / "model" / "tiny.yaml").write_text(
        "defaults: [base_model, _self_]\n_target_: runner.models.MLP\nhidden: 8\n"
    )
    job = tmp_path / "job"
    ran = run_here(
        "--config-dir", "my-configs", *TINY, "model=tiny", "trainer.doctor=false", f"hydra.run.dir={job}", cwd=tmp_path
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
    line = doctor.command(load_job(job), ["debug=off"])
    assert line.startswith(f"python -m runner --config-dir {tmp_path / 'my-configs'} ") and "model=tiny" in line
    (tmp_path / "elsewhere").mkdir()
    shown = run_here(*shlex.split(line)[3:], "--cfg", "job", cwd=tmp_path / "elsewhere")
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert "_target_: runner.models.MLP" in shown.stdout and "hidden: 8" in shown.stdout
