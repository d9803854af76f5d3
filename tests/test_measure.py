"""Measurement: the Meter's arithmetic on a scripted clock, then the engine's figures on real runs where
warm-up, data wait and evaluation are made deliberately slow, so a figure that counted them would fail."""

from __future__ import annotations

import json
import math
import sys
import time

import pytest
import torch
from torch import nn

from conftest import compose_cfg, metrics_rows
from runner import data as data_mod, measure, task as task_mod
from runner.engine.train import train
from runner.measure import hardware

ROW_KEYS = {
    "step",
    "epoch",
    "loss",
    "lr",
    "grad_norm",
    "samples_per_sec",
    "step_time_ms",
    "data_wait_ms",
    "peak_memory_mb",
}


class ScriptedClock:
    """A Meter clock that returns the given times (seconds) in order."""

    def __init__(self, times):
        self.times = iter(times)

    def mark(self) -> float:
        return next(self.times)

    @staticmethod
    def elapsed_ms(a: float, b: float) -> float:
        return (b - a) * 1e3


def test_meter_arithmetic_on_a_scripted_clock():
    meter = measure.Meter(torch.device("cpu"), warmup_steps=1, samples_per_step=10)
    meter.clock = ScriptedClock(
        [
            0.0,
            5.0,
            10.0,  # step 0, warm-up: a 5 s fetch that must not count anywhere
            10.0,
            10.1,
            10.5,  # step 1: wait 100 ms, compute 400 ms
            10.5,
            10.6,
            10.8,
            10.9,
            11.5,  # step 2, two micro-batches: wait 100 + 100 ms, compute 800 ms
            20.0,
            20.0,
            20.2,  # step 3 after an 8.5 s gap (evaluation): wait 0, compute 200 ms
        ]
    )
    for fetches in (1, 1, 2, 1):
        for _ in range(fetches):
            meter.start_fetch()
            meter.batch_ready()
        meter.end_step()
    row = meter.flush()
    assert row["samples_per_sec"] == pytest.approx(30 / 1.7)  # 3 steps x 10 samples in 1.7 s
    assert row["step_time_ms"] == pytest.approx(400)
    assert row["data_wait_ms"] == pytest.approx(100)
    totals = meter.totals()
    assert totals["measured_steps"] == 3 and totals["measured_time_s"] == pytest.approx(1.7)
    assert totals["data_wait_fraction"] == pytest.approx(0.3 / 1.7)
    assert totals["step_time_ms_median"] == pytest.approx(400) and totals["step_time_ms_p90"] == pytest.approx(800)
    assert meter.flush() == {"samples_per_sec": None, "step_time_ms": None, "data_wait_ms": None}


def test_meter_all_warmup_gives_nulls():
    meter = measure.Meter(torch.device("cpu"), warmup_steps=5, samples_per_step=10)
    for _ in range(3):
        meter.start_fetch()
        meter.batch_ready()
        meter.end_step()
    assert meter.flush()["samples_per_sec"] is None
    assert meter.totals()["samples_per_sec"] is None and meter.totals()["measured_steps"] == 0
    assert meter.totals()["measurement"] == (
        "too short to measure: all 3 steps were warm-up (trainer.warmup_steps"
        "=5); raise trainer.max_steps above 5 or lower trainer.warmup_steps"
    )


def test_all_warmup_run_says_why_its_speed_is_blank(tmp_path, capsys):
    """A run whose steps are all warm-up has null speed figures; summary.json and the console say why."""
    s = train(compose_cfg("trainer.max_steps=4", "trainer.warmup_steps=5", "trainer.progress=lines"), job_dir=tmp_path)
    assert s["samples_per_sec"] is None and s["measured_steps"] == 0
    assert s["measurement"].startswith("too short to measure: all 4 steps were warm-up (trainer.warmup_steps=5)")
    assert json.loads((tmp_path / "summary.json").read_text())["measurement"] == s["measurement"]
    summary_lines = capsys.readouterr().out.split("summary (")[1].splitlines()
    assert summary_lines[1].split(None, 1) == ["measurement", s["measurement"]]  # the first row, before the blanks


def test_flops_per_sample_counts_forward_and_backward():
    # Linear 8 -> 4 without bias: forward 2*8*4 = 64 FLOPs per sample, weight gradient 64 more (the input
    # needs no gradient). The model itself is left untouched.
    model = nn.Linear(8, 4, bias=False)
    batch = (torch.randn(2, 8), torch.randint(0, 4, (2,)))
    assert measure.flops_per_sample(model, batch, lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1])) == 128
    assert model.weight.grad is None


def test_peak_flops_known_only_where_given():
    cpu = torch.device("cpu")
    assert hardware.peak_flops(cpu, torch.float32, None) is None
    assert hardware.peak_flops(cpu, torch.float32, 2.5) == 2.5e12


@pytest.mark.parametrize(
    "name, key, tflops",
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.0),  # how torch names the SXM5 board
        ("NVIDIA H100 80GB HBM3", "fp8", 1979.0),
        ("NVIDIA H100 SXM5 80GB", "tf32", 494.5),
        ("NVIDIA H100 NVL", "bf16", 835.0),
        ("NVIDIA H100 PCIe", "bf16", 756.0),
        ("NVIDIA H100 PCIe", "fp8", 1513.0),
        ("nvidia h100 pcie", "fp32", 51.0),  # case does not matter
        ("NVIDIA H200", "bf16", 989.0),
        ("NVIDIA H200 NVL", "bf16", 835.0),
        ("NVIDIA B200", "bf16", 2250.0),
        ("NVIDIA B200", "fp8", 4500.0),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
        ("NVIDIA A100 80GB PCIe", "tf32", 156.0),
        ("NVIDIA A100-SXM4-40GB", "fp32", 19.5),
        ("NVIDIA A100-SXM4-40GB", "fp8", None),  # Ampere has no fp8: no peak, never another card's
        ("NVIDIA L4", "bf16", 121.0),
        ("NVIDIA L4", "fp8", 242.5),
        ("NVIDIA L40S", "bf16", 362.0),  # not the L4's
        ("NVIDIA A10", "bf16", 125.0),
        ("NVIDIA A10G", "bf16", None),  # not the A10's figures: unlisted
        ("AMD Instinct MI300X", "bf16", 1307.4),
        ("Tesla T4", "fp16", 65.0),
        ("Tesla V100-SXM2-16GB", "bf16", None),
        ("Some Future GPU", "bf16", None),
    ],
)
def test_peak_tflops_by_device_name(name, key, tflops):
    assert hardware.peak_tflops(name, key) == tflops


def test_peak_flops_of_a_gpu_follows_the_compute_dtype(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    cuda = torch.device("cuda")
    assert hardware.peak_flops(cuda, torch.float8_e4m3fn, None) == 1979e12  # precision=fp8: the fp8 peak
    assert hardware.peak_flops(cuda, torch.bfloat16, None) == 989e12
    before = torch.backends.cuda.matmul.allow_tf32  # a backend flag (no attribute monkeypatch could restore)
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        assert hardware.peak_flops(cuda, torch.float32, None) == 494.5e12
        torch.backends.cuda.matmul.allow_tf32 = False
        assert hardware.peak_flops(cuda, torch.float32, None) == 67e12
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def test_host_memory_is_the_lower_of_the_machine_and_its_cgroup_limit(tmp_path, monkeypatch):
    """One reading of the machine's memory (the tuner's limit and summary.json's ``memory_limit_mb``): cgroup v2
    and v1 limits both count, their "no limit" words do not."""
    v2, v1 = tmp_path / "memory.max", tmp_path / "memory.limit_in_bytes"
    monkeypatch.setattr(hardware, "CGROUP_MEMORY_LIMITS", (v2, v1))
    physical = hardware.physical_memory_mb()
    assert physical > 0 and hardware.host_memory_mb() == physical  # no cgroup files
    v2.write_text("max\n")
    v1.write_text("9223372036854771712\n")  # v1's "no limit"
    assert hardware.host_memory_mb() == physical
    v1.write_text(f"{512 * 2**20}\n")
    assert hardware.host_memory_mb() == 512
    v2.write_text(f"{256 * 2**20}\n")
    assert hardware.host_memory_mb() == 256 == hardware.memory_limit_mb(torch.device("cpu"))


def test_the_cpu_peak_memory_can_be_reset():
    """What the batch-size tuner relies on: each configuration's peak RSS starts afresh."""
    import mmap

    cpu = torch.device("cpu")
    if not measure.reset_peak_memory(cpu):
        pytest.skip("the peak RSS cannot be reset here (no /proc/self/clear_refs)")
    # a spike of 64 MiB the process surely returns: its own mapping, every page touched, then unmapped (a freed
    # tensor's pages may stay resident in the allocator, and a worker's earlier peak may be higher than it)
    spike = mmap.mmap(-1, 64 * 2**20)
    for page in range(0, len(spike), mmap.PAGESIZE):
        spike[page] = 1
    high = measure.peak_memory_mb(cpu)
    spike.close()
    # the peak outlives the spike until it is reset (the kernel's RSS counters run a few pages behind: 1 MiB slack)
    assert measure.peak_memory_mb(cpu) > high - 1
    measure.reset_peak_memory(cpu)
    assert 0 < measure.peak_memory_mb(cpu) < high - 32


# ------------------------------------------------------------------------------------ real runs


class SlowFirstBatches:
    """Wrap the training iterable so its first ``n`` batches take ``seconds`` longer to arrive."""

    def __init__(self, inner, n: int, seconds: float):
        self.inner, self.n, self.seconds, self.served = inner, n, seconds, 0

    def __len__(self) -> int:
        return len(self.inner)

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        self.inner.set_epoch(epoch)

    def __iter__(self):
        for batch in self.inner:
            if self.served < self.n:
                time.sleep(self.seconds)
            self.served += 1
            yield batch

    def close(self) -> None:
        self.inner.close()


def slow_start(monkeypatch, n: int, seconds: float) -> None:
    build = data_mod.build

    def slowed(*args, **kwargs):
        data = build(*args, **kwargs)
        data.train = SlowFirstBatches(data.train, n, seconds)
        return data

    monkeypatch.setattr(data_mod, "build", slowed)


def test_summary_figures_are_consistent(tmp_path):
    s = train(compose_cfg("trainer.max_steps=6", "trainer.warmup_steps=2", "trainer.peak_tflops=1.0"), job_dir=tmp_path)
    assert (s["steps"], s["warmup_steps"], s["measured_steps"]) == (6, 2, 4)
    assert s["measurement"] == "4 steps measured (2 steps of warm-up left out)"
    assert s["samples_per_sec"] == pytest.approx(s["global_batch_size"] * 4 / s["measured_time_s"], rel=1e-9)
    assert 0 <= s["data_wait_fraction"] <= 1
    assert 0 < s["step_time_ms_median"] <= s["step_time_ms_p90"]
    assert s["measured_time_s"] <= s["train_time_s"]  # the measured steps are a part of the training time
    assert s["peak_memory_mb"] > 0 and s["flops_per_sample"] > 0
    assert s["mfu"] == pytest.approx(s["flops_per_sample"] * s["samples_per_sec"] / 1e12)
    assert s["achieved_tflops"] == pytest.approx(s["mfu"])  # peak given as 1 TFLOP/s
    assert json.loads((tmp_path / "summary.json").read_text())["samples_per_sec"] == s["samples_per_sec"]
    once = s["one_time"]  # the one-time costs: the job's wall time is start-up, warm-up and the rest
    assert 0 < once["startup_s"] < once["job_s"] and 0 < once["warmup_s"] < once["job_s"] - once["startup_s"]
    assert once["warmup_excess_s"] == pytest.approx(once["warmup_s"] - 2 * s["step_time_ms_median"] / 1e3)
    assert (once["compile_s"], once["graphs_compiled"], once["compile_cache"]) == (None, None, "off")
    assert 0 < once["first_eval_s"] <= s["eval_time_s"]


def test_metrics_rows_have_the_issue_keys(tmp_path):
    train(
        compose_cfg("trainer.max_steps=6", "trainer.warmup_steps=1", "trainer.log_every=2", "trainer.eval_every=3"),
        job_dir=tmp_path,
    )
    all_rows = metrics_rows(tmp_path)
    train_rows = [r for r in all_rows if "loss" in r]
    eval_rows = [r for r in all_rows if "eval_accuracy" in r]
    assert [r["step"] for r in train_rows] == [2, 4, 6] and [r["step"] for r in eval_rows] == [3, 6]
    for r in train_rows:
        assert set(r) == ROW_KEYS and math.isfinite(r["loss"]) and r["lr"] > 0 and r["peak_memory_mb"] > 0
        assert r["grad_norm"] > 0
    assert train_rows[0]["samples_per_sec"] is None  # step 2's row covers only the warm-up step
    for r in train_rows[1:]:
        assert r["samples_per_sec"] > 0 and r["step_time_ms"] > 0 and r["data_wait_ms"] >= 0
    for r in eval_rows:
        assert set(r) == {"step", "epoch", "eval_accuracy", "eval_loss"} and 0 <= r["eval_accuracy"] <= 1


@pytest.mark.cli
@pytest.mark.parametrize("warmup", [0, 2])
def test_warmup_steps_are_left_out(monkeypatch, tmp_path, warmup):
    # the first two fetches take 1 s each: far above a tiny step, even on a busy shared machine
    slow_start(monkeypatch, n=2, seconds=1.0)
    s = train(compose_cfg("trainer.max_steps=5", f"trainer.warmup_steps={warmup}"), job_dir=tmp_path)
    waited_s = s["data_wait_fraction"] * s["measured_time_s"]
    assert s["measured_steps"] == 5 - warmup
    if warmup == 2:
        assert waited_s < 1.0 and s["step_time_ms_p90"] < 1000
    else:
        assert waited_s >= 2.0
    assert s["samples_per_sec"] == pytest.approx(16 * (5 - warmup) / s["measured_time_s"])


def scripted_evaluate(monkeypatch, accuracies, seconds=0.3) -> list[tuple[float, float]]:
    """Replace the classification task's evaluation by one that takes ``seconds`` and returns the given accuracies;
    returns the list its calls' (start, end) ``perf_counter`` times are appended to."""
    results, calls = iter(accuracies), []

    def evaluate(self, *args, **kwargs):
        start = time.perf_counter()
        time.sleep(seconds)
        calls.append((start, time.perf_counter()))
        return {"eval_accuracy": next(results), "eval_loss": 1.0}

    monkeypatch.setattr(task_mod.Classification, "evaluate", evaluate)
    return calls


def expected_time_to_target(summary, calls, k: int) -> float:
    """Training time until evaluation ``k`` (0-based) began, evaluations before it left out. The loop
    ends right after the last evaluation, which dates the training start from the summary's times."""
    train_start = calls[-1][1] - summary["train_time_s"] - summary["eval_time_s"]
    return calls[k][0] - train_start - sum(end - start for start, end in calls[:k])


def test_time_to_target_excludes_evaluation(monkeypatch, tmp_path):
    calls = scripted_evaluate(monkeypatch, [0.1, 0.2, 0.9])
    s = train(
        compose_cfg(
            "trainer.max_steps=3", "trainer.eval_every=1", "trainer.warmup_steps=0", "trainer.target_accuracy=0.5"
        ),
        job_dir=tmp_path,
    )
    assert s["eval_accuracy"] == 0.9 and s["eval_time_s"] >= 0.9
    # reached at the last evaluation: counting the two evaluations before it would add >= 0.6 s
    assert s["time_to_target_s"] == pytest.approx(expected_time_to_target(s, calls, 2), abs=0.05)
    assert s["time_to_target_s"] <= s["train_time_s"]
    assert s["measured_time_s"] <= s["train_time_s"] + 1e-6  # evaluation is outside every step's timing


def test_time_to_target_at_the_first_evaluation_that_reaches_it(monkeypatch, tmp_path):
    calls = scripted_evaluate(monkeypatch, [0.3, 0.6, 0.9, 0.99])
    loss = task_mod.Classification.loss

    def slow_loss(self, *args, **kwargs):  # a step of known cost: the first two evaluations are >= 0.15 s apart
        time.sleep(0.15)
        return loss(self, *args, **kwargs)

    monkeypatch.setattr(task_mod.Classification, "loss", slow_loss)
    s = train(
        compose_cfg("trainer.max_steps=4", "trainer.eval_every=1", "trainer.target_accuracy=0.5"), job_dir=tmp_path
    )
    assert s["time_to_target_s"] == pytest.approx(expected_time_to_target(s, calls, 1), abs=0.05)
    assert s["time_to_target_s"] < expected_time_to_target(s, calls, 2)


def test_time_to_target_null_when_not_reached(monkeypatch, tmp_path):
    scripted_evaluate(monkeypatch, [0.1, 0.2], seconds=0)
    s = train(
        compose_cfg("trainer.max_steps=2", "trainer.eval_every=1", "trainer.target_accuracy=0.95"), job_dir=tmp_path
    )
    assert s["time_to_target_s"] is None
    monkeypatch.undo()  # the real evaluation; no trainer.target_accuracy at all
    assert train(compose_cfg(), job_dir=tmp_path / "no-target")["time_to_target_s"] is None


# ------------------------------------------------------------------------------------------ console


def test_console_prints_plain_lines_off_a_terminal_and_a_summary_table(tmp_path, capsys):
    assert not sys.stdout.isatty()
    train(compose_cfg("trainer.progress=auto", "trainer.max_steps=6", "trainer.log_every=2"), job_dir=tmp_path)
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("step ") and "| loss " in line]
    assert [line.split(" | ")[0] for line in lines] == ["step 2/6", "step 4/6", "step 6/6"]
    assert "samples_per_sec" in lines[-1] and "step_time_ms" in lines[-1]
    assert f"summary ({tmp_path / 'summary.json'})" in out
    table = out[out.index("summary (") :]
    for key in ("samples_per_sec", "data_wait_fraction", "flops_per_sample", "eval_accuracy", "steps"):
        assert f"  {key} " in table


def test_console_uses_a_progress_bar_on_a_terminal(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    train(compose_cfg("trainer.progress=auto", "trainer.max_steps=4", "trainer.log_every=2"), job_dir=tmp_path)
    captured = capsys.readouterr()
    assert "step 2/4 |" not in captured.out  # no plain lines
    assert "samples/s" in captured.err and "4/4" in captured.err  # tqdm draws on stderr
