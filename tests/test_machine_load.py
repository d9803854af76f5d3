"""How busy the machine was while a run measured (summary.json ``machine_load`` and ``warnings``).

The thresholds are covered on hand-made records (``machine_load.load_warnings``, pure); real runs check that the
record exists and is consistent, and that a machine made busy on purpose (two busy-loop processes on the
cores) gets a warning. Nothing here asserts that a quiet machine gets none: this one is shared.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from conftest import TINY_LOOP, compose_cfg
from runner import measure
from runner.engine.train import train
from runner.measure import machine_load
from runner.track import print_summary


def tiny_mlp(*overrides: str):
    """The cheapest real job: runner's MLP on tests/user_data.py's tabular data, no checkpoint."""
    return compose_cfg(
        *TINY_LOOP,
        "data=custom",
        "data._target_=user_data.tabular",
        "model=mlp",
        "model.hidden=16",
        "checkpoint.at_end=false",
        *overrides,
        tiny=False,
    )


def record(**changes):
    """A quiet 2-core record: runner's 2 threads ran, nothing else did."""
    quiet = {
        "window_s": 2.0,
        "cpu_cores": 2,
        "threads": 2,
        "workers": 0,
        "load_average_1min_start": 1.9,
        "load_average_1min_end": 2.0,
        "load_average_1min_max": 2.0,
        "load_average_others": 0.1,
        "cpu_time_s": 3.8,
        "workers_cpu_time_s": None,
        "cpu_util_fraction": 0.95,
        "busy_cores_computing": 1.9,
        "run_queue_wait_fraction": 0.01,
        "steal_fraction": 0.0,
        "gpu": None,
    }
    return quiet | changes


def test_a_quiet_record_has_no_warning():
    assert machine_load.load_warnings(record(), "cpu") == []
    assert machine_load.load_warnings(None, "cpu") == []  # nothing measured: nothing to judge


@pytest.mark.parametrize(
    "changes, device, expected",
    [
        # others' load above the free cores (2 cores - 2 threads = 0) + the margin
        ({"load_average_others": machine_load.LOAD_MARGIN + 0.01}, "cpu", "the machine was busy"),
        ({"steal_fraction": machine_load.STEAL_FRACTION_MAX + 0.01}, "cpu", "hypervisor"),
        ({"run_queue_wait_fraction": machine_load.RUN_QUEUE_WAIT_MAX + 0.01}, "cpu", "other processes competed"),
        ({"run_queue_wait_fraction": 0.3, "workers": 2}, "cpu", "outnumber the 2 cores"),
        ({"busy_cores_computing": machine_load.BUSY_CORES_MIN - 0.01}, "cpu", "off the CPU"),
        (
            {"gpu": {"other_processes": 1, "throttle_reasons": [], "utilization_percent_end": 90}},
            "cuda",
            "1 other process(es) ran on the GPU",
        ),
        (
            {"gpu": {"other_processes": 0, "throttle_reasons": ["hw_slowdown"], "utilization_percent_end": 90}},
            "cuda",
            "throttled (hw_slowdown)",
        ),
    ],
)
def test_each_threshold_warns_just_above_it(changes, device, expected):
    (warning,) = machine_load.load_warnings(record(**changes), device)
    assert expected in warning


@pytest.mark.parametrize(
    "changes, device",
    [
        ({"load_average_others": machine_load.LOAD_MARGIN}, "cpu"),  # at the margin: not yet
        ({"load_average_others": 1.4, "threads": 1}, "cpu"),  # one core left free: 1.4 <= 1 + 0.5
        ({"steal_fraction": machine_load.STEAL_FRACTION_MAX}, "cpu"),
        ({"run_queue_wait_fraction": machine_load.RUN_QUEUE_WAIT_MAX}, "cpu"),
        ({"busy_cores_computing": 0.2}, "cuda"),  # the host waits on the GPU: CPU time says nothing there
        ({"steal_fraction": None, "run_queue_wait_fraction": None, "load_average_others": None}, "cpu"),  # no /proc
    ],
)
def test_at_or_below_each_threshold_nothing_warns(changes, device):
    assert machine_load.load_warnings(record(**changes), device) == []


@pytest.mark.parametrize(
    "changes, fit",
    [
        ({"load_average_others": 1.2}, 1),  # issue 38: 2 threads on 2 cores, one of them taken by other processes
        ({"run_queue_wait_fraction": 0.3, "workers": 1}, 1),  # 2 threads + a worker on 2 cores
        ({"cpu_cores": 8, "threads": 8, "load_average_others": 2.7}, 5),
    ],
)
def test_a_busy_cpu_warning_names_the_threads_that_fit_the_free_cores(changes, fit):
    warnings = machine_load.load_warnings(record(**changes), "cpu")
    assert machine_load.threads_that_fit(record(**changes)) == fit
    assert warnings[0].endswith(
        f"; trainer.num_threads={fit} runs runner's threads on the {fit} free core(s) instead of fighting for them"
    )
    assert sum("trainer.num_threads" in w for w in warnings) == 1  # said once, however many sentences


@pytest.mark.parametrize(
    "changes, device",
    [
        ({"load_average_others": 1.6, "threads": 1}, "cpu"),  # busy, but one thread fits the one free core already
        ({"load_average_others": 1.2}, "cuda"),  # the threads do not set a GPU job's speed
    ],
)
def test_no_thread_count_is_suggested_where_it_would_not_help(changes, device):
    (warning,) = machine_load.load_warnings(record(**changes), device)
    assert "the machine was busy" in warning and "trainer.num_threads" not in warning


def test_union_length_counts_overlaps_once():
    assert measure.union_length([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == pytest.approx(4.0)
    assert measure.union_length([]) == 0


def test_the_window_counts_only_what_runs_between_resume_and_pause(monkeypatch):
    """Evaluation and checkpoint writes pause the window: its wall, CPU and page-fault figures sum the open
    spans only. Scripted clock readings, so the check does not depend on how fast this machine is."""
    from runner.measure.machine_load import LoadWindow

    # (wall s, CPU s, (on-CPU ns, run-queue wait ns), (steal, ticks), children's CPU s, minor page faults)
    readings = iter(
        [
            (10.0, 1.0, (0, 0), (0, 0), 0.0, 100),  # start
            (12.0, 2.5, (5, 1), (1, 10), 0.0, 130),  # pause (evaluation): 2 s open
            (50.0, 9.0, (9, 9), (9, 90), 0.0, 900),  # resume, 38 s later
            (51.0, 9.5, (12, 2 + 9), (10, 95), 0.0, 905),
        ]
    )  # pause: 1 s open
    window = LoadWindow(torch.device("cpu"))
    monkeypatch.setattr(window, "_snapshot", lambda: next(readings))
    window.resume()
    window.pause()
    window.pause()  # closed already: no reading taken
    window.resume()
    window.pause()
    assert window.wall_s == pytest.approx(3.0) and window.cpu_s == pytest.approx(2.0)
    assert window.minor_faults == 35 and (window.on_cpu_ns, window.wait_ns) == (8, 3)
    assert (window.steal, window.ticks) == (2, 15)


def test_summary_records_the_machine_load_consistently(tmp_path):
    s = train(tiny_mlp("trainer.max_steps=8"), job_dir=tmp_path)
    load = s["machine_load"]
    assert load["threads"] == torch.get_num_threads() and load["cpu_cores"] >= 1 and load["workers"] == 0
    assert isinstance(s["warnings"], list) and all(isinstance(w, str) for w in s["warnings"])
    for key in ("run_queue_wait_fraction", "steal_fraction"):
        assert load[key] is None or 0 <= load[key] <= 1.05, (key, load[key])  # CPU clocks tick coarsely
    # per torch intra-op thread: other threads of the process (inter-op, Python) can lift it above 1 (1.18 seen)
    assert load["cpu_util_fraction"] is None or 0 <= load["cpu_util_fraction"] <= 2, load["cpu_util_fraction"]
    for key in ("load_average_1min_start", "load_average_1min_end", "load_average_others", "cpu_time_s"):
        assert load[key] is None or load[key] >= 0, (key, load[key])
    assert load["load_average_1min_max"] >= max(load["load_average_1min_start"], load["load_average_1min_end"])
    # the window spans the measured steps (that it leaves out what pause() closes: test_the_window_counts_only_...)
    assert s["measured_time_s"] <= load["window_s"] + 1e-3
    assert load["cpu_util_fraction"] == pytest.approx(load["cpu_time_s"] / (load["window_s"] * load["threads"]))
    # the doctor's evidence beside it
    assert 0 <= s["log_time_fraction"] <= 1 and s["host_syncs_per_step"] == 1 / 2  # TINY logs every 2 steps
    assert s["gpu_idle_fraction"] is None and "CPU" in s["gpu_profile"]
    assert s["memory_limit_mb"] > s["peak_memory_mb"] > 0


@pytest.mark.cli
def test_a_machine_kept_busy_by_other_processes_gets_a_warning(tmp_path):
    """Two busy loops on the (two) cores during a tiny run: runner's threads wait for a CPU, and the summary
    says its figures cannot be trusted."""
    if machine_load.hardware.thread_schedule_ns() is None:
        pytest.skip("no /proc/self/task/*/schedstat: run-queue wait is Linux-only")
    hogs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(machine_load.hardware.cpu_cores())
    ]
    try:
        time.sleep(0.3)  # let them take the cores
        s = train(tiny_mlp("trainer.max_steps=40", "trainer.log_every=20", "trainer.num_threads=2"), job_dir=tmp_path)
    finally:
        for hog in hogs:
            hog.kill()
        for hog in hogs:
            hog.wait()
    load = s["machine_load"]
    assert load["run_queue_wait_fraction"] > machine_load.RUN_QUEUE_WAIT_MAX, load
    assert any("waited for a CPU" in w for w in s["warnings"]), s["warnings"]


def test_the_summary_table_ends_with_the_warnings(tmp_path, capsys):
    print_summary({"measurement": "3 steps measured", "techniques": {}, "warnings": ["the machine was busy"]}, tmp_path)
    assert capsys.readouterr().out.splitlines()[-1] == (
        "warning: the machine was busy; rerun on a quiet machine for figures to trust"
    )


def test_a_failing_gpu_profile_costs_the_figure_never_the_run():
    """Without CUDA the probe's first synchronize raises: the figure is None and the note says why."""
    probe = measure.GpuIdleProbe(1, 3)
    for step in (1, 2, 3):
        probe.after_step(step)
    if not torch.cuda.is_available():
        assert probe.idle_fraction is None and probe.note.startswith("profiler failed")
    assert measure.Meter(torch.device("cpu"), 5, 16, gpu_profile_steps=2).gpu_probe is None  # CPU: no window


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU window and NVML need CUDA")
def test_on_cuda_the_warmup_is_profiled_for_gpu_idle(tmp_path):
    s = train(compose_cfg("trainer.device=cuda", "trainer.max_steps=8", "trainer.warmup_steps=4"), job_dir=tmp_path)
    assert 0 <= s["gpu_idle_fraction"] <= 1 and "profiled" in s["gpu_profile"], s["gpu_profile"]
    off = train(
        compose_cfg("trainer.device=cuda", "trainer.max_steps=8", "trainer.warmup_steps=4", "trainer.doctor=false"),
        job_dir=tmp_path / "off",
    )
    assert off["gpu_idle_fraction"] is None


@pytest.mark.parametrize(
    "trainer, reached, said",
    [
        (
            {"target_accuracy": 0.99},
            None,
            "note: the target was not reached in 20 steps: trainer.target_accuracy=0.99 "
            "(the last eval_accuracy: 0.893); train longer (trainer.max_steps) or change "
            "the recipe (optimizer.lr, scheduler)",
        ),
        ({"target_accuracy": 0.8}, 1.5, None),  # reached: nothing said
        ({}, None, None),  # no target: nothing said
        ({"target_loss": 0.1, "target_weights": "ema"}, None, "trainer.target_loss=0.1 (the last eval_loss_ema: 0.38)"),
    ],
)
def test_a_run_that_misses_its_target_says_so_after_its_summary(tmp_path, capsys, trainer, reached, said):
    summary = {
        "measurement": "15 steps measured",
        "steps": 20,
        "eval_accuracy": 0.893,
        "eval_loss_ema": 0.38,
        "eval_mae": 0.25,
        "time_to_target_s": reached,
        "techniques": {},
        "config": {"trainer": trainer},
    }
    print_summary(summary, tmp_path)
    out = capsys.readouterr().out
    assert "  eval_mae " in out  # a task's own metric is in the table too
    notes = [line for line in out.splitlines() if line.startswith("note:")]
    assert (notes == []) if said is None else (len(notes) == 1 and said in notes[0]), out
