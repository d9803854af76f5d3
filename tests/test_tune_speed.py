"""``python -m runner.tune speed``: the candidates that apply, the numerics guard, the search (each switch alone and
all together, then backward elimination) measured by interleaved resident processes, the job objective, the
verification and the preset it writes (runner/tune/speed.py)."""

from __future__ import annotations

import json
import math
import shlex
import subprocess
import time

import pytest

from conftest import TINY, TINY_GPT, compose_cfg, read_csv, run_cli
from runner import tune
from runner.errors import ConfigError
from runner.tune import speed
from test_distributed import TORCHRUN, child_env

#: a short search: 4 passes of 3-step slices per round, a 10-step guard
QUICK = [
    # (compile off on the command line, as yours: the verification's +experiment=fast keeps it, as it keeps any key
    # of yours, and a CPU does not compile the model in each of its job processes: ~20 core-s each)
    "compile=off",
    "tune.guard_steps=10",
    "interleave.slice_steps=3",
    "interleave.min_passes=4",
    "interleave.max_passes=4",
    "interleave.resume_steps=1",
    "tune.budget_minutes=6",
]


def names(switches):
    return {s.name for s in switches}


def test_candidates_follow_the_job_and_the_hardware(tmp_path):
    import torch

    cpu = torch.device("cpu")
    image, notes = speed.switches(compose_cfg(), cpu)
    assert {"compile", "fused_optimizer", "channels_last", "on_device_data"} <= names(image)
    assert not {"amp", "tf32", "cudnn_benchmark", "pinned_memory", "batch_x2"} & names(image)  # CUDA only / recipe
    assert "compile_max_autotune" in names(image) and "compile_reduce_overhead" not in names(image)  # CUDA graphs
    assert any(n.startswith("set_to_none: already on") for n in notes)
    text = tmp_path / "input.txt"
    text.write_text("To be, or not to be, that is the question.\n" * 40)
    lm, _ = speed.switches(compose_cfg(*TINY_GPT, f"data.path={text}", "optimizer.set_to_none=false"), cpu)
    assert "channels_last" not in names(lm) and "set_to_none" in names(lm)  # an image technique; off in this job
    from runner.measure import hardware

    if hardware.cpu_has_native_bf16():  # bf16, and bf16 with the GPT's attention in fp32: one precision each
        by_lm = {s.name: s for s in lm}
        assert by_lm["bf16_upcast_attention"].changes == {"precision.name": "bf16", "model.upcast_attention": True}
        assert by_lm["bf16_upcast_attention"].group == by_lm["bf16"].group == "precision"
        assert "bf16_upcast_attention" not in names(image)
        assert any(n.startswith("bf16_upcast_attention: not a candidate (the model has no upcast") for n in notes)
    recipe, _ = speed.switches(compose_cfg("dataloader.batch_size=8"), cpu, allow="recipe")
    by_name = {s.name: s for s in recipe}
    assert by_name["batch_x2"].changes == {"dataloader.batch_size": 16, "optimizer.lr_scaling": "linear"}
    assert by_name["batch_x2"].recipe and not by_name["on_device_data"].arithmetic


def test_tf32_s_note_says_why_it_is_not_a_candidate(monkeypatch):
    import torch

    def tf32_note(*overrides, device=torch.device("cpu")):
        _, notes = speed.switches(compose_cfg(*overrides), device)
        return next(n for n in notes if n.startswith("tf32:"))

    assert tf32_note() == (
        "tf32: not a candidate (TF32 needs an NVIDIA GPU of compute capability 8.0 or newer; this job runs on the CPU)"
    )
    assert tf32_note("precision=tf32") == "tf32: already on in your configuration"
    # an H200 running bf16: the reason is the precision, not the GPU
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = torch.device("cuda")
    assert tf32_note("precision=bf16", device=cuda) == (
        "tf32: not a candidate (precision=bf16 is not fp32: TF32 changes only fp32 matmuls and convolutions)"
    )
    assert "tf32" in names(speed.switches(compose_cfg("precision=fp32"), cuda)[0])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))  # a V100
    assert tf32_note(device=cuda) == (
        "tf32: not a candidate (TF32 needs compute capability 8.0 or newer; this GPU has 7.0)"
    )


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["tune.only=[compile,warp_drive]"], ["tune.only", "warp_drive", "compile"]),
        (["tune.switches={mine: {no_such_key: 1}}"], ["tune.switches.mine", "no_such_key", "not a key"]),
        (["tune.switches={compile: {channels_last: true}}"], ["tune.switches.compile", "built-in"]),
        (["tune.guard_tolerance=0"], ["tune.guard_tolerance=0"]),
        (["tune.allow=everything"], ["tune.allow=everything", "speed or recipe"]),
    ],
)
def test_bad_speed_settings_are_refused(tmp_path, overrides, words):
    with pytest.raises(ConfigError) as caught:
        tune.run("speed", compose_cfg(*overrides), tmp_path)
    assert all(w in str(caught.value) for w in words), str(caught.value)


def test_departure_compares_mean_losses_at_the_same_samples():
    curve = [3.0 - 0.02 * i for i in range(50)]
    assert speed.departure(curve, curve, 16, 16) == 0.0
    assert speed.departure(curve, [v * 1.05 for v in curve], 16, 16) == pytest.approx(0.05)
    # a 2x batch takes half the steps to the same samples: its losses are compared window by window there
    assert speed.departure(curve, curve[::2][:25], 16, 32) < 0.01
    assert speed.departure(curve, [*curve[:-1], math.nan], 16, 16) == math.inf


def test_the_guard_rejects_a_switch_that_changes_what_is_learned(tmp_path):
    # lr 50 changes the arithmetic and what is learned; the foreach kernel changes neither beyond rounding; a
    # trillion synthetic images (768 TB) cannot be allocated: a real out-of-memory error (the CPU allocator's),
    # which rejects that candidate while the search goes on. With no round's minute left after the guard and the
    # verification's reserve (a budget of 0.5 min of wall time) the search stops there.
    cfg = compose_cfg(
        "tune.only=[foreach_optimizer]",
        "tune.switches={broken: {optimizer.lr: 50.0}, huge: {data.train_size: 1000000000000}}",
        "tune.guard_steps=10",
        "tune.budget_minutes=0.5",
    )
    result = tune.run("speed", cfg, tmp_path / "out")
    guard = {r["switch"]: r for r in result["rows"] if r["stage"] == "guard"}
    assert guard["broken"]["verdict"].startswith("rejected") and guard["broken"]["guard_departure"] > 0.02
    assert guard["huge"]["verdict"] == "rejected (out of memory)"
    # the tolerance: yours under another seed (the spread of equally good runs), at least tune.guard_tolerance
    spread = guard["(yours, trainer.seed + 1)"]["guard_departure"]
    assert (
        0 < spread < guard["broken"]["guard_departure"]
        and "the tolerance" in guard["(yours, trainer.seed + 1)"]["verdict"]
    )
    assert guard["foreach_optimizer"]["verdict"] == "passed" and guard["foreach_optimizer"]["guard_departure"] < 0.02
    assert result["override"] == "(no change)" and result["recommended"]["switches"] == []
    assert not (tmp_path / "out" / "experiment" / "tuned.yaml").exists()  # no change writes no preset


def test_on_device_batches_are_the_loaders_batches():
    """What lets the guard skip on-device data: in one process the batches on the device are the DataLoader's,
    epoch after epoch and after a resume's skip."""
    from runner import distributed
    from runner.data import build

    batches = []
    for on_device in (False, True):
        cfg = compose_cfg("data=mnist", "data.train_size=256", f"dataloader.on_device={str(on_device).lower()}")
        data = build(cfg.data, cfg.dataloader, distributed.setup(cfg.distributed, "cpu"), seed=3)
        seen = []
        for epoch, skip in ((0, 0), (1, 0), (2, 3)):
            data.train.set_epoch(epoch, skip=skip)
            x, y = next(iter(data.train))
            seen.append((x.sum().item(), y.tolist()))
        batches.append(seen)
    assert [labels for _, labels in batches[0]] == [labels for _, labels in batches[1]]
    assert [b[0] for b in batches[0]] == pytest.approx([b[0] for b in batches[1]], rel=1e-5)


#: A model whose step has a known wall time (tests/test_tune_speed.py writes it into the job's folder): its forward
#: sleeps until ``ms`` milliseconds have passed, 2.5x that with anomaly detection on, so ``debug=off`` is a x2.5
#: speed-up by construction. A wait on the wall clock keeps its cost on a busy machine (a step descheduled halfway
#: still ends at its deadline), so the tuner's verdict does not depend on what else runs; a sleep rather than a spin
#: holds no core meanwhile (CI runs these beside its other tests: the four tests that use it took 25 core-s less).
KNOWN_COST = """
import time

import torch
from torch import nn


class Spin(nn.Module):
    def __init__(self, num_classes: int = 10, ms: float = 4.0):
        super().__init__()
        self.ms = ms
        self.head = nn.Linear(16, num_classes)

    def forward(self, x):
        deadline = time.perf_counter() + self.ms / 1000 * (2.5 if torch.is_anomaly_enabled() else 1.0)
        time.sleep(max(0.0, deadline - time.perf_counter()))
        return self.head(x.flatten(1)[:, :16])
"""


@pytest.mark.slow
@pytest.mark.waits
def test_a_switch_of_known_cost_is_picked_verified_and_written_as_a_preset(tmp_path):
    """The job runs with anomaly detection on and a step of known cost (``KNOWN_COST``): turning it off is x2.5 by
    construction, so the round, the verification and the preset must all say so, on a quiet machine or a busy one;
    the override printed, the preset and the line to paste follow that verdict (the no-change branch: the guard's
    test above), and the CSV's figures are consistent."""
    (tmp_path / "known_cost.py").write_text(KNOWN_COST)
    (tmp_path / "my-configs" / "model").mkdir(parents=True)  # the model is an option of the user's own configs
    (tmp_path / "my-configs" / "model" / "spin.yaml").write_text(
        "defaults: [base_model, _self_]\n_target_: known_cost.Spin\nms: 40\n"
    )
    out = tmp_path / "out"
    job = [*TINY, "model=spin", "debug=anomaly", "trainer.max_steps=2000"]
    proc = run_cli(
        "speed",
        "--out",
        str(out),
        "--config-dir",
        "my-configs",
        *job,
        *QUICK,
        "tune.only=[]",
        "tune.switches={debug_off: {debug.name: 'off'}}",
        "tune.objective=throughput",
        cwd=tmp_path,
        module="runner.tune",
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "speed.json").read_text())
    (first,) = [r for r in result["rows"] if r["stage"] == "round 1"]
    assert first["switch"] == "debug_off" and first["verdict"] == "helps" and 1.5 < first["speedup"] < 3.2, first
    (row,) = [r for r in read_csv(out / "speed.csv") if r["stage"] == "round 1"]
    assert float(row["ci_low"]) <= float(row["speedup"]) <= float(row["ci_high"]) and row["switch"] == "debug_off"
    assert (out / "rounds" / "round1" / "interleave.json").is_file()
    assert "override: debug.name=off" in proc.stdout.splitlines()
    verification = {r["switch"]: r for r in result["rows"] if r["stage"] == "verification"}
    assert verification["debug_off"]["verdict"] == "helps" and any(k.startswith("+experiment=") for k in verification)
    assert result["recommended"]["switches"] == ["debug_off"] and result["recommended"]["ci_low"] > 1
    preset = (out / "experiment" / "tuned.yaml").read_text()
    assert preset.startswith("# @package _global_") and "debug:\n  name: 'off'" in preset
    # the line the tuner prints to paste, run as printed (from another folder), composes the job it tuned with the pick
    (line,) = [ln.removeprefix("run it: ") for ln in proc.stdout.splitlines() if ln.startswith("run it: ")]
    assert line.startswith(f"python -m runner --config-dir {tmp_path / 'my-configs'} ") and "tune." not in line
    (tmp_path / "elsewhere").mkdir()
    shown = run_cli(*shlex.split(line)[3:], "--cfg", "job", cwd=tmp_path / "elsewhere", timeout=120)
    assert shown.returncode == 0, shown.stdout[-2000:] + shown.stderr
    assert "name: off" in shown.stdout.replace("'", "") and "_target_: known_cost.Spin" in shown.stdout


def test_num_threads_is_applied_and_null_restores_the_default(tmp_path):
    """``trainer.num_threads`` (the speed tuner's ``half_threads``): set for the run, recorded, and a later job
    in the same process with null gets torch's default back."""
    import torch

    from conftest import run_tiny
    from runner.techniques import prepare

    summary = run_tiny(tmp_path / "one", "trainer.num_threads=1")
    assert summary["techniques"]["num_threads"] == "applied" and torch.get_num_threads() == 1
    summary = run_tiny(tmp_path / "default", "trainer.num_threads=null")
    assert "num_threads" not in summary["techniques"] and torch.get_num_threads() == prepare.DEFAULT_NUM_THREADS
    with pytest.raises(ConfigError, match=r"trainer.num_threads=0 must be >= 1"):
        run_tiny(tmp_path / "bad", "trainer.num_threads=0")
    assert not (tmp_path / "bad" / "summary.json").exists()


@pytest.mark.slow
@pytest.mark.longest
@pytest.mark.waits  # 53 s of wall time for 19 s of CPU alone
def test_under_torchrun_every_job_runs_on_both_ranks_and_the_ranks_agree(tmp_path, short_tmp):
    """``torchrun --nproc-per-node=2 -m runner.tune speed distributed=ddp``: the guard trains on both ranks, every
    measured job of every round is a 2-rank DDP job (rank 1's conductor mirrors rank 0's), and each rank reaches
    the same recommendation from rank 0's figures (the harness gathers the ranks' and fails if they differ)."""
    out = tmp_path / "out"
    cmd = [
        *TORCHRUN,
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "runner.tune",
        "speed",
        "--out",
        str(out),
        "distributed=ddp",
        "distributed.timeout_s=120",
        *TINY,
        *QUICK,
        "tune.only=[]",
        "tune.switches={anomaly: {debug.name: anomaly}}",
    ]
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=child_env(tmp_path, TMPDIR=str(short_tmp)), capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    result = json.loads((out / "speed.json").read_text())
    assert result["world_size"] == 2 and result["ranks"][0] == result["ranks"][1] == result["recommended"]
    assert [r["switch"] for r in result["rows"] if r["stage"] == "round 1"] == ["anomaly"]
    summaries = sorted((out / "rounds").glob("*/*/summary.json"))
    assert {p.parent.parent.name for p in summaries} == {"round1", "verification"}
    assert all(json.loads(p.read_text())["world_size"] == 2 for p in summaries), summaries
    assert proc.stdout.count("override: ") == 1  # rank 0 prints


def _verification(
    rates: dict[str, float],
    passes: int = 8,
    noise: float = 0.02,
    reference: str = "yours",
) -> "speed.Round":
    """A round read from a synthetic record: each configuration's samples/s (``reference`` is the reference,
    ``<reference>-aa`` its copy), one slice per pass each, with ±``noise`` per slice and a drift shared by the whole
    pass (which pairing cancels)."""
    import random

    rng = random.Random(0)
    jobs = {
        name: {"config": name, "reference": None if name == reference else reference, "group": 1, "status": "measured"}
        for name in rates
    }
    slices = []
    for p in range(passes):
        drift = 1 + 0.2 * math.sin(p)
        for position, (name, rate) in enumerate(rates.items()):
            slices.append(
                {
                    "group": 1,
                    "pass": p,
                    "position": position,
                    "job": name,
                    "pairs_with": None if name == reference else 0,
                    "samples_per_sec": rate * drift * (1 + rng.uniform(-noise, noise)),
                }
            )
    record = {
        "reference": reference,
        "aa": f"{reference}-aa",
        "settings": {"confidence": 0.95},
        "jobs": jobs,
        "slices": slices,
    }
    from runner import compare

    r = speed.Round("verification", reference, {}, minutes=0.0)
    return speed.read_round(r, compare.read(record, 0.95))


def test_the_whole_combination_is_chosen_only_when_firmly_faster_than_the_pick():
    # resnet18/CIFAR: bf16 alone x1.64, with compile and channels_last x2.0 -> the whole combination wins
    v = _verification({"yours": 100.0, "yours-aa": 100.0, "pick": 164.0, "extended": 200.0})
    assert speed.choose(v, ["pick", "extended"], 1.0) == "extended"
    # the rest of the combination adds nothing firm: the pick, with fewer switches to keep
    v = _verification({"yours": 100.0, "yours-aa": 100.0, "pick": 164.0, "extended": 165.0})
    assert speed.choose(v, ["pick", "extended"], 1.0) == "pick"
    # nothing firmly faster than yours: no change, even where the point estimates are above 1
    v = _verification({"yours": 100.0, "yours-aa": 100.0, "pick": 100.5, "extended": 101.0}, noise=0.05)
    assert speed.choose(v, ["pick", "extended"], 1.0) is None


def test_the_job_objective_counts_one_time_costs_and_finds_the_break_even(tmp_path):
    """``pick`` is x1.64 per step but pays 30 s once (a compile): over a 10-step job yours is shorter, so nothing is
    recommended and the note gives the break-even; over 2,000 steps the pick is."""
    from types import SimpleNamespace

    import torch

    cfg = compose_cfg(*TINY)
    v = _verification({"yours": 100.0, "yours-aa": 100.0, "pick": 164.0})
    v.jobs, v.one_time = {"yours": cfg, "pick": cfg}, {"yours": 1.0, "pick": 31.0}
    search = speed._Search(cfg, SimpleNamespace(distributed=False, is_main=True, device=torch.device("cpu")), tmp_path)
    batch = search.batch_of(cfg)
    gain = batch / v.samples_per_sec["yours"] - batch / v.samples_per_sec["pick"]  # s per step
    for steps, expected in ((10, None), (2000, "pick")):
        search.job_steps = steps
        row = search.figures(v, "pick", "yours")
        assert row["pays_after_steps"] == math.ceil(30.0 / gain)
        assert (row["job_speedup"] > 1) == (steps > row["pays_after_steps"])
        assert search.shortest_job(v, {"pick": []}, {"pick": "compile"}, "pick") == expected
    assert "pay after" in search.notes[0] and f"{math.ceil(30.0 / gain):,} steps" in search.notes[0]


def test_the_job_objective_keeps_the_pick_with_fewer_switches_unless_its_job_is_not_shorter(tmp_path):
    """ResNet-18 on the CPU: the pick and the whole combination read x1.957 and x1.955 per step, their projected jobs
    x1.915 and x1.924 yours. The pick stays (more switches need a firm win); only where the pick's job is not
    shorter than yours (a 40 s compile over 100 steps) does a firmly faster option whose job is shorter replace it."""
    from types import SimpleNamespace

    import torch

    cfg = compose_cfg(*TINY)
    v = _verification({"yours": 100.0, "yours-aa": 100.0, "pick": 195.7, "extended": 195.5})
    v.jobs = {"yours": cfg, "pick": cfg, "extended": cfg}
    search = speed._Search(cfg, SimpleNamespace(distributed=False, is_main=True, device=torch.device("cpu")), tmp_path)
    options, label = {"pick": [], "extended": []}, {"pick": "p", "extended": "e"}
    search.job_steps = 2000
    v.one_time = {"yours": 1.0, "pick": 10.0, "extended": 1.0}  # the extended job projects shorter
    assert search.figures(v, "extended", "yours")["job_speedup"] > search.figures(v, "pick", "yours")["job_speedup"]
    assert search.shortest_job(v, options, label, "pick") == "pick"
    search.job_steps = 100
    v.one_time = {"yours": 1.0, "pick": 40.0, "extended": 1.0}
    assert search.shortest_job(v, options, label, "pick") == "extended"


#: A model whose step cost depends on two switches together (``KNOWN_COST``'s wait): either alone makes the step
#: x1.25 as long, both together x0.4 -- the interaction greedy forward selection cannot find by construction
PAIR = (
    KNOWN_COST
    + """

class Pair(Spin):
    def __init__(self, num_classes: int = 10, ms: float = 4.0, a: bool = False, b: bool = False):
        super().__init__(num_classes, ms * (0.4 if a and b else 1.25 if a or b else 1.0))
"""
)


@pytest.mark.slow
@pytest.mark.waits
def test_two_switches_that_pay_only_together_are_found_and_the_interaction_reported(tmp_path):
    (tmp_path / "known_cost.py").write_text(PAIR)
    out = tmp_path / "out"
    job = [
        *TINY,
        "model._target_=known_cost.Pair",
        "+model.ms=30",
        "+model.a=false",
        "+model.b=false",
        "trainer.max_steps=2000",
    ]  # a job long enough to pay for the combination's one-time costs
    proc = run_cli(
        "speed",
        "--out",
        str(out),
        *job,
        *QUICK,
        "tune.only=[]",
        "tune.switches={a: {model.a: true}, b: {model.b: true}}",
        cwd=tmp_path,
        module="runner.tune",
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "speed.json").read_text())
    first = {r["switch"]: r for r in result["rows"] if r["stage"] == "round 1"}
    assert first["a"]["speedup"] < 1 and first["b"]["speedup"] < 1 and first["a+b"]["verdict"] == "helps", first
    assert result["recommended"]["switches"] == ["a", "b"] and result["recommended"]["ci_low"] > 1
    assert sum(n.startswith("interaction: ") for n in result["notes"]) == 2, result["notes"]
    assert "# objective: job" in (out / "experiment" / "tuned.yaml").read_text()


def test_the_console_table_shows_every_decision_however_many_rounds():
    """The harness thins long tables on the console (the LR finder's hundreds of points); the speed tuner's rows
    are each a decision, so a long search still shows its verification against +experiment=fast."""
    from runner.tune.harness import markdown_table

    rows = [{"stage": f"round {i // 7 + 1}", "switch": f"s{i}", "speedup": 1.0} for i in range(21)]
    rows += [
        {"stage": "verification", "switch": "s0", "speedup": 1.2},
        {"stage": "verification", "switch": "+experiment=fast", "speedup": 1.1},
        {"stage": "verification", "switch": "(yours, A/A)", "speedup": 1.0},
    ]
    table = markdown_table(speed.TUNER, rows, {"switches": ["s0"]}, max_rows=speed.TUNER.console_rows)
    assert len(table.splitlines()) == 2 + len(rows) and "+experiment=fast" in table and "| s13 |" in table
    assert "**<- recommended**" in table.splitlines()[2 + 21]


def _elimination(tmp_path, speed_of, noise: float = 0.02):
    """A search whose rounds are synthetic: each job's samples/s is ``speed_of(its config)`` (± ``noise`` per slice);
    returns the search (its ``rounds`` list holds one entry per round measured)."""
    from types import SimpleNamespace

    import torch

    env = SimpleNamespace(distributed=False, is_main=True, device=torch.device("cpu"))
    search = speed._Search(compose_cfg(*TINY), env, tmp_path)

    def measured(title, reference, jobs, share=0.5):
        rates = {name: speed_of(c) for name, c in jobs.items()}
        r = _verification(
            {reference: rates[reference], f"{reference}-aa": rates[reference], **rates},
            reference=reference,
            noise=noise,
        )
        r.jobs = jobs
        search.rounds.append(r)
        return r

    search.round = measured
    return search


def test_elimination_takes_a_firm_swap_and_drops_every_firm_hurt_in_one_round(tmp_path):
    """``a1`` and ``a2`` are one group's alternatives (a2 x1.45 a1's speed), ``b`` helps x1.3, ``c`` costs x0.7: from
    a1+b+c, the first round both swaps a1 for a2 and drops c, and the second finds that every switch pays."""
    from runner.tune.switches import Switch

    a1, a2 = Switch("a1", {"trainer.log_every": 11}, "g"), Switch("a2", {"trainer.log_every": 12}, "g")
    b, c = Switch("b", {"trainer.seed": 5}), Switch("c", {"trainer.eval_every": 7})

    def speed_of(cfg):
        return (
            100.0
            * {11: 1.1, 12: 1.6}.get(cfg.trainer.log_every, 1.0)
            * (1.3 if cfg.trainer.seed == 5 else 1)
            * (0.7 if cfg.trainer.eval_every == 7 else 1)
        )

    search = _elimination(tmp_path, speed_of)
    assert search.eliminate([a1, b, c], [a1, a2, b, c]) == [a2, b]
    assert len(search.rounds) == 2, search.notes  # one round to swap and drop, one to find nothing left to do
    assert "round 1: a2 in place of a1, firmly faster in the combination" in search.notes
    assert "+c" in search.rounds[1].comparisons  # the dropped switch was tried again in the new combination


def test_two_substitutes_dropped_together_are_added_back_one_at_a_time(tmp_path):
    """``d`` and ``e`` do the same job (each x1.5 alone, x1.4 together: one's overhead without its benefit). Each
    is firmly slower beside the other, so both go in one round; the next round adds one back."""
    from runner.tune.switches import Switch

    d, e = Switch("d", {"trainer.seed": 5}), Switch("e", {"trainer.eval_every": 7})

    def speed_of(cfg):
        on = (cfg.trainer.seed == 5) + (cfg.trainer.eval_every == 7)
        return 100.0 * (1.0, 1.5, 1.4)[on]

    search = _elimination(tmp_path, speed_of)
    pick = search.eliminate([d, e], [d, e])
    assert len(pick) == 1 and pick[0] in (d, e), (pick, search.notes)
    assert "round 1: d, e dropped together, each firmly slower in the combination" in search.notes
    assert any(n.startswith("round 2: ") and "added back" in n for n in search.notes), search.notes


def test_the_elimination_starts_from_an_alternative_only_where_it_was_firmly_faster_alone():
    """Round 1's readings, head to head: bf16 with fp32 attention x1.27 plain bf16's (taken); max-autotune x1.005
    compile's default mode (noise: the first offered stays, so a rerun starts from the same combination)."""
    from runner.tune.rounds import group_best
    from runner.tune.switches import Switch

    bf16, upcast = Switch("bf16", {}, "precision"), Switch("bf16_upcast_attention", {}, "precision")
    compile_, autotune, fused = Switch("compile", {}, "compile"), Switch("max", {}, "compile"), Switch("fused", {})
    r = _verification(
        {
            "yours": 100.0,
            "yours-aa": 100.0,
            "bf16": 101.0,
            "bf16_upcast_attention": 128.0,
            "compile": 104.0,
            "max": 104.5,
            "fused": 103.0,
        },
        noise=0.03,
    )
    best = group_best([compile_, fused, bf16], [compile_, autotune, fused, bf16, upcast], r)
    assert best == [compile_, fused, upcast]  # a switch without a group stays too


def test_a_switch_whose_removal_reads_slower_goes_only_where_the_round_resolves_its_cost(tmp_path):
    """``b`` helps x1.3. A ``z`` that does nothing goes in a round that resolves its removal to cost under
    tune.target_ci (fewer switches to keep); a ``z`` of x1.05 in a round too noisy to resolve it (on the GPT,
    -fused_optimizer once read x0.958 [0.890-1.028]) stays, and the elimination ends with the pick it has."""
    from runner.tune.switches import Switch

    z, b = Switch("z", {"trainer.eval_every": 7}), Switch("b", {"trainer.seed": 5})

    def speed_of(z_effect):
        return lambda cfg: (
            100.0 * (1.3 if cfg.trainer.seed == 5 else 1) * (z_effect if cfg.trainer.eval_every == 7 else 1)
        )

    search = _elimination(tmp_path / "resolved", speed_of(1.0))
    assert search.eliminate([z, b], [z, b]) == [b], search.notes
    search = _elimination(tmp_path / "noisy", speed_of(1.05), noise=0.3)
    assert search.eliminate([z, b], [z, b]) == [z, b], (search.notes, search.rounds[0].comparisons)
    assert len(search.rounds) == 1 and "not shown to cost under 5%" in search.notes[-1], search.notes


def test_a_round_too_short_for_its_passes_is_not_measured_and_the_verification_takes_more_pairs(tmp_path, monkeypatch):
    """The last elimination round of an 8-minute search had 0.7 min for 12 jobs of 1 s slices (under 4 passes: most
    jobs not measured); it is skipped with a note. The verification, whose verdict is the recommendation, runs at
    least ``VERIFICATION_PASSES`` passes (5 calm passes had decided it)."""
    from types import SimpleNamespace

    import torch

    from runner.tune.switches import Switch

    seen = []
    monkeypatch.setattr(speed, "measure_round", lambda r, folder, settings, ranks: seen.append((r, settings)) or r)
    cfg = compose_cfg(*TINY, "tune.slice_seconds=1", "interleave.min_passes=4", "interleave.max_passes=200")
    env = SimpleNamespace(distributed=False, device=torch.device("cpu"), is_main=True)
    search = speed._Search(cfg, env, tmp_path)
    # 220 s of wall time left, 125 s kept for the verification (5 jobs x (1 s start-up + 16 slices of 1.5 s)), 1 s
    # per process to start: 12 jobs have 82 s (4.2 passes of 19.5 s), 3 jobs half of 91 s (7.6 passes of 6 s)
    search.budget_s, search.deadline, search.startup_s = 220.0, time.perf_counter() + 220.0, 1.0
    assert search.round("round 3: short", "all", {f"j{i}": cfg for i in range(12)}) is None and not seen
    assert "round 3 not measured" in search.notes[-1] and "under 6 passes of its 13 jobs" in search.notes[-1]
    assert search.round("round 3: three jobs", "all", {f"j{i}": cfg for i in range(3)}) is not None
    assert seen[-1][1].min_passes == 4
    search.verify([Switch("b", {"trainer.seed": 5})], [Switch("b", {"trainer.seed": 5})])
    assert seen[-1][0].title == "verification" and seen[-1][1].min_passes == speed.VERIFICATION_PASSES == 16


def _search(tmp_path, *overrides):
    from types import SimpleNamespace

    import torch

    env = SimpleNamespace(distributed=False, is_main=True, device=torch.device("cpu"))
    search = speed._Search(compose_cfg(*TINY, *overrides), env, tmp_path)
    search.deadline = time.perf_counter() + search.budget_s  # as if the command started now
    return search


def test_the_guard_rejects_a_switch_that_its_builder_skipped_with_the_builder_s_reason(tmp_path, monkeypatch):
    """``compile_regional`` on a model without repeated blocks compiles it whole: the same job as ``compile``, so the
    guard drops it with the reason the builder recorded instead of measuring it twice."""
    from runner.tune.switches import Switch

    def curve(cfg, env, job_dir, steps, plan=None, built=None):
        built["techniques"] = {"compile": "applied", "compile_regional": "skipped: the model has no repeated blocks"}
        return [1.0] * steps, ""

    monkeypatch.setattr(speed, "loss_curve", curve)
    search = _search(tmp_path)
    search.reference = [1.0] * search.t.guard_steps
    assert search.guard_candidates([Switch.of("compile_regional")]) == []
    assert (
        "does not act on this job (compile_regional skipped: the model has no repeated blocks)"
        in search.rows[-1]["verdict"]
    )


def test_the_preset_carries_the_pick_s_compile_cache_and_names_it(tmp_path, monkeypatch):
    """The verification's pick left a signed compile_cache/: the preset's folder gets a checked copy and tuned.yaml
    names it as compile.cache, so the tuned job's first compile loads it; a cache that is not yours is not copied."""
    from omegaconf import OmegaConf

    from runner.techniques import compile_cache
    from runner.tune.switches import Switch
    from test_compile_cache import _entry

    search = _search(tmp_path)
    search.rounds_dir = tmp_path / "out" / "rounds"
    search.chosen_name = "pick"
    pick = [Switch.of("compile"), Switch.of("fused_optimizer")]
    source = search.rounds_dir / "verification" / "pick" / compile_cache.FOLDER
    _entry(source, compile_cache.user_key(create=True))
    folder = search.preset_cache(pick)
    assert folder == tmp_path / "out" / "experiment" / compile_cache.FOLDER
    assert compile_cache.load([folder]).startswith(f"warm: loaded {folder / 'pick'} ")
    preset = OmegaConf.create(speed.tuned_yaml(pick, {"switches": ["compile", "fused_optimizer"]}, cache=folder))
    assert preset.compile == {"mode": "default", "cache": str(folder)} and preset.optimizer.impl == "fused"
    assert search.preset_cache([Switch.of("fused_optimizer")]) is None  # nothing compiled: nothing to carry
    (source / compile_cache.SIGNATURE).unlink()  # not signed as yours: the preset compiles cold, and says so
    assert search.preset_cache(pick) is None and "the preset carries no compile cache" in search.notes[-1]


def test_with_no_elimination_round_the_pick_leaves_out_what_read_slower_alone(tmp_path, monkeypatch):
    """An 8-minute search on the CPU GPT measured round 1 only; the combination it started from kept half_threads
    (×0.74 alone) and its pick ran ×1.14 yours where the combination without it had run ×1.54. With no elimination
    round, the switches that read slower alone leave the pick; the combination without those firmly slower alone is
    verified beside it."""
    from types import SimpleNamespace

    from runner.compare.stats import HURTS
    from runner.tune.switches import Switch

    search = _search(tmp_path)
    sw = {name: Switch(name, {"trainer.seed": i}) for i, name in enumerate(("bf16", "compile", "half_threads"))}
    combination = list(sw.values())
    search.alone = {
        "bf16": SimpleNamespace(estimate=1.3, low=1.1, high=1.5),
        "compile": SimpleNamespace(estimate=0.99, low=0.9, high=1.1),
        "half_threads": SimpleNamespace(estimate=0.72, low=0.63, high=0.81),
    }
    search.rounds = [SimpleNamespace(verdicts={"bf16": "helps", "half_threads": HURTS})]  # round 1 was measured
    monkeypatch.setattr(search, "round", lambda *a, **k: None)  # no time for round 2
    assert search.eliminate(combination, combination) == [sw["bf16"]]
    assert "the pick leaves out compile (×0.990" in search.notes[-1]
    assert search.whole == [sw["bf16"], sw["compile"]]  # verified beside the pick: half_threads firmly hurts
    search.alone["compile"] = SimpleNamespace(estimate=1.01, low=0.9, high=1.1)
    assert search.eliminate(combination, combination) == [sw["bf16"], sw["compile"]]  # nothing else reads slower
